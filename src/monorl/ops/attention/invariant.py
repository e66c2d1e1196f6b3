"""Batch-invariant attention: causal varlen (trainer, prefill) and paged decode, as `torch.library` custom ops.

On CUDA both run `attention_triton`'s one kernel, so a token's output is the same in a packed forward and
in a decode step. The CPU path uses an exact max and pairwise-tree sums padded with zeros, which do not
change with the number of keys. Backward (`bi_varlen_attn_backward`) is flash attention's on CUDA, from the
forward's output and log-sum-exp, and ordinary math in a padded layout elsewhere: only forward values have to
match the generator. The default mode's flash path runs the varlen op too for attention sinks (GPT-OSS), which
torch's varlen_attn does not take.
"""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import custom_op, use_triton
from monorl.ops.attention.kernel import attention_triton, varlen_attention_triton
from monorl.ops.tree_sum import tree_sum
from monorl.speedups.private_apis import flash_attention_backward, flash_window


def _attn_cpu_rows(q: Tensor, k: Tensor, v: Tensor, valid: Tensor,
                   sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q [R, H, D], k/v [R, L, H, D] (each row's keys, GQA-expanded), valid [R, L] -> (out [R, H, D], log-sum-exp
    of the scaled scores [R, H] fp32) (fp32 math). sinks [H]: a logit per head in the denominator (GPT-OSS), added
    after the keys' fixed-order sum (so as invariant as it)."""
    D = q.shape[-1]
    qf, kf, vf = q.float(), k.float(), v.float()
    s = tree_sum(qf[:, None] * kf) * D ** -0.5  # [R, L, H]
    s = s.masked_fill(~valid[:, :, None], float("-inf"))
    m = s.max(1, keepdim=True).values
    if sinks is not None:
        m = torch.maximum(m, sinks.float()[None, None])
    p = torch.exp(s - m)  # masked keys: exactly 0
    l_ = tree_sum(p.transpose(1, 2))  # [R, H]
    if sinks is not None:
        l_ = l_ + torch.exp(sinks.float()[None] - m[:, 0])
    pv = torch.where(valid[:, :, None, None], p[..., None] * vf, 0.0)  # cache garbage never reaches the sum
    o = tree_sum(pv.permute(0, 2, 3, 1))  # [R, H, D]
    return (o / l_[..., None]).to(q.dtype), m[:, 0] + torch.log(l_)


def _expand_kv(x: Tensor, g: int) -> Tensor:
    return x if g == 1 else x.repeat_interleave(g, dim=-2)


def window_mask(L: int, window: int, device: torch.device | None = None) -> Tensor:
    """bool [L, L]: query i sees key j (causal; with a window, i - window < j)."""
    mask = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    return mask.triu(1 - window) if window else mask


@custom_op("monorl::bi_varlen_attn", mutates_args=())
def bi_varlen_attn(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, pad_index: Tensor,
                   valid: Tensor, window: int = 0, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Causal attention of packed sequences (sequence s: tokens cu_seqlens[s] .. cu_seqlens[s+1] - 1). Returns the
    output and each row's log-sum-exp of its scaled scores (fp32 [Hq, T], flash attention's layout), which backward
    takes instead of recomputing the forward. `pad_index` / `valid` (the `VarlenContext`'s padded layout) are for
    backward, which must not read lengths on the host (it runs inside trainer CUDA graphs); valid's width is the
    longest sequence. window: a query at position p sees keys p - window + 1 .. p (0: all up to p). sinks: see
    `_attn_cpu_rows` (lse then counts them)."""
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    if use_triton(q):
        return varlen_attention_triton(q, k, v, cu_seqlens, valid.shape[1], lse, window, sinks), lse
    g = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:], strict=True):  # one sequence at a time: each query row sees its keys
        L = b - a
        if L == 0:  # a static pack's zero-length entry
            continue
        kk, vv = _expand_kv(k[a:b], g), _expand_kv(v[a:b], g)
        valid = window_mask(L, window, q.device)  # (this path serves CUDA too where Triton is missing)
        rows = max(1, (1 << 22) // max(1, L * kk[0].numel()))
        for s in range(0, L, rows):
            e = min(L, s + rows)
            o, rows_lse = _attn_cpu_rows(q[a + s:a + e], kk[None].expand(e - s, *kk.shape),
                                         vv[None].expand(e - s, *vv.shape), valid[s:e], sinks)
            out[a + s:a + e], lse[:, a + s:a + e] = o, rows_lse.t()
    return out, lse


@bi_varlen_attn.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, pad_index: Tensor, valid: Tensor,
      window: int = 0, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@custom_op("monorl::bi_varlen_attn_backward", mutates_args=())
def bi_varlen_attn_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            cu_seqlens: Tensor, pad_index: Tensor, valid: Tensor,
                            window: int = 0, sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of causal varlen attention. Backward values need not be invariant (only forward log-probs must
    equal the generator's), so on CUDA in bf16/fp16 they are flash attention's, as in the default mode, from the
    forward's `out` and `lse`; elsewhere the textbook formulas. Device tensors only (no host sync), so it can be
    graph-captured. The fourth gradient is the sinks' ([Hq] fp32; zeros without sinks). With sinks, flash's
    gradients are still exact: it recomputes each probability as exp(score - lse) from an lse that counts the sink,
    and its delta (grad . out) is the full softmax's, the sink's value being 0; the sinks' own is `sink_grad`."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        dq, dk, dv = backward_flash(grad, q, k, v, out, lse, cu_seqlens, valid.shape[1], window)
        ds = q.new_zeros(q.shape[1], dtype=torch.float32) if sinks is None else sink_grad(grad, out, lse, sinks)
        return dq, dk, dv, ds
    return backward_padded(grad, q, k, v, pad_index, valid, window, sinks)


def backward_flash(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
                   max_seqlen: int, window: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Flash attention's varlen gradients (the default mode's kernel) from the forward's output and log-sum-exp
    [Hq, T]: no forward recomputed for the softmax statistics, and no GQA-expanded keys and values (flash sums a
    group's key/value gradients itself). On a Qwen3-0.6B pack the padded textbook backward took 46% of an invariant
    trainer step (H200). The ATen op directly: this runs below autograd (inside a custom op)."""
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: no RNG state to replay
    dq, dk, dv = flash_attention_backward(grad, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen,
                                                          max_seqlen, 0.0, True, rng, q.new_empty(0),
                                                          **flash_window(window))
    return dq, dk, dv


def sink_grad(grad: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d sinks [Hq] fp32 from the forward's output [T, Hq, D] and log-sum-exp [Hq, T] (which counts the sinks): row
    t's sink probability is exp(sink - lse_t), its gradient -p_sink * (grad_t . out_t), summed over the rows (the
    formula of `backward_padded`, without recomputing the softmax). The sinks as the forward took them (in out's
    dtype, `kernel._sink_args`)."""
    delta = (grad.float() * out.float()).sum(-1)  # [T, Hq]
    return -(torch.exp(sinks.to(out.dtype).float()[:, None] - lse) * delta.t()).sum(1)


def backward_padded(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, pad_index: Tensor, valid: Tensor, window: int = 0,
                    sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The textbook formulas in the padded [B, H, L, L] layout, fp32 (CPU, and fp32 inputs); with sinks, their
    softmax column too (d sink = -sum over rows of p_sink * (grad . out))."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    B, L = valid.shape

    def padded(x: Tensor) -> Tensor:  # [T, H, D] -> [B, H, L, D] fp32, zero rows as padding
        x = torch.cat([x.float(), x.new_zeros(1, *x.shape[1:], dtype=torch.float32)])
        return x[pad_index].transpose(1, 2)

    qp, gp = padded(q), padded(grad)
    kp, vp = padded(_expand_kv(k, g)), padded(_expand_kv(v, g))
    scale = D ** -0.5
    # key 0 stays visible to every row, so a zero-length entry (static packs pad with them) softmaxes to
    # finite values instead of NaN; its rows are dropped below
    first = torch.arange(L, device=q.device) == 0
    keys = valid | first
    mask = window_mask(L, window, q.device)[None, None] & keys[:, None, None, :]
    if window:  # a padding row may have no key in its window: it sees key 0 (its gradient is dropped)
        mask = mask | (~valid[:, None, :, None] & first)
    scores = (qp @ kp.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(B, Hq, L, 1)
        p = torch.softmax(torch.cat([scores, sink], -1), dim=-1)
        p, p_sink = p[..., :-1], p[..., -1]
    else:
        p = torch.softmax(scores, dim=-1)
    o = p @ vp
    dv = p.transpose(-1, -2) @ gp
    delta = (gp * o).sum(-1, keepdim=True)  # padding rows: zero grad, so nothing
    ds = p * (gp @ vp.transpose(-1, -2) - delta)
    dsinks = (-(p_sink * delta[..., 0]).sum((0, 2)) if sinks is not None
              else q.new_zeros(Hq, dtype=torch.float32))
    dq = ds @ kp * scale
    dk = ds.transpose(-1, -2) @ qp * scale

    def unpadded(x: Tensor, heads: int) -> Tensor:  # [B, Hq, L, D] -> [T, heads, D], summing GQA groups
        x = x.view(B, heads, Hq // heads, L, D).sum(2).transpose(1, 2)  # [B, L, heads, D]
        # scatter by pad_index rather than boolean-mask indexing (data-dependent size: a host sync);
        # padding slots all point at the extra row T, which is dropped
        out = x.new_zeros(T + 1, heads, D)
        out[pad_index.reshape(-1)] = x.reshape(B * L, heads, D)
        return out[:T]

    return (unpadded(dq, Hq).to(q.dtype), unpadded(dk, Hkv).to(k.dtype), unpadded(dv, Hkv).to(v.dtype),
            dsinks)


@bi_varlen_attn_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor, pad_index: Tensor,
      valid: Tensor, window: int = 0, sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(q.shape[1], dtype=torch.float32))


def _attn_setup(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, pad_index, valid, *rest = inputs
    ctx.window = rest[0] if rest else 0
    sinks = rest[1] if len(rest) > 1 else None
    ctx.has_sinks = sinks is not None
    ctx.save_for_backward(q, k, v, *output, cu_seqlens, pad_index, valid, *([sinks] if ctx.has_sinks else []))


def _attn_backward(ctx, grad: Tensor, grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
    # grad_lse: nothing differentiates the log-sum-exp (it is backward's input, not a model output)
    q, k, v, out, lse, cu_seqlens, pad_index, valid, *sinks = ctx.saved_tensors
    sink = sinks[0] if ctx.has_sinks else None
    dq, dk, dv, ds = bi_varlen_attn_backward(grad.contiguous(), q, k, v, out, lse, cu_seqlens, pad_index, valid,
                                             ctx.window, sink)
    return dq, dk, dv, None, None, None, None, None if sink is None else ds.to(sink.dtype)


bi_varlen_attn.register_autograd(_attn_backward, setup_context=_attn_setup)


@custom_op("monorl::bi_paged_decode", mutates_args=())
def bi_paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                    window: int = 0, sinks: Tensor | None = None) -> Tensor:
    """q [B, Hq, D] attends the first seq_lens[b] keys of its block table (caches [N, bs, Hkv, D]); with a window,
    only the last `window` of them; sinks: see `_attn_cpu_rows`."""
    if use_triton(q):
        return attention_triton(q, k_cache, v_cache, seq_lens.to(torch.int32), block_tables, window=window,
                                sinks=sinks)
    B, W = block_tables.shape
    bs, Hkv, D = k_cache.shape[1:]
    g = q.shape[1] // Hkv
    idx = block_tables.long()
    k = _expand_kv(k_cache[idx].view(B, W * bs, Hkv, D), g)
    v = _expand_kv(v_cache[idx].view(B, W * bs, Hkv, D), g)
    key = torch.arange(W * bs, device=q.device)[None, :]
    valid = (key < seq_lens[:, None]) & (key >= seq_lens[:, None] - window if window else True)
    return _attn_cpu_rows(q, k.to(q.dtype), v.to(q.dtype), valid, sinks)[0]


@bi_paged_decode.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, window: int = 0,
      sinks: Tensor | None = None) -> Tensor:
    return torch.empty_like(q)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, pad_index: Tensor, valid: Tensor,
                     window: int = 0, sinks: Tensor | None = None) -> Tensor:
    return bi_varlen_attn(q, k, v, cu_seqlens, pad_index, valid, window, sinks)[0]


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                 window: int = 0, sinks: Tensor | None = None) -> Tensor:
    return bi_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, window, sinks)
