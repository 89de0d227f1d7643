"""Cost-model presets: measured profiles (time coefficients and memory constants) and the memory model
that turns a profile plus an optimiser layout into a ``CostModel`` with ``max_tokens`` per scheme.

Memory model: ``M(S) = L*S*(H/tp)*A_tp + M_states + reserved``; the longest sequence is
``(bound - safety - M_states - reserved) / (L*(H/tp)*A_tp)`` rounded down to 128. ``M_states`` comes in two
forms. The profiled runtime's (the paper's, which the profiles were measured under):
``M_states = (L/os_pp)(H^2/os_tp)*B*alpha/os_dp + (L/pp)(H^2/tp)*B*(1-alpha)
+ (H*V/os_tp)*e(os_pp)*alpha/os_dp + (H*V/tp)*e(pp)*(1-alpha)``, ``e(p) = 32 if p == 1 else 16``
(16 bytes per parameter: B is 16 bytes times the parameters per H^2 per layer, e(p) 16 bytes times the
H x V matrices on a stage). This project's runtime (:data:`HCOMPILE_RUNTIME`): every parameter's fp32 master
weight, optimiser state and shard gradient sharded flat over all GPUs, plus the rank's compute copy (its TP
slice of its stage, parameter and gradient in the compute dtype), plus one send and one receive chunk of the
redistribution.

Activation recomputation (a scheme's ``rc``): a micro-batch keeps only every layer's input and, in the backward,
the activations of the one layer being recomputed, ``(L H 2 + (H/tp) A_tp) / cp`` bytes per token
(:func:`activation_bytes_per_token`), and runs every layer's forward twice (:data:`RECOMPUTE_TIME`). It is a
property of a scheme, so a plan recomputes only on the replicas that hold long sequences.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from passes.plan.ir import CostModel, ParallelScheme, PlanError, SchemeCost, Strategy
from passes.plan.links import Links
from passes.plan.placement import group_aligns

__all__ = [
    "Profile",
    "PRESET_MODELS",
    "PRESET_HARDWARE",
    "load_profile",
    "load_profile_file",
    "state_bytes",
    "max_tokens_for",
    "device_reserve",
    "activation_bytes_per_token",
    "build_cost_model",
    "default_optimizer_layout",
    "RuntimeMemory",
    "hcompile_runtime",
    "HCOMPILE_RUNTIME",
    "TRAINER_PIECES",
    "MEMORY_MODELS",
    "RECOMPUTE_MODES",
    "RECOMPUTE_TIME",
    "LAYER_INPUT_BYTES",
    "with_recompute_time",
]

MIB = 2**20
GIB = 2**30
TOKEN_ROUNDING = 128
PRESET_MODELS = ("llama-7b", "llama-13b", "llama-32b")
PRESET_HARDWARE = ("a800-80g",)
_PROFILE_FILES = {"a800-80g": "a800-{model}.json"}


PROFILED_BYTES_PER_PARAM = 16.0
"""What the profiled runtime keeps per parameter (fp32 master and Adam moments, the ``alpha`` = 0.75 that its
optimiser layout shards; bf16 parameter and gradient per compute copy): B / 16 is parameters per H^2 per layer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeMemory:
    """What a training runtime keeps on one GPU besides activations, per parameter and fixed."""

    name: str
    """Short name (``hcompile``)."""
    sharded_bytes: float
    """Bytes per parameter sharded flat over every GPU of the job (master weights, optimiser state, the
    shard's gradient)."""
    compute_bytes: float
    """Bytes per parameter of the rank's compute copy, its TP slice of its pipeline stage (the parameter in the
    compute dtype and its gradient buffer in the accumulation dtype)."""
    buffer_bytes: float = 0.0
    """Fixed bytes of transfer buffers."""
    param_bytes: float = 0.0
    """Of ``compute_bytes``, the compute-dtype parameter itself (the rest: its gradient buffer); 0: not said. A
    compiled piece's backward also hands out its parameters' gradients in this dtype at once."""
    pieces: int = 1
    """Compiled pieces each stage is cut into (overlapped movement): one piece's gradients are out at once."""
    step_bytes: float = 0.0
    """Working memory of the optimiser's step per parameter of the rank's shard (after the backward, when the
    activations are gone): AdamW's foreach step holds about two fp32 temporaries per element."""

    def __post_init__(self) -> None:
        for name in ("sharded_bytes", "compute_bytes", "buffer_bytes", "param_bytes", "step_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise PlanError(f"runtime memory {name} must be a finite number >= 0, got {value!r}")
        if isinstance(self.pieces, bool) or not isinstance(self.pieces, int) or self.pieces < 1:
            raise PlanError(f"runtime memory pieces must be a positive integer, got {self.pieces!r}")
        if self.param_bytes > self.compute_bytes:
            raise PlanError(f"runtime memory param_bytes ({self.param_bytes!r}) is more than compute_bytes "
                            f"({self.compute_bytes!r})")


TRAINER_PIECES = 4
"""Pieces a trainer cuts each stage into by default (``TrainOptions.movement_pieces`` with overlapped movement)."""


def hcompile_runtime(param_bytes: int = 2, reduce_bytes: int = 4, optimizer_bytes: int = 8,
                     chunk_numel: int = 1 << 24, grad_bytes: int = 4, pieces: int = TRAINER_PIECES,
                     step_bytes: float = 8.0) -> RuntimeMemory:
    """This project's runtime: fp32 master (4), optimiser state (``optimizer_bytes``, 8 for Adam) and the fp32
    shard gradient (4) per parameter over all GPUs; the compute copy's parameter in the compute dtype
    (``param_bytes``) and its gradient buffer in the accumulation dtype (``grad_bytes``, 4: micro-batches
    accumulate in fp32 whatever the compute dtype); one send and one receive chunk of ``chunk_numel`` elements;
    each stage cut into ``pieces`` compiled pieces; ``step_bytes`` of the optimiser step's temporaries per shard
    element (AdamW's foreach step, measured by the rehearsal: about two fp32 per element)."""
    return RuntimeMemory(name="hcompile", sharded_bytes=4 + optimizer_bytes + 4, compute_bytes=param_bytes + grad_bytes,
                         buffer_bytes=2 * chunk_numel * max(param_bytes, reduce_bytes), param_bytes=param_bytes,
                         pieces=pieces, step_bytes=step_bytes)


HCOMPILE_RUNTIME = hcompile_runtime()
"""bf16 compute copies, fp32 gradient accumulation and reduction, Adam, 16M-element chunks."""
RECOMPUTE_MODES = ("auto", "on", "off")
"""Activation recomputation in a plan: ``auto`` recomputes only when some sequence is longer than every scheme
holds without it (with context parallelism where that is planned); ``on``; ``off``."""
RECOMPUTE_TIME = 4.0 / 3.0
"""What recomputing every layer's forward in its backward costs, over the plain forward and backward: the
forward again (a third of a layer's forward and backward FLOPs, backward = 2 x forward; flash attention's
backward is nearer 2.5 x its forward, so the attention is charged a little over). An assumption: a GPU
measures it (``python -m benchmarks.recompute`` on a GPU machine); Megatron reports 30-40% for full
recomputation (Korthikanti et al., 2022)."""
LAYER_INPUT_BYTES = 2
"""Bytes per hidden unit of the layer input a recomputing micro-batch keeps per layer and token (bf16). This
runtime's tensor parallelism does not split the sequence, so every rank of a TP group keeps the whole input."""
MEMORY_MODELS = ("hcompile", "paper")
"""``hcompile``: :data:`HCOMPILE_RUNTIME`; ``paper``: the profiled runtime's model."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Measured facts about one model on one kind of GPU: time coefficients and memory constants."""

    name: str
    """``model@hardware``."""
    layers: int
    """Transformer layers L."""
    hidden: int
    """Hidden size H."""
    vocab: int
    """Vocabulary size V."""
    gpus_per_node: int
    """GPUs per node."""
    memory_bound_mib: float
    """Usable device memory, MiB."""
    reserved_mib: float
    """Memory reserved per GPU (framework, communication buffers), MiB."""
    safety_gib: float
    """Safety margin kept free, GiB."""
    state_bytes_per_h2_layer: float
    """B: bytes of parameters+gradients+optimiser state per H^2 per layer."""
    shardable_fraction: float
    """alpha: share of the states that the optimiser layout shards."""
    activation_bytes: tuple[tuple[int, float], ...]
    """A_tp: activation bytes per token per hidden unit per layer, by TP degree."""
    coefficients: tuple[tuple[ParallelScheme, float, float, float], ...]
    """(scheme, a, b, c) per profiled scheme."""
    ffn_hidden: int | None = None
    """SwiGLU inner width, when the profile says (what the planner's count of parameter movement needs)."""
    heads: int | None = None
    """Attention heads, when the profile says."""
    kv_heads: int | None = None
    """Key/value heads (None with ``heads`` given: as many as ``heads``)."""
    links: Links | None = None
    """The links the profile measured (``hcompile profile``: gloo or NCCL between its local ranks); None: the
    hardware preset's."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "vocab", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"profile {self.name!r}: {name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.shardable_fraction <= 1.0:
            raise PlanError(f"profile {self.name!r}: shardable fraction must be in [0, 1], "
                            f"got {self.shardable_fraction!r}")
        for scheme, a, b, c in self.coefficients:
            SchemeCost(scheme=scheme, a=a, b=b, c=c, max_tokens=0)  # validates the numbers

    def activation_bytes_for(self, tp: int) -> float:
        """A_tp for one TP degree; an unprofiled degree is an error naming the known ones."""
        table = dict(self.activation_bytes)
        if tp not in table:
            raise PlanError(f"profile {self.name!r} has no activation size for tp={tp}; known: {sorted(table)}")
        return table[tp]

    @property
    def schemes(self) -> tuple[ParallelScheme, ...]:
        """Every profiled scheme."""
        return tuple(s for s, *_ in self.coefficients)

    @classmethod
    def from_dict(cls, data: dict, name: str | None = None) -> "Profile":
        """Parse the JSON form of ``shared/data/profiles`` (and of ``hcompile profile`` output); a missing or
        malformed field is a :class:`PlanError` that names it."""
        label = name or "?"
        try:
            model, hw, mem = data["model"], data["hardware"], data["memory"]
            table = mem["activation_bytes_per_token_hidden_layer"]
            if not isinstance(table, dict):
                raise PlanError(f"profile {label}: activation_bytes_per_token_hidden_layer must be an object "
                                f"{{tp: bytes}}, got {type(table).__name__}")
            coefficients = tuple(
                (ParallelScheme(tp=_whole(s["tp"], "tp", label), pp=_whole(s["pp"], "pp", label),
                                cp=_whole(s.get("cp", 1), "cp", label)),
                 float(s["a"]), float(s["b"]), float(s["c"]))
                for s in data["schemes"]
            )
            return cls(
                name=name or f"{model['name']}@{hw.get('name', hw.get('gpu', 'unknown'))}",
                layers=_whole(model["layers"], "layers", label), hidden=_whole(model["hidden"], "hidden", label),
                vocab=_whole(model["vocab"], "vocab", label),
                gpus_per_node=_whole(hw["gpus_per_node"], "gpus_per_node", label),
                memory_bound_mib=_finite(hw["memory_bound_mib"], "memory_bound_mib", label),
                reserved_mib=_finite(hw["reserved_mib_per_gpu"], "reserved_mib_per_gpu", label),
                safety_gib=_finite(mem["safety_margin_gib"], "safety_margin_gib", label),
                state_bytes_per_h2_layer=_finite(mem["state_bytes_per_hidden2_layer"], "state_bytes_per_hidden2_layer",
                                                 label, positive=True),
                shardable_fraction=_finite(data["optimizer_shardable_fraction"], "optimizer_shardable_fraction",
                                           label),
                activation_bytes=tuple(sorted((_whole(k, "activation table tp", label),
                                               _finite(v, f"activation bytes of tp {k}", label, positive=True))
                                              for k, v in table.items())),
                coefficients=coefficients,
                ffn_hidden=_whole(model["ffn_hidden"], "ffn_hidden", label) if "ffn_hidden" in model else None,
                heads=_whole(model["heads"], "heads", label) if "heads" in model else None,
                kv_heads=_whole(model["kv_heads"], "kv_heads", label) if "kv_heads" in model else None,
                links=_links(hw, label),
            )
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanError(f"profile {label} is missing or has a malformed field: {exc!r}") from None


def _links(hw: dict, label: str) -> Links | None:
    """The measured links of a profile's ``hardware`` entry (``intra_gbps``, ``inter_gbps``, ``latency_us``, and
    ``fresh_gbps`` and ``freed_gbps`` where new memory is slow to write and to free, ``warm_gbps`` where copies
    between buffers count and ``host_gbps`` where the ranks share a host's cores: CPU machines), None when it has
    none."""
    names = ("intra_gbps", "inter_gbps", "latency_us")
    if not any(n in hw for n in names):
        return None
    missing = [n for n in names if n not in hw]
    if missing:
        raise PlanError(f"profile {label}: the hardware entry gives links without {', '.join(missing)}")
    fresh = _finite(hw["fresh_gbps"], "fresh_gbps", label, positive=True) if "fresh_gbps" in hw else None
    freed = _finite(hw["freed_gbps"], "freed_gbps", label, positive=True) if "freed_gbps" in hw else None
    warm = _finite(hw["warm_gbps"], "warm_gbps", label, positive=True) if "warm_gbps" in hw else None
    host = _finite(hw["host_gbps"], "host_gbps", label, positive=True) if "host_gbps" in hw else None
    slowdown = _finite(hw["overlap_slowdown"], "overlap_slowdown", label) if "overlap_slowdown" in hw else 0.0
    return Links(gpus_per_node=_whole(hw["gpus_per_node"], "gpus_per_node", label),
                 intra_gbps=_finite(hw["intra_gbps"], "intra_gbps", label, positive=True),
                 inter_gbps=_finite(hw["inter_gbps"], "inter_gbps", label, positive=True),
                 latency_us=_finite(hw["latency_us"], "latency_us", label),
                 fresh_gbps=fresh, freed_gbps=freed, warm_gbps=warm, host_gbps=host, overlap_slowdown=slowdown)


def _whole(value: object, field: str, where: str) -> int:
    """A positive integer given as a JSON integer or an integral string."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"profile {where}: {field} must be a positive integer, got {value!r}")
    return value


def _finite(value: object, field: str, where: str, positive: bool = False) -> float:
    """A finite number (>= 0, or > 0 when ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise PlanError(f"profile {where}: {field} must be a finite number {bound}, got {value!r}")
    return float(value)


def load_profile(model: str, hardware: str = "a800-80g") -> Profile:
    """The preset profile of ``model`` (``llama-7b``/``llama-13b``/``llama-32b``) on ``hardware``."""
    if model not in PRESET_MODELS:
        raise PlanError(f"unknown model {model!r}; known: {', '.join(PRESET_MODELS)}")
    if hardware not in PRESET_HARDWARE:
        raise PlanError(f"unknown hardware {hardware!r}; known: {', '.join(PRESET_HARDWARE)}")
    filename = _PROFILE_FILES[hardware].format(model=model)
    text = resources.files("passes.plan").joinpath("data", "profiles", filename).read_text()
    return Profile.from_dict(json.loads(text), name=f"{model}@{hardware}")


def load_profile_file(path: str | Path) -> Profile:
    """A profile JSON written by ``hcompile profile`` or in the presets' format."""
    path = Path(path)
    if path.is_dir():
        raise PlanError(f"profile file {str(path)!r} is a folder, expected a JSON file")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"profile file {str(path)!r} does not exist") from None
    except UnicodeDecodeError:
        raise PlanError(f"profile file {str(path)!r} is not a text file") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"profile file {str(path)!r} is not valid JSON: {exc}") from None
    return Profile.from_dict(data, name=path.stem)


def _embedding_factor(pp: int) -> int:
    return 32 if pp == 1 else 16


def state_bytes(profile: Profile, scheme: ParallelScheme, layout: Strategy,
                runtime: RuntimeMemory | None = None) -> float:
    """M_states of ``scheme`` on one GPU when the optimiser layout is the homogeneous ``layout``: the profiled
    runtime's when ``runtime`` is None, else ``runtime``'s (which shards flat over ``layout.gpus``)."""
    if not layout.is_homogeneous:
        raise PlanError(f"the optimiser layout must be homogeneous, got {layout.describe()}")
    os_scheme, os_dp = layout.parts[0]
    L, H, V = profile.layers, profile.hidden, profile.vocab
    B, alpha = profile.state_bytes_per_h2_layer, profile.shardable_fraction
    tp, pp = scheme.tp, scheme.pp
    if runtime is not None:
        per_h2 = B / PROFILED_BYTES_PER_PARAM  # parameters per H^2 per layer
        total = L * H * H * per_h2 + 2 * H * V
        on_stage = (L / pp) * (H * H / tp) * per_h2 + (H * V / tp) * _embedding_factor(pp) / PROFILED_BYTES_PER_PARAM
        transient = on_stage / runtime.pieces * runtime.param_bytes  # one compiled piece's gradients out at once
        return (total * runtime.sharded_bytes / layout.gpus + on_stage * runtime.compute_bytes + transient
                + runtime.buffer_bytes)
    return (
        (L / os_scheme.pp) * (H * H / os_scheme.tp) * B * alpha / os_dp
        + (L / pp) * (H * H / tp) * B * (1 - alpha)
        + (H * V / os_scheme.tp) * _embedding_factor(os_scheme.pp) * alpha / os_dp
        + (H * V / tp) * _embedding_factor(pp) * (1 - alpha)
    )


def activation_bytes_per_token(profile: Profile, scheme: ParallelScheme) -> float:
    """Activation bytes one rank of ``scheme`` keeps per token of a micro-batch: every layer's activations
    (``L (H/tp) A_tp / cp``; 1F1B keeps pp micro-batches of L/pp layers on the first stage), or with recomputation
    (``scheme.rc``) every layer's input (:data:`LAYER_INPUT_BYTES` per hidden unit, whole on every TP rank) and one
    layer's activations, the one being recomputed (``(L H 2 + (H/tp) A_tp) / cp``)."""
    layer = (profile.hidden / scheme.tp) * profile.activation_bytes_for(scheme.tp)
    if scheme.rc:
        return (profile.layers * profile.hidden * LAYER_INPUT_BYTES + layer) / scheme.cp
    return profile.layers * layer / scheme.cp


def device_reserve(profile: Profile, gpus: int, runtime: RuntimeMemory | None = None) -> float:
    """Bytes of a GPU no tensor of the step may use: what the profile's hardware section reserves (the framework
    and the profiled runtime's communication buffers, and a safety margin, which cover the CUDA context and the
    collective communicators); with ``runtime`` (this project's) on GPUs also the point-to-point buffers its
    movement communicator opens to each of the job's other ``gpus - 1`` ranks
    (``passes.plan.memory.NCCL_P2P_PEER_BYTES`` each). A profile measured on CPU ranks (``hcompile profile``
    there) reserves nothing and has no NCCL."""
    reserve = profile.safety_gib * GIB + profile.reserved_mib * MIB
    if runtime is None or profile.reserved_mib <= 0:
        return reserve
    from passes.plan.memory import NCCL_P2P_PEER_BYTES  # it imports this module

    return reserve + max(gpus - 1, 0) * NCCL_P2P_PEER_BYTES


def max_tokens_for(profile: Profile, scheme: ParallelScheme, layout: Strategy,
                   runtime: RuntimeMemory | None = None) -> int:
    """Longest micro-batch (tokens, multiple of 128, 0 when nothing fits) of ``scheme`` under ``layout``
    (``runtime`` as in :func:`state_bytes`; activations as :func:`activation_bytes_per_token` counts them)."""
    free = profile.memory_bound_mib * MIB - device_reserve(profile, layout.gpus, runtime) \
        - state_bytes(profile, scheme, layout, runtime)
    per_token = activation_bytes_per_token(profile, scheme)
    tokens = int(math.floor(free / per_token / TOKEN_ROUNDING)) * TOKEN_ROUNDING
    return max(tokens, 0)


def with_recompute_time(entry: SchemeCost) -> SchemeCost:
    """``entry`` with every layer's forward run again in its backward: its attention and per-token terms times
    :data:`RECOMPUTE_TIME` (the fixed term, launches and the step's edges, kept)."""
    return replace(entry, a=entry.a * RECOMPUTE_TIME, b=entry.b * RECOMPUTE_TIME)


def build_cost_model(profile: Profile, optimizer_layout: Strategy, runtime: RuntimeMemory | None = None,
                     recompute: bool = False) -> CostModel:
    """Every profiled scheme with its coefficients and its ``max_tokens`` under ``optimizer_layout``
    (``runtime`` as in :func:`state_bytes`); with ``recompute``, each one's recomputing twin beside it
    (``rc``: the caps of :func:`activation_bytes_per_token`, the time of :func:`with_recompute_time`)."""
    entries = [SchemeCost(scheme=s, a=a, b=b, c=c, max_tokens=max_tokens_for(profile, s, optimizer_layout, runtime))
               for s, a, b, c in profile.coefficients if not s.rc]
    if recompute:
        twins = [replace(e.scheme, rc=True) for e in entries]
        entries += [with_recompute_time(replace(e, scheme=twin,
                                                max_tokens=max_tokens_for(profile, twin, optimizer_layout, runtime)))
                    for e, twin in zip(entries, twins)]
    memory = "" if runtime is None else f" {runtime.name} memory"
    again = " recomputed" if recompute else ""
    return CostModel(name=f"{profile.name} layout {optimizer_layout.describe()}{memory}{again}",
                     entries=tuple(entries), gpus_per_node=profile.gpus_per_node)


def default_optimizer_layout(profile: Profile, gpus: int, longest_seq: int,
                             runtime: RuntimeMemory | None = None, longest_held: bool = False,
                             recompute: bool = False) -> Strategy:
    """The homogeneous strategy sized for ``longest_seq``: the fewest GPUs per replica whose scheme holds it
    under its own layout (ties: fewer pipeline stages). ``4x(tp16,pp1)`` for llama-32b on 64 GPUs. With
    ``longest_held``, a sequence longer than every scheme holds gets the layout sized for the longest one held
    (the layout context parallelism extends) instead of an error. ``recompute``: a scheme holds what its
    recomputing twin holds (:func:`activation_bytes_per_token`)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"the GPU count must be a positive integer, got {gpus!r}")
    candidates, supported = [], []
    for scheme in profile.schemes:
        if gpus % scheme.gpus or not group_aligns(scheme.tp * scheme.cp, profile.gpus_per_node):
            continue
        layout = Strategy.homogeneous(scheme, gpus)
        tokens = max_tokens_for(profile, replace(scheme, rc=recompute), layout, runtime)
        supported.append(tokens)
        if tokens >= longest_seq:
            candidates.append((scheme.gpus, scheme.pp, scheme.cp, -scheme.tp, layout))
    if not supported:
        sizes = sorted({s.gpus for s in profile.schemes})
        raise PlanError(f"no strategy of {profile.name} fills {gpus} GPUs (replica sizes: {sizes})")
    if not candidates and longest_held:
        return default_optimizer_layout(profile, gpus, max(supported), runtime, recompute=recompute)
    if not candidates:
        raise PlanError(f"a sequence of {longest_seq} tokens is longer than every scheme of {profile.name} can hold "
                        f"on {gpus} GPUs (longest supported: {max(supported)} tokens)")
    return min(candidates, key=lambda c: c[:4])[-1]
