"""Triton kernel bodies for packed (varlen) attention: forward, dq backward and dk/dv backward.

The bodies are plain Python functions, not yet jitted: ``codegen.triton_launch`` turns them into kernels per
``KernelSpec`` (its fields arrive as ``tl.constexpr`` arguments) and per interpreter mode, so that
``TRITON_INTERPRET`` is read when a kernel is first generated, not when this module is imported.

Layout: q, out, dout, dq are (total_tokens, heads_q, head_dim); k, v, dk, dv are (total_tokens, heads_kv,
head_dim); lse and delta are (heads_q, total_tokens) fp32; ``cu_seqlens`` is int32 (num_seqs + 1) over the
queries and ``cu_seqlens_k`` the same over the keys (the same tensor for self-attention; a different one when a
query chunk of a long sequence attends the keys up to its end: causal is then aligned at the bottom right, row r
of Lq rows seeing key c of Lk iff c <= r + Lk - Lq). A program handles one block of rows of one sequence and one
head; rows past the sequence's end are masked, programs whose block starts past the end return at once.
Probabilities are computed base 2: ``p = exp2(s * scale * log2(e) - lse *
log2(e))``. ``SOFTCAP`` caps the scaled scores to ``softcap * tanh(s / softcap)`` (Gemma 2's attention); the
backward multiplies each score gradient by the cap's derivative. ``WINDOW`` / ``CHUNK`` limit causal attention
(row r at position i = r + shift of its sequence sees key c only if i - c <= window, and only if i // chunk ==
c // chunk): the loops visit only the key blocks (forward, dq) or query blocks (dk/dv) that can hold a visible
pair, so the work falls with the window. ``SINKS``: one logit per query head (fp32) that starts every row's
running maximum and sum (base 2: m = sink * log2(e), l = 1), so ``lse`` includes it; the backward kernels need
nothing more (they rebuild probabilities from that lse). ``seqlen_bucket`` (max_seqlen rounded up to a
power of two) is unused by the bodies: it is the autotune key on a GPU. ``UPCAST`` casts loaded q, k, v, dout to
fp32: the interpreter's ``tl.dot`` multiplies the raw bits of bf16 operands, so bf16 specs set it under
``TRITON_INTERPRET=1``. Padding rows use a large finite negative score instead of -inf so that no NaN is formed.
Every (tokens, head_dim) tile is read by ``load_tile``, a helper ``codegen.triton_launch`` jits beside the kernel
(``HELPERS``).
"""


import triton.language as tl

LOG2_E = tl.constexpr(1.4426950408889634)
NEG_LARGE = tl.constexpr(-1.0e30)

# Row reductions go through ``tl.reduce`` with Triton's own combine functions instead of ``tl.max`` / ``tl.sum``
# (and tiles start from ``tl.full`` instead of ``tl.zeros``): those helpers are @jit wrappers frozen into compiled
# or interpreted mode when triton is first imported, so they fail under TRITON_INTERPRET=1 if anything imported
# triton before the variable was set.  ``tl.reduce`` with these combine functions is what ``tl.max`` / ``tl.sum``
# compile to, and the interpreter recognises them and reduces in numpy.
MAX_COMBINE = tl.standard._elementwise_max
SUM_COMBINE = tl.standard._sum_combine

HELPERS = ("load_tile", "soft_cap", "visible_pairs", "key_range", "query_range")
"""Bodies the kernels call; jitted with them, in the same mode."""


def load_tile(ptr, tokens, stride_t, head, stride_h, dims, ok, UPCAST: tl.constexpr):
    """The (tokens, head_dim) tile of one head, rows where ``ok`` is false read as 0 (fp32 when UPCAST)."""
    tile = tl.load(ptr + tokens[:, None] * stride_t + head * stride_h + dims[None, :], mask=ok[:, None], other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


def soft_cap(raw, cap):
    """``cap * tanh(raw / cap)``, through exp (finite for any raw: exp overflowing to inf gives cap)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * raw / cap) + 1.0))


def visible_pairs(rows, cols, shift, window, chunk, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                  CHUNK: tl.constexpr):
    """(rows, cols) True where key ``cols`` is visible to query ``rows`` under the causal, window and chunk
    limits (row r stands at position r + shift of its sequence, key c at c)."""
    position = rows[:, None] + shift
    visible = (cols[None, :] >= 0) & (position >= 0)
    if CAUSAL:
        visible = visible & (cols[None, :] <= position)
    if WINDOW:
        visible = visible & (position - cols[None, :] <= window)
    if CHUNK:
        visible = visible & ((position // chunk) == (cols[None, :] // chunk))
    return visible


def key_range(first_row, last_row, keys, shift, window, chunk, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
              CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of the key columns that rows ``first_row .. last_row`` can see; lo a multiple of BLOCK_N."""
    lo = first_row * 0
    hi = keys + first_row * 0
    if CAUSAL:  # blocks of keys wholly after the last row are never visible
        hi = tl.minimum(hi, last_row + 1 + shift)
    if WINDOW:  # nor blocks wholly before the first row's window
        lo = tl.maximum(lo, first_row + shift - window)
    if CHUNK:  # nor blocks outside the chunks the rows stand in
        lo = tl.maximum(lo, ((first_row + shift) // chunk) * chunk)
        hi = tl.minimum(hi, ((last_row + shift) // chunk + 1) * chunk)
    return (lo // BLOCK_N) * BLOCK_N, hi


def query_range(first_col, last_col, length, shift, window, chunk, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                CHUNK: tl.constexpr, BLOCK_M: tl.constexpr):
    """[lo, hi) of the query rows that can see keys ``first_col .. last_col``; lo a multiple of BLOCK_M."""
    lo = first_col * 0
    hi = length + first_col * 0
    if CAUSAL:  # rows before the first key's diagonal see none of the block
        lo = tl.maximum(lo, first_col - shift)
    if WINDOW:  # rows past the last key's window see none of it
        hi = tl.minimum(hi, last_col + window + 1 - shift)
    if CHUNK:
        lo = tl.maximum(lo, (first_col // chunk) * chunk - shift)
        hi = tl.minimum(hi, (last_col // chunk + 1) * chunk - shift)
    return (lo // BLOCK_M) * BLOCK_M, hi


def packed_attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_seqlens_ptr, cu_seqlens_k_ptr, sinks_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    scale, softcap, window, chunk, seqlen_bucket,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr, SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    block_m, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq)
    length = tl.load(cu_seqlens_ptr + seq + 1) - start
    start = start.to(tl.int64)  # token offsets times strides can pass 2**31 in large packed batches
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    keys = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    k_start = k_start.to(tl.int64)
    shift = keys - length  # 0 for self-attention: the causal diagonal's offset
    if block_m * BLOCK_M < length:
        head_kv = head // GROUP
        rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        row_ok = rows < length
        q = load_tile(q_ptr, start + rows, stride_qt, head, stride_qh, dims, row_ok, UPCAST)
        m_i = tl.full([BLOCK_M], NEG_LARGE, dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        if SINKS:  # the sink is one more logit in every row's denominator, with no value
            m_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32) + tl.load(sinks_ptr + head) * LOG2_E
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
        lo, hi = key_range(block_m * BLOCK_M, (block_m + 1) * BLOCK_M - 1, keys, shift, window, chunk, CAUSAL,
                           WINDOW, CHUNK, BLOCK_N)
        for col_start in range(lo, hi, BLOCK_N):
            cols = col_start + tl.arange(0, BLOCK_N)
            col_ok = cols < keys
            k = load_tile(k_ptr, k_start + cols, stride_kt, head_kv, stride_kh, dims, col_ok, UPCAST)
            v = load_tile(v_ptr, k_start + cols, stride_vt, head_kv, stride_vh, dims, col_ok, UPCAST)
            visible = col_ok[None, :] & visible_pairs(rows, cols, shift, window, chunk, CAUSAL, WINDOW, CHUNK)
            raw = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            if SOFTCAP:
                raw = soft_cap(raw, softcap)
            s = tl.where(visible, raw * LOG2_E, NEG_LARGE)
            m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX_COMBINE))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + (start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptr + head * stride_lh + start + rows, (m_i + tl.log2(l_i)) / LOG2_E, mask=row_ok)


def packed_attention_backward_dq_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, cu_seqlens_ptr, cu_seqlens_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dout_t, stride_dout_h,
    stride_dqt, stride_dqh, stride_lh,
    scale, softcap, window, chunk, seqlen_bucket,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    block_m, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq)
    length = tl.load(cu_seqlens_ptr + seq + 1) - start
    start = start.to(tl.int64)  # token offsets times strides can pass 2**31 in large packed batches
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    keys = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    k_start = k_start.to(tl.int64)
    shift = keys - length  # 0 for self-attention: the causal diagonal's offset
    if block_m * BLOCK_M < length:
        head_kv = head // GROUP
        rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        row_ok = rows < length
        q = load_tile(q_ptr, start + rows, stride_qt, head, stride_qh, dims, row_ok, UPCAST)
        do = load_tile(dout_ptr, start + rows, stride_dout_t, head, stride_dout_h, dims, row_ok, UPCAST)
        lse2 = tl.load(lse_ptr + head * stride_lh + start + rows, mask=row_ok, other=0.0) * LOG2_E
        delta = tl.load(delta_ptr + head * stride_lh + start + rows, mask=row_ok, other=0.0)
        dq = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
        lo, hi = key_range(block_m * BLOCK_M, (block_m + 1) * BLOCK_M - 1, keys, shift, window, chunk, CAUSAL,
                           WINDOW, CHUNK, BLOCK_N)
        for col_start in range(lo, hi, BLOCK_N):
            cols = col_start + tl.arange(0, BLOCK_N)
            col_ok = cols < keys
            k = load_tile(k_ptr, k_start + cols, stride_kt, head_kv, stride_kh, dims, col_ok, UPCAST)
            v = load_tile(v_ptr, k_start + cols, stride_vt, head_kv, stride_vh, dims, col_ok, UPCAST)
            visible = col_ok[None, :] & row_ok[:, None] & visible_pairs(rows, cols, shift, window, chunk, CAUSAL,
                                                                        WINDOW, CHUNK)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            if SOFTCAP:
                s = soft_cap(s, softcap)
            p = tl.where(visible, tl.exp2(s * LOG2_E - lse2[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:  # through the cap: d(c tanh(x / c)) / dx = 1 - (capped / c)^2
                ds = ds * (1.0 - (s / softcap) * (s / softcap))
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
        dq = dq * scale
        tl.store(dq_ptr + (start + rows)[:, None] * stride_dqt + head * stride_dqh + dims[None, :],
                 dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def packed_attention_backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_seqlens_ptr, cu_seqlens_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dout_t, stride_dout_h,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    scale, softcap, window, chunk, seqlen_bucket,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program owns a block of key rows of one kv head and loops over the GROUP query heads sharing it,
    so dk and dv are written once, without atomics."""
    block_n, seq, head_kv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq)
    length = tl.load(cu_seqlens_ptr + seq + 1) - start
    start = start.to(tl.int64)  # token offsets times strides can pass 2**31 in large packed batches
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    keys = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    k_start = k_start.to(tl.int64)
    shift = keys - length  # 0 for self-attention: the causal diagonal's offset
    if block_n * BLOCK_N < keys:
        cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM)
        col_ok = cols < keys
        k = load_tile(k_ptr, k_start + cols, stride_kt, head_kv, stride_kh, dims, col_ok, UPCAST)
        v = load_tile(v_ptr, k_start + cols, stride_vt, head_kv, stride_vh, dims, col_ok, UPCAST)
        dk = tl.full([BLOCK_N, HEAD_DIM], 0.0, dtype=tl.float32)
        dv = tl.full([BLOCK_N, HEAD_DIM], 0.0, dtype=tl.float32)
        # Only the query blocks that can see this key block: from the one holding its first key's diagonal (causal)
        # to the one holding its last key's window end (a window), within its chunks.
        first_row, row_stop = query_range(block_n * BLOCK_N, (block_n + 1) * BLOCK_N - 1, length, shift, window,
                                          chunk, CAUSAL, WINDOW, CHUNK, BLOCK_M)
        for member in range(GROUP):
            head = head_kv * GROUP + member
            for row_start in range(first_row, row_stop, BLOCK_M):
                rows = row_start + tl.arange(0, BLOCK_M)
                row_ok = rows < length
                q = load_tile(q_ptr, start + rows, stride_qt, head, stride_qh, dims, row_ok, UPCAST)
                do = load_tile(dout_ptr, start + rows, stride_dout_t, head, stride_dout_h, dims, row_ok, UPCAST)
                lse2 = tl.load(lse_ptr + head * stride_lh + start + rows, mask=row_ok, other=0.0) * LOG2_E
                delta = tl.load(delta_ptr + head * stride_lh + start + rows, mask=row_ok, other=0.0)
                visible = col_ok[:, None] & row_ok[None, :] & tl.trans(  # transposed: (keys, queries)
                    visible_pairs(rows, cols, shift, window, chunk, CAUSAL, WINDOW, CHUNK))
                s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale
                if SOFTCAP:
                    s_t = soft_cap(s_t, softcap)
                p_t = tl.where(visible, tl.exp2(s_t * LOG2_E - lse2[None, :]), 0.0)
                dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
                dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
                ds_t = p_t * (dp_t - delta[None, :])
                if SOFTCAP:
                    ds_t = ds_t * (1.0 - (s_t / softcap) * (s_t / softcap))
                dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
        dk = dk * scale
        tl.store(dk_ptr + (k_start + cols)[:, None] * stride_dkt + head_kv * stride_dkh + dims[None, :],
                 dk.to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
        tl.store(dv_ptr + (k_start + cols)[:, None] * stride_dvt + head_kv * stride_dvh + dims[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])
