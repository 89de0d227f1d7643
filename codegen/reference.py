"""Plain-torch packed attention: the oracle for the Triton kernels and the CPU path of the custom op.

Each sequence of the packed batch is attended separately (so cost is the sum of per-sequence costs and no
cross-sequence score is ever formed).  With ``offsets_k`` the queries and keys of a sequence are different
spans (a query chunk of a long sequence against the keys up to its end, as context parallelism runs it): causal
is then aligned at the bottom right, query row r of a chunk of Lq rows seeing key c of Lk iff c <= r + Lk - Lq.

Limited attention, as every kernel takes it: query row r of a segment stands at position ``i = r + Lk - Lq`` of its
sequence and key column c at position ``j = c`` (the key span starts at the sequence's start). A left ``window``
W (flash-attn's ``window_size=(W, 0)``; Hugging Face's ``sliding_window`` is W + 1) keeps keys with
``i - j <= W``; a ``chunk`` C (Llama 4's ``attention_chunk_size``) keeps keys with ``i // C == j // C``; both
on top of causal. Learned ``sinks`` (GPT-OSS): one logit per query head that joins every row's softmax
denominator and adds no value, so ``lse`` includes it and the output is scaled by ``1 - exp(sink - lse)``.
Arithmetic is fp32 whatever the input dtype.  The backward pass uses
the same recomputation as the kernels: probabilities are rebuilt from the saved log-sum-exp, so the forward
needs to keep only the output and one fp32 value per (head, token).
"""

from __future__ import annotations

import torch


def _expand_kv(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(len, heads_kv, d) -> (heads_q, len, d): each kv head serves ``group_size`` consecutive query heads."""
    return x.transpose(0, 1).repeat_interleave(group_size, dim=0).float()


def sequence_spans(offsets: list[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of every non-empty sequence of a packed batch, from its validated offsets."""
    return [(start, end) for start, end in zip(offsets[:-1], offsets[1:]) if end > start]


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Scores capped to ``softcap * tanh(scores / softcap)`` (unchanged when softcap is 0)."""
    return softcap * torch.tanh(scores / softcap) if softcap else scores


def causal_mask(length: int, device: torch.device, keys: int | None = None, *, window: int | None = None,
                chunk: int | None = None) -> torch.Tensor:
    """(len, keys) boolean, True where key j is visible to query row r: ``j <= i`` with ``i = r + keys - len``
    (keys defaults to len), and ``i - j <= window`` / ``i // chunk == j // chunk`` when given."""
    keys = length if keys is None else keys
    visible = torch.ones(length, keys, dtype=torch.bool, device=device).tril(keys - length)
    if window is None and chunk is None:
        return visible
    i = torch.arange(keys - length, keys, device=device)[:, None]  # (len, 1): each row's position
    j = torch.arange(keys, device=device)[None, :]  # (1, keys)
    if window is not None:
        visible &= i - j <= window
    if chunk is not None:
        visible &= torch.div(i, chunk, rounding_mode="floor") == torch.div(j, chunk, rounding_mode="floor")
    return visible


def limits_bite(queries: int, keys: int, window: int | None, chunk: int | None) -> bool:
    """Whether a window or chunk hides any key that causal attention shows in a segment of ``queries`` rows over
    ``keys`` keys (otherwise the segment is plain causal)."""
    return (window is not None and keys - 1 > window) or (chunk is not None and keys > chunk)


def check_limits(causal: bool, window: int | None, chunk: int | None) -> None:
    """A ValueError unless ``window`` (>= 0) and ``chunk`` (>= 1) are None or valid, and only on causal
    attention."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be None or an int >= 0 (keys i - window .. i are visible), got {window!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be None or an int >= 1, got {chunk!r}")
    if (window is not None or chunk is not None) and not causal:
        raise ValueError(f"window={window!r} and chunk={chunk!r} limit causal attention; got causal=False")


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks (heads_q,): ``-sum_t exp(sink_h - lse[h, t]) * delta[h, t]``, with ``lse`` (heads_q,
    tokens) including the sinks and ``delta = rowsum(dout * out)`` of the same shape."""
    return -(torch.exp(sinks.float()[:, None] - lse) * delta).sum(dim=1).to(sinks.dtype)


def segment_pairs(offsets: list[int], offsets_k: list[int] | None) -> list[tuple[int, int, int, int]]:
    """``(q_start, q_end, k_start, k_end)`` of every segment with queries; keys are the query span itself when
    ``offsets_k`` is None."""
    keys = offsets if offsets_k is None else offsets_k
    return [(qs, qe, ks, ke) for qs, qe, ks, ke in zip(offsets[:-1], offsets[1:], keys[:-1], keys[1:]) if qe > qs]


def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: list[int],
    *,
    causal: bool,
    softmax_scale: float,
    softcap: float = 0.0,
    offsets_k: list[int] | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed attention forward: returns ``out`` like q and ``lse`` (heads_q, total_tokens) in fp32. ``softcap``
    (when > 0) caps the scaled scores to ``softcap * tanh(s / softcap)``; ``offsets_k``: the keys' own spans;
    ``window``, ``chunk``, ``sinks``: limited attention and sink logits (module docstring)."""
    total_tokens, heads_q, _ = q.shape
    group_size = heads_q // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.zeros(heads_q, total_tokens, dtype=torch.float32, device=q.device)
    for start, end, k_start, k_end in segment_pairs(offsets, offsets_k):
        q_seq = q[start:end].transpose(0, 1).float()  # (heads_q, len, d)
        k_seq = _expand_kv(k[k_start:k_end], group_size)
        v_seq = _expand_kv(v[k_start:k_end], group_size)
        scores = _capped(torch.matmul(q_seq, k_seq.transpose(1, 2)) * softmax_scale, softcap)  # (heads_q, len, keys)
        if causal:
            scores = scores.masked_fill(~causal_mask(end - start, q.device, k_end - k_start, window=window,
                                                     chunk=chunk), float("-inf"))
        with_sink = scores if sinks is None else torch.cat(  # the sink: one more logit per row, no value
            [scores, sinks.float()[:, None, None].expand(-1, end - start, 1)], dim=-1)
        seq_lse = torch.logsumexp(with_sink, dim=-1)  # (heads_q, len)
        probs = torch.exp(scores - seq_lse.unsqueeze(-1))
        out[start:end] = torch.matmul(probs, v_seq).transpose(0, 1).to(q.dtype)
        lse[:, start:end] = seq_lse
    return out, lse


def reference_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    offsets: list[int],
    *,
    causal: bool,
    softmax_scale: float,
    softcap: float = 0.0,
    offsets_k: list[int] | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of packed attention for q, k, v and the sinks (None without sinks), recomputing probabilities
    from the saved ``lse``."""
    heads_q, heads_kv, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group_size = heads_q // heads_kv
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for start, end, k_start, k_end in segment_pairs(offsets, offsets_k):
        length, keys = end - start, k_end - k_start
        q_seq = q[start:end].transpose(0, 1).float()  # (heads_q, len, d)
        k_seq = _expand_kv(k[k_start:k_end], group_size)
        v_seq = _expand_kv(v[k_start:k_end], group_size)
        do_seq = grad_out[start:end].transpose(0, 1).float()
        o_seq = out[start:end].transpose(0, 1).float()
        scores = _capped(torch.matmul(q_seq, k_seq.transpose(1, 2)) * softmax_scale, softcap)
        probs = torch.exp(scores - lse[:, start:end].unsqueeze(-1))
        if causal:
            probs = probs.masked_fill(~causal_mask(length, q.device, keys, window=window, chunk=chunk), 0.0)
        delta = (do_seq * o_seq).sum(dim=-1, keepdim=True)  # (heads_q, len, 1) = rowsum(P * dP)
        grad_probs = torch.matmul(do_seq, v_seq.transpose(1, 2))
        grad_scores = probs * (grad_probs - delta)
        if softcap:  # through the cap: d(c tanh(x / c)) / dx = 1 - (capped / c)^2
            grad_scores = grad_scores * (1.0 - (scores / softcap) ** 2)
        grad_q_seq = torch.matmul(grad_scores, k_seq) * softmax_scale
        # Sum the group's query heads back onto their shared kv head: (heads_q, len, d) -> (heads_kv, len, d).
        grad_k_seq = (torch.matmul(grad_scores.transpose(1, 2), q_seq) * softmax_scale).view(
            heads_kv, group_size, keys, head_dim
        ).sum(dim=1)
        grad_v_seq = torch.matmul(probs.transpose(1, 2), do_seq).view(heads_kv, group_size, keys, head_dim).sum(1)
        grad_q[start:end] = grad_q_seq.transpose(0, 1).to(q.dtype)
        grad_k[k_start:k_end] = grad_k_seq.transpose(0, 1).to(k.dtype)
        grad_v[k_start:k_end] = grad_v_seq.transpose(0, 1).to(v.dtype)
    if sinks is None:
        return grad_q, grad_k, grad_v, None
    delta = (grad_out.float() * out.float()).sum(dim=-1).transpose(0, 1)  # (heads_q, tokens)
    return grad_q, grad_k, grad_v, sink_grad(sinks, lse, delta)


def extended_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with a score cap and learned sinks: scores ``s`` become
    ``softcap * tanh(s / softcap)`` before the mask (Gemma 2's eager attention), and ``sinks`` (one logit per
    query head, (heads,)) join each row's softmax denominator without a value (GPT-OSS). (B, H, T, D) like SDPA,
    plain torch. What the graph passes turn a capped or sink-augmented eager attention into; the packed rewrite
    replaces it by the packed op."""
    if dropout_p:
        raise ValueError(f"extended_attention takes no dropout, got dropout_p={dropout_p!r}")
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)
    scale = 1.0 / query.shape[-1] ** 0.5 if scale is None else scale
    scores = _capped(torch.matmul(query, key.transpose(-2, -1)).float() * scale, softcap)
    length = query.shape[-2]
    if is_causal:
        scores = scores.masked_fill(~causal_mask(length, query.device), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
    sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H, T, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(value.dtype), value)
