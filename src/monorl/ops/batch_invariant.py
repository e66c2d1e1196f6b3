"""Batch-invariant mode: kernels whose result for one row depends neither on the other rows of the
batch nor on the layout (decode step vs full-sequence forward), so the generator's log-probs equal the
trainer's recomputed ones bit for bit.

Why the defaults are not invariant: cuBLAS / MKL pick GEMM tilings and split-K by M, CUDA reductions
split a row across more threads when there are few rows, and flash attention's key-block order differs
between a prefill and a decode step. Each op here fixes its reduction order up front:

- `linear` (x [.., K] @ w[N, K]^T): CUDA: a Triton GEMM whose tiles and K loop depend only on the
  weight's shape (N, K), never on M. CPU: fp32 products summed by a fixed pairwise tree over K.
- `rms_norm`, `token_logprobs` (log-softmax over the vocab at the chosen token): one program per row.
- attention: one kernel for varlen-causal (trainer, prefill) and paged decode. Every query walks its
  keys in blocks of `ATTN_BLOCK_N` from position 0 with the same online-softmax update, so a token's
  output is the same function of its q and its keys in both layouts. The CPU path uses an exact
  max and pairwise-tree sums padded with zeros, which do not change with the number of keys.

The ops are `torch.library` custom ops (opaque to torch.compile). Backward uses ordinary (non-invariant)
math: only forward values have to match the generator.

The mode is one process-wide switch (`set_batch_invariant`), read by the model's Linear / RMSNorm /
logits / log-prob code and by the attention contexts; it also carries the compute dtype (the
generator's), so the trainer's forward sees exactly the generator's bf16 weights and activations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # triton only exists on the GPU machines
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU CI
    HAS_TRITON = False

ATTN_BLOCK_N = 64  # keys per block in the invariant attention (both layouts)
_ENABLED = False
_DTYPE: torch.dtype | None = None


def is_enabled() -> bool:
    return _ENABLED


def compute_dtype() -> torch.dtype | None:
    """The activation dtype of the mode (the generator's), or None: keep the embedding's dtype."""
    return _DTYPE


def set_batch_invariant(enabled: bool, dtype: torch.dtype | None = None) -> None:
    """Turn the mode on/off for the process. On: TF32 and reduced-precision reductions off, since they
    would let cuBLAS / cuDNN (still used by backward and by anything outside these ops) round differently."""
    global _ENABLED, _DTYPE
    _ENABLED, _DTYPE = bool(enabled), dtype if enabled else None
    if enabled:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True, dtype: torch.dtype | None = None) -> Iterator[None]:
    prev = (_ENABLED, _DTYPE)
    set_batch_invariant(enabled, dtype)
    try:
        yield
    finally:
        set_batch_invariant(*prev)


def _use_triton(t: Tensor) -> bool:
    return HAS_TRITON and t.is_cuda


# ---- CPU building block -------------------------------------------------------------------------------
def _tree_sum(x: Tensor) -> Tensor:
    """Sum over the last dim by adjacent pairs, zero-padded to a power of two. Only elementwise adds, so
    a row's result does not depend on the other rows; and trailing zeros (masked keys, padding) do not
    change it: a subtree over real values is the same for any padded length, and adding +0 is exact."""
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = F.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


# ---- matmul -------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit(do_not_specialize=["M"])  # M must not change the compiled kernel (Triton specialises 1, %16)
    def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # one fixed K order: no split-K
            kk = k0 + offs_k
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :],
                        mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + offs_n[:, None] * stride_bn + kk[None, :],
                        mask=(offs_n[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


MM_TILES = "auto"  # "auto" | "large" (128x128 tiles everywhere; benchmarks/bench_batch_invariant.py --mm-tiles)


def _mm_config(N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): a function of the weight's shape only."""
    if MM_TILES == "large":
        return 128, 128, 64, 8, 3
    if N <= 4096:  # narrow outputs: smaller N tiles, so a decode step still spreads over the SMs
        return 64, 64, 64, 4, 4
    return 64, 128, 64, 4, 4


def _mm_triton(x: Tensor, w: Tensor) -> Tensor:
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bm, bn, bk, nw, ns = _mm_config(N, K)
    _mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
    return out


def _mm_cpu(x: Tensor, w: Tensor) -> Tensor:
    M, K = x.shape
    N = w.shape[0]
    xf, wf = x.float(), w.float()
    rows = max(1, (1 << 22) // max(1, N * K))  # bound the [rows, N, K] product buffer (~16 MB)
    outs = [_tree_sum(xf[s:s + rows, None, :] * wf[None]) for s in range(0, M, rows)]
    return (torch.cat(outs) if outs else xf.new_zeros(0, N)).to(x.dtype)


@torch.library.custom_op("monorl::bi_mm", mutates_args=())
def bi_mm(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype; row i depends only on x[i] and w."""
    x, w = x.contiguous(), w.contiguous()
    return _mm_triton(x, w) if _use_triton(x) else _mm_cpu(x, w)


@bi_mm.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def _mm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _mm_backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
    x, w = ctx.saved_tensors
    return grad @ w, grad.t() @ x


bi_mm.register_autograd(_mm_backward, setup_context=_mm_setup)


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear(x, weight) without bias, batch-invariant. The weight is cast to x's dtype (outside the op,
    so the trainer's fp32 master gets the gradient) -- exactly the generator's bf16 copy."""
    shape = x.shape
    out = bi_mm(x.reshape(-1, shape[-1]), weight.to(x.dtype))
    return out.view(*shape[:-1], weight.shape[0])


# ---- RMSNorm ------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _rms_kernel(x_ptr, w_ptr, o_ptr, D, eps, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = (x * r).to(o_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.store(o_ptr + row * D + offs, (w.to(tl.float32) * y.to(tl.float32)).to(o_ptr.dtype.element_ty),
                 mask=mask)


def _rms_reference(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@torch.library.custom_op("monorl::bi_rms_norm", mutates_args=())
def bi_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim (normalise in fp32, scale in x's dtype), one fixed order per row."""
    x = x.contiguous()
    D = x.shape[-1]
    if _use_triton(x):
        out = torch.empty_like(x)
        rows = x.numel() // D
        if rows:
            _rms_kernel[(rows,)](x, w.contiguous(), out, D, eps, BLOCK_D=triton.next_power_of_2(D), num_warps=4)
        return out
    xf = x.float()
    r = torch.rsqrt(_tree_sum(xf * xf)[..., None] / D + eps)
    return w * (xf * r).to(x.dtype)


@bi_rms_norm.register_fake
def _(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


def _rms_setup(ctx, inputs, output) -> None:
    x, w, eps = inputs
    ctx.save_for_backward(x, w)
    ctx.eps = eps


def _rms_backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    x, w = ctx.saved_tensors
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
    y = xf * r
    gy = grad.float() * w.float()
    gx = r * (gy - y * (gy * y).mean(-1, keepdim=True))
    gw = (grad.float() * y.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
    return gx.to(x.dtype), gw.to(w.dtype), None


bi_rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return bi_rms_norm(x, weight.to(x.dtype), eps)


# ---- log-softmax at the chosen token -------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _logprob_kernel(x_ptr, t_ptr, o_ptr, V, stride_x, temperature, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        offs = tl.arange(0, BLOCK_V)
        m_vec = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
        for s in range(0, V, BLOCK_V):
            z = tl.load(base + s + offs, mask=s + offs < V, other=float("-inf")).to(tl.float32) / temperature
            m_vec = tl.maximum(m_vec, z)
        m = tl.max(m_vec, axis=0)
        s_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
        for s in range(0, V, BLOCK_V):  # vocab blocks in order, one lane per offset: a fixed sum order
            z = tl.load(base + s + offs, mask=s + offs < V, other=float("-inf")).to(tl.float32) / temperature
            s_vec += tl.exp(z - m)
        tok = tl.load(t_ptr + row)
        zt = tl.load(base + tok).to(tl.float32) / temperature
        tl.store(o_ptr + row, zt - m - tl.log(tl.sum(s_vec, axis=0)))


@torch.library.custom_op("monorl::bi_token_logprobs", mutates_args=())
def bi_token_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature)[row, tokens[row]] in fp32 -> [N]."""
    N, V = logits.shape
    if _use_triton(logits):
        logits, tokens = logits.contiguous(), tokens.contiguous().long()
        out = torch.empty(N, dtype=torch.float32, device=logits.device)
        if N:
            _logprob_kernel[(N,)](logits, tokens, out, V, logits.stride(0), float(temperature), BLOCK_V=2048,
                                  num_warps=8)
        return out
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    m = z.max(-1, keepdim=True).values  # max is exact in any order
    lse = torch.log(_tree_sum(torch.exp(z - m)))
    return z.gather(-1, tokens[:, None].long())[:, 0] - m[:, 0] - lse


@bi_token_logprobs.register_fake
def _(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def _lp_setup(ctx, inputs, output) -> None:
    logits, tokens, temperature = inputs
    ctx.save_for_backward(logits, tokens)
    ctx.temperature = temperature


def _lp_backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
    logits, tokens = ctx.saved_tensors
    T = ctx.temperature
    p = torch.softmax(logits.float() / T, dim=-1)
    onehot = F.one_hot(tokens.long(), logits.shape[-1]).to(p.dtype)
    return (grad[:, None] * (onehot - p) / T).to(logits.dtype), None, None


bi_token_logprobs.register_autograd(_lp_backward, setup_context=_lp_setup)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    return bi_token_logprobs(logits, tokens, float(temperature))


# ---- attention: one kernel for varlen-causal and paged decode ----------------------------------------
if HAS_TRITON:

    @triton.jit
    def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, kbase_ptr, lens_ptr, bt_ptr,
                     stride_qt, stride_qh, stride_kblk, stride_ktok, stride_kh, stride_btb,
                     stride_ot, stride_oh, scale,
                     PAGED: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                     BS: tl.constexpr, BLOCK_N: tl.constexpr):
        # One program per (query token, kv head); the G query heads of that kv head are the rows. Only the
        # key addressing differs between layouts (PAGED): the arithmetic below is one code path.
        r = tl.program_id(0)
        hk = tl.program_id(1)
        seqlen = tl.load(lens_ptr + r)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        gmask = offs_g < G
        q = tl.load(q_ptr + r * stride_qt + (hk * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, D], dtype=tl.float32)
        if not PAGED:
            kbase = tl.load(kbase_ptr + r).to(tl.int64)
        for start in range(0, seqlen, BLOCK_N):
            tok = start + offs_n
            nmask = tok < seqlen
            if PAGED:
                blk = tl.load(bt_ptr + r * stride_btb + tok // BS, mask=nmask, other=0)
                off = blk.to(tl.int64) * stride_kblk + (tok % BS) * stride_ktok + hk * stride_kh
            else:
                off = (kbase + tok) * stride_ktok + hk * stride_kh
            k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + r * stride_ot + (hk * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=gmask[:, None])


def attention_triton(q: Tensor, k: Tensor, v: Tensor, kbase: Tensor | None, lens: Tensor,
                 block_tables: Tensor | None) -> Tensor:
    """q [R, Hq, D]. Varlen: k/v [T, Hkv, D], row r attends keys kbase[r] .. kbase[r]+lens[r]-1.
    Paged: k/v caches [N, BS, Hkv, D], row r attends its table's first lens[r] keys."""
    R, Hq, D = q.shape
    Hkv = k.shape[-2]
    G = Hq // Hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    if R == 0:
        return out
    paged = block_tables is not None
    if paged:
        bs, s_blk, s_tok, s_h, s_bt = k.shape[1], k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0)
        kbase = lens  # unused
    else:
        k, v = k.contiguous(), v.contiguous()
        bs, s_blk, s_tok, s_h, s_bt = 1, 0, k.stride(0), k.stride(1), 0
        block_tables = lens  # unused
    _attn_kernel[(R, Hkv)](
        q, k, v, out, kbase, lens, block_tables,
        q.stride(0), q.stride(1), s_blk, s_tok, s_h, s_bt, out.stride(0), out.stride(1), D ** -0.5,
        PAGED=paged, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=bs, BLOCK_N=ATTN_BLOCK_N, num_warps=4)
    return out


def _attn_cpu_rows(q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> Tensor:
    """q [R, H, D], k/v [R, L, H, D] (each row's keys, GQA-expanded), valid [R, L] -> [R, H, D] (fp32 math)."""
    D = q.shape[-1]
    qf, kf, vf = q.float(), k.float(), v.float()
    s = _tree_sum(qf[:, None] * kf) * D ** -0.5  # [R, L, H]
    s = s.masked_fill(~valid[:, :, None], float("-inf"))
    m = s.max(1, keepdim=True).values
    p = torch.exp(s - m)  # masked keys: exactly 0
    l_ = _tree_sum(p.transpose(1, 2))  # [R, H]
    pv = torch.where(valid[:, :, None, None], p[..., None] * vf, 0.0)  # cache garbage never reaches the sum
    o = _tree_sum(pv.permute(0, 2, 3, 1))  # [R, H, D]
    return (o / l_[..., None]).to(q.dtype)


def _expand_kv(x: Tensor, g: int) -> Tensor:
    return x if g == 1 else x.repeat_interleave(g, dim=-2)


@torch.library.custom_op("monorl::bi_varlen_attn", mutates_args=())
def bi_varlen_attn(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cu_seqlens: Tensor, pad_index: Tensor,
                   valid: Tensor) -> Tensor:
    """Causal attention of packed sequences: token t attends keys t - positions[t] .. t. `pad_index` / `valid`
    (the `VarlenContext`'s padded layout) are for backward, which must not read lengths on the host (it runs
    inside trainer CUDA graphs)."""
    if _use_triton(q):
        pos = positions.to(torch.int32)
        kbase = torch.arange(q.shape[0], device=q.device, dtype=torch.int32) - pos
        return attention_triton(q, k, v, kbase, pos + 1, None)
    g = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:], strict=True):  # one sequence at a time: each query row sees its keys
        L = b - a
        if L == 0:  # a static pack's zero-length entry
            continue
        kk, vv = _expand_kv(k[a:b], g), _expand_kv(v[a:b], g)
        valid = torch.ones(L, L, dtype=torch.bool).tril()
        rows = max(1, (1 << 22) // max(1, L * kk[0].numel()))
        for s in range(0, L, rows):
            e = min(L, s + rows)
            out[a + s:a + e] = _attn_cpu_rows(q[a + s:a + e], kk[None].expand(e - s, *kk.shape),
                                              vv[None].expand(e - s, *vv.shape), valid[s:e])
    return out


@bi_varlen_attn.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cu_seqlens: Tensor, pad_index: Tensor,
      valid: Tensor) -> Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("monorl::bi_varlen_attn_backward", mutates_args=())
def bi_varlen_attn_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, pad_index: Tensor,
                            valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of causal varlen attention by the textbook formulas in the padded [B, H, L, L] layout (fp32):
    backward values need not be invariant. Device tensors only (no host sync), so it can be graph-captured."""
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
    keys = valid | (torch.arange(L, device=q.device) == 0)
    mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()[None, None] & keys[:, None, None, :]
    p = torch.softmax((qp @ kp.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")), dim=-1)
    o = p @ vp
    dv = p.transpose(-1, -2) @ gp
    ds = p * (gp @ vp.transpose(-1, -2) - (gp * o).sum(-1, keepdim=True))
    dq = ds @ kp * scale
    dk = ds.transpose(-1, -2) @ qp * scale

    def unpadded(x: Tensor, heads: int) -> Tensor:  # [B, Hq, L, D] -> [T, heads, D], summing GQA groups
        x = x.view(B, heads, Hq // heads, L, D).sum(2).transpose(1, 2)  # [B, L, heads, D]
        # scatter by pad_index rather than boolean-mask indexing (data-dependent size: a host sync);
        # padding slots all point at the extra row T, which is dropped
        out = x.new_zeros(T + 1, heads, D)
        out[pad_index.reshape(-1)] = x.reshape(B * L, heads, D)
        return out[:T]

    return unpadded(dq, Hq).to(q.dtype), unpadded(dk, Hkv).to(k.dtype), unpadded(dv, Hkv).to(v.dtype)


@bi_varlen_attn_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, pad_index: Tensor,
      valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attn_setup(ctx, inputs, output) -> None:
    q, k, v, positions, cu_seqlens, pad_index, valid = inputs
    ctx.save_for_backward(q, k, v, pad_index, valid)


def _attn_backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, pad_index, valid = ctx.saved_tensors
    dq, dk, dv = bi_varlen_attn_backward(grad.contiguous(), q, k, v, pad_index, valid)
    return dq, dk, dv, None, None, None, None


bi_varlen_attn.register_autograd(_attn_backward, setup_context=_attn_setup)


@torch.library.custom_op("monorl::bi_paged_decode", mutates_args=())
def bi_paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor) -> Tensor:
    """q [B, Hq, D] attends the first seq_lens[b] keys of its block table (caches [N, bs, Hkv, D])."""
    if _use_triton(q):
        return attention_triton(q, k_cache, v_cache, None, seq_lens.to(torch.int32), block_tables)
    B, W = block_tables.shape
    bs, Hkv, D = k_cache.shape[1:]
    g = q.shape[1] // Hkv
    idx = block_tables.long()
    k = _expand_kv(k_cache[idx].view(B, W * bs, Hkv, D), g)
    v = _expand_kv(v_cache[idx].view(B, W * bs, Hkv, D), g)
    valid = torch.arange(W * bs, device=q.device)[None, :] < seq_lens[:, None]
    return _attn_cpu_rows(q, k.to(q.dtype), v.to(q.dtype), valid)


@bi_paged_decode.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor) -> Tensor:
    return torch.empty_like(q)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cu_seqlens: Tensor, pad_index: Tensor,
                     valid: Tensor) -> Tensor:
    return bi_varlen_attn(q, k, v, positions, cu_seqlens, pad_index, valid)


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor) -> Tensor:
    return bi_paged_decode(q, k_cache, v_cache, block_tables, seq_lens)
