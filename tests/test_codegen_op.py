"""The packed-attention custom op: opcheck, torch.compile capture without recompiles, backend choice, and the
input contract (ValueError naming the bad value before any kernel runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from codegen_cases import make_batch, relative_error
from torch._dynamo.testing import CompileCounterWithBackend

import codegen


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _op_args(batch, kernel: str, causal: bool = True, softcap: float | None = None) -> tuple:
    return (*batch.inputs(), causal, batch.q.shape[2] ** -0.5, softcap, kernel)


@pytest.mark.parametrize("kernel", ["reference", "cpu-flash", "triton"])
def test_opcheck_forward(kernel):
    batch = make_batch([3, 0, 18], heads_q=4, heads_kv=2, head_dim=16)
    torch.library.opcheck(codegen.packed_attention_op, _op_args(batch, kernel))


@pytest.mark.parametrize("kernel", ["reference", "cpu-flash"])
def test_opcheck_backward_op(kernel):
    batch = make_batch([5, 9], heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = (x.detach() for x in (batch.q, batch.k, batch.v))
    out, lse = codegen.packed_attention_op(q, k, v, batch.cu_seqlens, 9, True, 0.25, None, kernel)
    args = (torch.randn_like(out), q, k, v, out, lse, batch.cu_seqlens, 9, True, 0.25, None, kernel)
    torch.library.opcheck(codegen.packed_attention_backward_op, args)


def _loss(q, k, v, cu_seqlens, max_seqlen):
    out = codegen.packed_attention(q, k, v, cu_seqlens, max_seqlen, kernel="reference")
    return (out * out).sum()


# (lengths): total tokens, sequence counts and max_seqlen all change from call to call.
VARYING_BATCHES = [[5, 9, 3], [7, 2, 11, 6], [30, 2], [4, 4, 4, 4, 4, 13, 1], [23]]


def test_compiles_once_for_all_lengths_and_sequence_counts():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss, backend=counter, fullgraph=True, dynamic=True)
    for lengths in VARYING_BATCHES:
        # 6 query heads, 2 kv heads: no head count coincides with a token or sequence count of the first batch,
        # so duck sizing ties no symbols together.
        batch = make_batch(lengths, heads_q=6, heads_kv=2, head_dim=16, seed=len(lengths))
        loss = compiled(*batch.inputs())
        loss.backward()
        eager = make_batch(lengths, heads_q=6, heads_kv=2, head_dim=16, seed=len(lengths))
        _loss(*eager.inputs()).backward()
        assert relative_error(loss.detach(), _loss(*eager.inputs()).detach()) < 1e-6
        for got, want in ((batch.q, eager.q), (batch.k, eager.k), (batch.v, eager.v)):
            assert relative_error(got.grad, want.grad) < 1e-5
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} compiles for {len(VARYING_BATCHES)} batches"
    assert counter.op_count >= 1


def test_bucketed_max_seqlen_with_marked_token_dims_compiles_once_per_bucket():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss, backend=counter, fullgraph=True)
    for lengths in ([5, 9, 3], [7, 2, 11, 6], [16, 2], [40, 3], [33, 17, 2]):
        batch = make_batch(lengths, heads_q=4, heads_kv=2, head_dim=16)
        for tensor in (batch.q, batch.k, batch.v, batch.cu_seqlens):
            torch._dynamo.mark_dynamic(tensor, 0)
        bound = codegen.bucket_max_seqlen(max(lengths))
        compiled(batch.q, batch.k, batch.v, batch.cu_seqlens, bound).backward()
    assert counter.frame_count == 2  # buckets 16 and 64


def test_bucket_max_seqlen():
    assert [codegen.bucket_max_seqlen(n) for n in (0, 1, 16, 17, 64, 65, 32768)] == [16, 16, 16, 32, 64, 128, 32768]
    with pytest.raises(ValueError, match="max_seqlen=-3"):
        codegen.bucket_max_seqlen(-3)


@pytest.mark.parametrize("backend_name", ["eager", "aot_eager", "inductor"])
def test_reference_op_under_torch_compile_backends(backend_name):
    torch._dynamo.reset()
    batch = make_batch([6, 1, 10], heads_q=2, heads_kv=1, head_dim=16)
    eager = make_batch([6, 1, 10], heads_q=2, heads_kv=1, head_dim=16)
    compiled = torch.compile(_loss, backend=backend_name, fullgraph=True)
    got = compiled(*batch.inputs())
    want = _loss(*eager.inputs())
    got.backward()
    want.backward()
    assert relative_error(got.detach(), want.detach()) < 1e-5
    for a, b in ((batch.q, eager.q), (batch.k, eager.k), (batch.v, eager.v)):
        assert relative_error(a.grad, b.grad) < 1e-5


def test_triton_backend_under_torch_compile():
    torch._dynamo.reset()
    batch = make_batch([6, 17], heads_q=2, heads_kv=2, head_dim=16)

    def loss(q, k, v, cu_seqlens, max_seqlen):
        return codegen.packed_attention(q, k, v, cu_seqlens, max_seqlen, kernel="triton").sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    compiled(*batch.inputs()).backward()
    reference = make_batch([6, 17], heads_q=2, heads_kv=2, head_dim=16)
    codegen.packed_attention(*reference.inputs(), kernel="reference").sum().backward()
    assert relative_error(batch.k.grad, reference.k.grad) < 1e-4


def test_auto_kernel_is_cpu_flash_on_cpu_and_triton_on_cuda():
    assert codegen.resolve_kernel("auto", torch.device("cpu")) == "cpu-flash"
    assert codegen.resolve_kernel("auto", torch.device("cuda", 0)) == "triton"
    assert codegen.resolve_kernel("auto", torch.device("meta")) == "reference"
    assert codegen.resolve_kernel("triton", torch.device("cpu")) == "triton"
    batch = make_batch([4, 3], heads_q=2, heads_kv=2, head_dim=8)  # head_dim 8: no Triton kernel, so auto chose cpu
    out = codegen.packed_attention(*batch.inputs())
    torch.testing.assert_close(out, codegen.packed_attention(*batch.inputs(), kernel="cpu-flash"))
    torch.testing.assert_close(out, codegen.packed_attention(*batch.inputs(), kernel="reference"))


def _bad(**changes):
    batch = make_batch([3, 5], heads_q=4, heads_kv=2, head_dim=16)
    args = dict(q=batch.q, k=batch.k, v=batch.v, cu_seqlens=batch.cu_seqlens, max_seqlen=5)
    args.update(changes)
    return args


T = 8
BAD_INPUTS = {
    "cu-dtype": (_bad(cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int64)), "cu_seqlens.dtype=torch.int64"),
    "cu-2d": (_bad(cu_seqlens=torch.tensor([[0, 3, 8]], dtype=torch.int32)), r"shape \(1, 3\)"),
    "cu-start": (_bad(cu_seqlens=torch.tensor([1, 3, 8], dtype=torch.int32)), r"cu_seqlens\[0\]=1"),
    "cu-decreasing": (_bad(cu_seqlens=torch.tensor([0, 6, 3, 8], dtype=torch.int32)),
                      r"cu_seqlens\[1\]=6 > cu_seqlens\[2\]=3"),
    "cu-end": (_bad(cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32)), r"cu_seqlens\[-1\]=7.*total_tokens=8"),
    "max-seqlen-low": (_bad(max_seqlen=4), "max_seqlen=4 is below the longest sequence in cu_seqlens \\(5\\)"),
    "max-seqlen-negative": (_bad(max_seqlen=-1), "max_seqlen=-1"),
    "heads": (_bad(k=torch.randn(T, 3, 16), v=torch.randn(T, 3, 16)), "heads_q=4 is not a multiple of heads_kv=3"),
    "head-dim": (_bad(q=torch.randn(T, 4, 24), k=torch.randn(T, 2, 24), v=torch.randn(T, 2, 24)), "head_dim=24"),
    "head-dim-mismatch": (_bad(k=torch.randn(T, 2, 32), v=torch.randn(T, 2, 32)), "head_dim=16 differs"),
    "qkv-dtype": (_bad(q=torch.randn(T, 4, 16, dtype=torch.float64)), "q.dtype=torch.float64"),
    "mixed-dtype": (_bad(k=torch.randn(T, 2, 16, dtype=torch.float16)), "dtypes differ"),
    "tokens": (_bad(k=torch.randn(T + 1, 2, 16), v=torch.randn(T + 1, 2, 16)), "q has 8 tokens but k and v have 9"),
    "kv-shapes": (_bad(v=torch.randn(T, 1, 16)), "k and v shapes differ"),
    "rank": (_bad(q=torch.randn(T, 64)), r"q must be \(total_tokens, heads, head_dim\)"),
}


@pytest.mark.parametrize(
    ("case", "kernel"),
    [(case, kernel) for case in sorted(BAD_INPUTS) for kernel in ("triton", "reference", "cpu-flash")
     if (case, kernel) not in {("head-dim", "reference"), ("head-dim", "cpu-flash")}],  # any head dim up to 256
)
def test_contract_violations_raise_value_error_naming_the_value(case, kernel, monkeypatch):
    args, message = BAD_INPUTS[case]
    launched = []
    from codegen import triton_launch

    monkeypatch.setattr(triton_launch, "_launch", lambda *a, **k: launched.append(a))
    with pytest.raises(ValueError, match=message):
        codegen.packed_attention(**args, kernel=kernel)
    assert not launched


def test_offsets_are_checked_at_run_time_under_torch_compile():
    torch._dynamo.reset()
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    batch = make_batch([3, 5], heads_q=2, heads_kv=2, head_dim=16)
    compiled(*batch.inputs())
    decreasing = torch.tensor([0, 6, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens\[1\]=6 > cu_seqlens\[2\]=3"):
        compiled(batch.q, batch.k, batch.v, decreasing, 6)


def test_the_op_itself_runs_only_resolved_kernels():
    batch = make_batch([3, 5], heads_q=2, heads_kv=2, head_dim=16)
    with pytest.raises(ValueError, match="kernel='auto'.*resolve 'auto' first"):
        codegen.packed_attention_op(*_op_args(batch, "auto"))


def test_unknown_kernel_and_reference_head_dim_limit():
    with pytest.raises(ValueError, match="kernel='cuda'"):
        codegen.packed_attention(**_bad(), kernel="cuda")
    too_wide = {name: torch.randn(T, heads, 300) for name, heads in (("q", 4), ("k", 2), ("v", 2))}
    with pytest.raises(ValueError, match="head_dim=300"):
        codegen.packed_attention(**_bad(**too_wide), kernel="reference")


def test_import_without_triton_and_reference_still_works():
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, codegen\n"
        "assert not codegen.triton_available()\n"
        "q = torch.randn(5, 2, 16); cu = torch.tensor([0, 2, 5], dtype=torch.int32)\n"
        "print(codegen.packed_attention(q, q, q, cu, 3).shape)\n"
        "try:\n"
        "    codegen.packed_attention(q, q, q, cu, 3, kernel='triton')\n"
        "except RuntimeError as error:\n"
        "    print('error:', error)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch.Size([5, 2, 16])" in result.stdout
    assert "needs the triton package" in result.stdout


def test_a_host_tensor_max_seqlen_sizes_the_triton_grid_without_recompiling(monkeypatch):
    """The runtime passes each micro-batch's longest span as a 0-d host tensor: the Triton grid covers just that
    many rows per span (not the bucket), the result is the same, and a compiled caller takes new values without
    compiling again."""
    from codegen import triton_launch

    grids = []
    launch = triton_launch._launch

    def recording(body, specs, grid_rows, grid_rest, *rest):
        grids.append((body, grid_rows({"BLOCK_M": 16, "BLOCK_N": 16})))
        return launch(body, specs, grid_rows, grid_rest, *rest)

    monkeypatch.setattr(triton_launch, "_launch", recording)
    batch = make_batch([5, 14, 13, 16], heads_q=2, heads_kv=1, head_dim=16)
    bound = codegen.packed_attention(*batch.inputs()[:4], 48, kernel="triton")
    assert [rows for _, rows in grids] == [3]  # the bound: cdiv(48, 16) blocks of rows per span
    grids.clear()
    tight = codegen.packed_attention(*batch.inputs()[:4], torch.tensor(16), kernel="triton")
    tight.sum().backward()
    assert torch.equal(bound, tight)
    assert [rows for _, rows in grids] == [1, 1, 1]  # forward, dq, dk/dv: cdiv(16, 16)
    with pytest.raises(ValueError, match="0-d integer tensor on the host"):
        codegen.packed_attention(*batch.inputs()[:4], torch.tensor([40]), kernel="triton")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q, k, v, cu, m: codegen.packed_attention(q, k, v, cu, m, kernel="reference"),
                             backend=counter, fullgraph=True)
    for longest in (16, 12, 33):
        compiled(*batch.inputs()[:4], torch.tensor(longest))
    assert counter.frame_count == 1
