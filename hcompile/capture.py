"""Capture: record a model's forward as one FX GraphModule through a torch.compile backend.

Owns the recording backend and the normalisation of what dynamo hands it. Dynamo lifts parameters and
buffers to graph inputs; capture turns those placeholders back into ``get_attr`` nodes named by their
fully qualified names (``h.0.attn.c_attn.weight``) on a GraphModule whose root is the model, so the
captured graph holds the model's own Parameter objects (gradients land on the model) and takes only the
user's inputs. Every node keeps dynamo's fake value in ``meta["val"]`` for shape-aware passes. Asked for
another compute dtype or device than the model's (or given a model on the meta device), capture traces meta
stand-ins instead and the graph holds meta tensors, to be replaced by the runtime's before it runs.

The capture is full-graph: a model that graph-breaks raises :class:`CaptureError` naming the break. The
graph returns one output, the logits (the model's tensor result, or its ``.logits``).
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx, nn

__all__ = ["CaptureError", "Captured", "capture", "without_kv_cache"]


class CaptureError(RuntimeError):
    """The model could not be captured as one graph; the message names the break or the bad input."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Captured:
    """One captured forward graph with the inputs it was recorded on."""

    graph_module: fx.GraphModule
    """The forward; its placeholders are the user inputs, parameters are ``get_attr`` nodes."""
    example_inputs: tuple[torch.Tensor, ...]
    """The user inputs (in placeholder order) the graph was recorded on."""
    param_names: tuple[str, ...]
    """Fully qualified names of the parameters the graph reads, in first-use order."""


def _recording_backend(store: list) -> Callable:
    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if store:
            raise CaptureError("the forward was captured as more than one graph")
        record: dict[str, Any] = {"gm": gm, "inputs": list(example_inputs)}
        store.append(record)

        def run(*args: Any) -> Any:
            outputs = gm.forward(*args)
            record.setdefault("outputs", outputs)
            return outputs

        return run

    return backend


def _describe_break(exc: Exception) -> str:
    """The break's reason, the user line that caused it and where it is."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    head = lines[0] if lines else type(exc).__name__
    user = [i for i, ln in enumerate(lines) if ln.startswith("from user code:")]
    tail = lines[user[-1] + 1: user[-1] + 3] if user else [ln for ln in lines if ln.startswith('File "')][-1:]
    return f"{head} | {' '.join(tail)}" if tail else head


def capture(model: nn.Module, *args: torch.Tensor, dtype: torch.dtype | None = None,
            device: torch.device | str | None = None, logits: bool = False) -> Captured:
    """Record ``model(*args)`` as one normalised GraphModule; a graph break is a :class:`CaptureError`, as is a
    model without a ``forward`` of its own.

    ``dtype`` / ``device``: trace as if the floating-point parameters had that dtype and everything lived on
    that device (what a runtime's compute copies will have). When either differs from the model's, or the
    model's parameters are on the meta device, the model is traced on meta stand-ins (its own tensors are
    restored untouched, nothing of its size is allocated): the graph then holds meta tensors and meta device
    constants, which a runtime replaces with its own tensors and device before running it
    (``Variant.bind_``). ``logits``: ``args[0]`` is ``input_ids`` (B, T), and what the model returns must be
    floating-point logits (B, T, vocab) (a tensor, or an object with ``.logits``); anything else is a
    :class:`CaptureError` saying what it returned."""
    forward = getattr(model, "forward", None)
    if getattr(forward, "__func__", forward) is _FORWARD_UNIMPLEMENTED:
        raise CaptureError(f"{type(model).__name__} has no forward: nn.Module subclasses define forward(self, "
                           f"input_ids) returning logits (batch, tokens, vocab)")
    params = list(model.parameters())
    device = torch.device(device) if device is not None else (args[0].device if args else torch.device("cpu"))
    shadow = (any(p.device.type == "meta" for p in params)
              or (dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in params))
              or any(p.device != device for p in params))
    with without_kv_cache(model):
        if not shadow:
            record, user_out = _trace(model, args)
            gm, names = _normalise(model, record["gm"], record["inputs"], args)
        else:
            with _meta_stand_ins(model, dtype):
                meta_args = tuple(a.to("meta") for a in args)
                record, user_out = _trace(model, meta_args)
                gm, names = _normalise(model, record["gm"], record["inputs"], meta_args, stand_ins=True)
    _functionalise_buffer_copies(gm)
    _functionalise_in_place(gm, type(model).__name__)
    _keep_only_output(gm, _output_index(record.get("outputs"), user_out))
    if logits:
        _check_logits(type(model).__name__, gm, args[0])
    _drop_empty_concat_operands(gm)
    return Captured(graph_module=gm, example_inputs=tuple(args), param_names=names)


@contextlib.contextmanager
def without_kv_cache(model: nn.Module) -> Iterator[None]:
    """A Hugging Face model (``model.config.use_cache``) traced without its inference cache: training reads
    keys and values of the whole sequence, never a cache."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "use_cache"):
        yield
        return
    saved = config.use_cache
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = saved


def _functionalise_buffer_copies(gm: fx.GraphModule) -> None:
    """A buffer the forward overwrites (``buffer.copy_(value)``, as Hugging Face's longrope and dynamic RoPE
    update ``inv_freq``) is read as ``value`` from there on: the graph keeps what the forward computes instead of
    dropping the write as dead code and reading the stale buffer."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in list(gm.graph.nodes):
        if not (node.op == "call_method" and node.target == "copy_" and len(node.args) >= 2
                and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"):
            continue
        buffer, value = node.args[0], node.args[1]
        for user in list(buffer.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(buffer, value)
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()


_VIEWS = frozenset({"view", "reshape", "transpose", "permute", "expand", "narrow", "squeeze", "unsqueeze", "t",
                    "unflatten", "flatten", "view_as", "expand_as", "as_strided", "diagonal", "select", "detach",
                    "contiguous", "unfold", "movedim", "swapaxes", "mT", "T"})


def _aliases(node: fx.Node) -> bool:
    """Whether ``node`` may share memory with another value of the graph (a view, or a slice of a tensor)."""
    if node.op in ("placeholder", "get_attr"):
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name in _VIEWS:
        return True
    if node.op == "call_function" and node.target is operator.getitem and node.args:
        source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return isinstance(source, torch.Tensor) and not any(isinstance(i, fx.Node) for i in index)
    return False


def _functionalise_in_place(gm: fx.GraphModule, model: str) -> None:
    """An in-place method on an intermediate (``out.add_(bias)``, ``ids.clamp_(0, n)``, as Hugging Face's expert
    layers write them) becomes its out-of-place form, and what reads the tensor after it reads the result:
    otherwise dead-code elimination, which sees an unused result, drops the update (silently: GPT-OSS's expert
    biases were lost this way). An in-place update of a view, a parameter or an input, whose effect reaches
    other values, is a CaptureError."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_method" or not isinstance(target, str) or not target.endswith("_") or \
                target.startswith("_") or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        base, pure = node.args[0], target[:-1]
        if _aliases(base) or not hasattr(torch.Tensor, pure):
            raise CaptureError(f"{model} could not be captured: node {node.name!r} updates {base.name!r} in place "
                               f"({target}), which shares memory with other values of the forward; write it out of "
                               "place")
        for user in list(base.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(base, node)
        node.target = pure
        changed = True
    if changed:
        gm.recompile()


def _keep_only_output(gm: fx.GraphModule, index: int) -> None:
    """The graph returns the logits alone (what training reads); whatever only fed other outputs goes."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    output.args = ((values[index],),)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _drop_empty_concat_operands(gm: fx.GraphModule) -> None:
    """``torch.cat`` operands with no elements (an empty cache a model concatenates to) are left out; a
    concatenation of one tensor is that tensor."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.cat or not isinstance(node.args[0], (list, tuple)):
            continue
        parts = [a for a in node.args[0] if not (isinstance(a, fx.Node) and _empty(a))]
        if len(parts) == len(node.args[0]) or not parts:
            continue
        changed = True
        if len(parts) == 1 and isinstance(parts[0], fx.Node):
            node.replace_all_uses_with(parts[0])
            gm.graph.erase_node(node)
        else:
            node.args = (parts, *node.args[1:])
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()


def _empty(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.numel() == 0


def _trace(model: nn.Module, args: Sequence[torch.Tensor]) -> tuple[dict, Any]:
    store: list = []
    compiled = torch.compile(model, backend=_recording_backend(store), fullgraph=True, dynamic=False)
    try:
        with torch._dynamo.config.patch(recompile_limit=1 << 20, accumulated_recompile_limit=1 << 20):
            user_out = compiled(*args)
    except CaptureError:
        raise
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
        raise CaptureError(f"{type(model).__name__} graph-breaks: {_describe_break(exc)}") from exc
    except torch._dynamo.exc.TorchDynamoException as exc:
        raise CaptureError(f"{type(model).__name__} graph-breaks: {_describe_break(exc)}") from exc
    except Exception as exc:  # noqa: BLE001 - dynamo itself failing on this model: say so, not a bare KeyError
        raise CaptureError(f"{type(model).__name__} could not be captured: torch.compile failed while tracing it "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    if not store:
        raise CaptureError(f"{type(model).__name__}: dynamo produced no graph (was the forward already compiled?)")
    return store[0], user_out


@contextlib.contextmanager
def _meta_stand_ins(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Within the block every parameter is a meta Parameter (floating ones in ``dtype``; a tied parameter stays
    one object) and every buffer a meta copy; afterwards the model's own tensors are back."""
    stand_in: dict[int, nn.Parameter] = {}
    saved = []
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) not in stand_in:
                kind = dtype if dtype is not None and p.is_floating_point() else p.dtype
                stand_in[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=kind, device="meta"),
                                               requires_grad=p.requires_grad)
            saved.append((mod._parameters, name, p))
        for name, buf in mod._buffers.items():
            if buf is not None:
                saved.append((mod._buffers, name, buf))
    try:
        for table, name, value in saved:
            table[name] = stand_in[id(value)] if isinstance(value, nn.Parameter) else value.to("meta")
        yield
    finally:
        for table, name, value in saved:
            table[name] = value


_FORWARD_UNIMPLEMENTED = nn.Module.forward
"""What ``forward`` is on a module that defines none (torch raises NotImplementedError when it is called)."""


def _check_logits(model: str, gm: fx.GraphModule, input_ids: torch.Tensor) -> None:
    """The graph's output is floating-point logits (B, T, vocab) of ``input_ids`` (B, T); otherwise a
    CaptureError saying what it is."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    val = out.meta.get("val") if isinstance(out, fx.Node) else out
    if not isinstance(val, torch.Tensor):
        return  # nothing known of it here: the self-check runs it
    batch, tokens = tuple(input_ids.shape[:2])
    if val.dim() == 3 and tuple(val.shape[:2]) == (batch, tokens) and val.is_floating_point():
        return
    what = "a scalar" if val.dim() == 0 else f"a tensor of shape {tuple(val.shape)}"
    raise CaptureError(f"{model} returned {what} of {val.dtype} for input_ids of shape {(batch, tokens)}: expected "
                       f"floating-point logits of shape (batch, tokens, vocab) = ({batch}, {tokens}, vocab), one row "
                       f"of vocabulary scores per token (a tensor, or an object with .logits)")


def _output_index(graph_outputs: Any, user_out: Any) -> int:
    target = user_out if isinstance(user_out, torch.Tensor) else getattr(user_out, "logits", None)
    if target is None:
        raise CaptureError(f"the model returned {type(user_out).__name__}: expected a tensor or an object with .logits")
    for i, out in enumerate(graph_outputs or ()):
        if out is target:
            return i
    raise CaptureError("the model's logits are not a graph output (computed outside the graph?)")


def _normalise(
    model: nn.Module, gm: fx.GraphModule, inputs: list, user_args: Sequence[torch.Tensor], stand_ins: bool = False
) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """Placeholders for parameters/buffers become ``get_attr`` on the model; user inputs stay placeholders.
    ``stand_ins``: the model holds meta stand-ins; the graph keeps copies of them, not the model's Parameters."""
    by_id = {id(t): name for name, t in model.named_buffers(remove_duplicate=True)}
    by_id.update({id(p): name for name, p in model.named_parameters(remove_duplicate=True)})
    user_ids = {id(a) for a in user_args}
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise CaptureError(f"dynamo graph has {len(placeholders)} inputs but {len(inputs)} example inputs")
    names: list[str] = []
    consts: dict[str, torch.Tensor] = {}
    for node, value in zip(placeholders, inputs):
        node.meta["val"] = node.meta.get("example_value")
        if id(value) in user_ids or not isinstance(value, torch.Tensor):
            continue
        if id(value) in by_id:
            target = by_id[id(value)]
            if isinstance(value, nn.Parameter):
                names.append(target)
        else:
            target = f"_capture_const_{len(consts)}"
            consts[target] = value
        with graph.inserting_before(node):
            attr = graph.create_node("get_attr", target)
        attr.meta.update(node.meta)
        node.replace_all_uses_with(attr)
        graph.erase_node(node)
    for node in graph.nodes:
        if "val" not in node.meta and "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]
    params = dict(model.named_parameters())
    if stand_ins:  # the parameters' meta data, in Parameters of their own (the model's come back real)
        params = {n: nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for n, p in params.items()}
    tensors: dict[str, torch.Tensor] = {**dict(model.named_buffers()), **params, **consts}
    root = nn.Module()
    for name in [n.target for n in graph.nodes if n.op == "get_attr"]:
        if name not in tensors:  # a subgraph dynamo made (torch.autograd.Function, checkpoint, ...)
            user = next(n for n in graph.nodes if n.op == "get_attr" and n.target == name).users
            ops = sorted({str(getattr(u.target, "__name__", u.target)) for u in user})
            raise CaptureError(f"{type(model).__name__} could not be captured: its forward runs a subgraph "
                               f"{name!r} through {', '.join(ops)} (a torch.autograd.Function or activation "
                               "checkpointing inside the model), which hcompile does not rewrite yet")
        _set_path(root, name, tensors[name])
    out = fx.GraphModule(root, graph, class_name=f"Captured{type(model).__name__}")
    out.graph.lint()
    return out, tuple(names)


def _set_path(root: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)
