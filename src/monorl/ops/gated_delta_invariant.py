"""The gated delta rule in batch-invariant mode: the trainer, the prefill, a turn's cached prefill and every decode
step compute each token in one and the same order, so the generator's log-probs equal the trainer's bit for bit.

What was chosen: everything is the chunked algorithm (`monorl.ops.gated_delta`'s, chunks of `CHUNK` counted from
each sequence's own start), built only from elementwise ops and fixed-order tree sums (`tree_sum`): a row's value
depends neither on the batch (how many chunks or sequences are computed together) nor on the chunk's later rows.
The state advances only at chunk boundaries, by the same chunk update on every side. The generator's row therefore
keeps the state at the sequence's last boundary plus the current chunk's raw k, v, g, beta so far (`kept`, up to
CHUNK - 1 tokens); a decode step assembles the chunk (kept rows, its token, zeros after) and computes it whole,
taking its own row, and advances the state when its token completes the chunk; a cached prefill puts the kept rows
before its new tokens (their outputs dropped). The same code runs on CPU and CUDA (plain torch ops, never `fla`:
its kernels' order differs between its chunked and recurrent forms).

What it costs: a row of the engine's recurrent state holds CHUNK more tokens' k/v/g/beta per linear-attention
layer (`RecurrentState.bytes_per_sequence`: about doubles it at Qwen3.5's shapes); a decode step computes a whole
chunk (CHUNK x the work of the one-token step); the tree sums multiply before they add ([.., M, N, D] products,
sliced to bound the buffer), so the trainer's and the prefill's rule is several times slower than the default
reference and much slower than `fla` (benchmarks/bench_gdn_invariant.py). A fused Triton form is the way to make
it fast; it is not written yet.

Shapes as in `monorl.ops.gated_delta`: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; states [N, Hv, Dk, Dv]
fp32. Kept rows: (k [N, C, Hk, Dk], v [N, C, Hv, Dv] in v's dtype, g and beta [N, C, Hv] fp32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from monorl.ops.tree_sum import tree_sum

CHUNK = 64  # the mode's chunk (the default reference's and fla's); read at call time (tests use a small one)
_BUFFER = 1 << 22  # elements of one product buffer before a tree sum (~16 MB fp32)

Kept = tuple[Tensor, Tensor, Tensor, Tensor]


def pointwise(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn(x) for an elementwise transcendental fn (exp, sigmoid, softplus, SiLU) whose value at an element does not
    depend on where it sits. On CPU ATen computes a tensor's last numel % 16 (AVX2; 32 AVX-512) elements with the
    scalar libm form, which rounds differently from the SIMD form, so the same token's g differed between a pack of
    one sequence and of two: here every element takes the SIMD form (padded to a multiple of 64, in pieces under
    ATen's parallel grain, so no thread split leaves a tail either). CUDA's elementwise kernels are per element."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.contiguous().view(-1)
    n = flat.numel()
    flat = F.pad(flat, (0, -n % 64))
    out = torch.cat([fn(p) for p in flat.split(1 << 15)]) if n else fn(flat)
    return out[:n].view(x.shape)


def _exp(x: Tensor) -> Tensor:
    return pointwise(torch.exp, x)


def _contract(a: Tensor, b: Tensor) -> Tensor:
    """out[..., m, n] = sum_d a[..., m, d] * b[..., n, d], each element summed in one fixed order (`tree_sum`),
    sliced over the leading dim to bound the product buffer."""
    a, b = torch.broadcast_tensors(a[..., :, None, :], b[..., None, :, :])
    if a.dim() < 4 or a[0].numel() == 0:
        return tree_sum(a * b)
    step = max(1, _BUFFER // a[0].numel())
    return torch.cat([tree_sum(a[i:i + step] * b[i:i + step]) for i in range(0, a.shape[0], step)])


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """Raw chunks [B, C, H, D] / [B, C, H] -> fp32 [B, H, C, D] / [B, H, C]: q/k heads repeated to v's, L2-normalised
    by a tree sum, q scaled (`gated_delta._prepare`'s arithmetic, row-local)."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    q = q * torch.rsqrt(tree_sum(q * q)[..., None] + 1e-6)
    k = k * torch.rsqrt(tree_sum(k * k)[..., None] + 1e-6)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float()


class _Intra:
    """The state-free part of chunks [B, H, C, ...]: cumulative decays, the intra-chunk attention and the UT
    transform (forward substitution row by row), each row from the rows before it only."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> None:
        C = q.shape[-2]
        upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
        self.cum = cum = tree_sum(g[..., None, :].expand(*g.shape, C).masked_fill(upper, 0.0))
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf"))
        decay = _exp(decay)
        k_beta, v_beta = k * beta[..., None], v * beta[..., None]
        on_or_above = torch.ones_like(upper).triu()
        lower = (_contract(k_beta, k) * decay).masked_fill(on_or_above, 0.0)  # strictly lower
        self.intra = _contract(q, k) * decay  # zero above the diagonal (exp(-inf))
        rhs = torch.cat([v_beta, k_beta * _exp(cum)[..., None]], dim=-1)
        rows = [rhs[..., 0, :]]
        for r in range(1, C):  # (I + strictly-lower) x = rhs
            prev = torch.stack(rows, dim=-1)  # [..., D, r]
            rows.append(rhs[..., r, :] - _contract(lower[..., r:r + 1, :r], prev)[..., 0, :])
        x = torch.stack(rows, dim=-2)
        Dv = v.shape[-1]
        self.new_values, self.k_cumdecay = x[..., :Dv], x[..., Dv:]
        self.q_decayed = q * _exp(cum)[..., None]
        self.k_to_end = k * _exp(cum[..., -1:] - cum)[..., None]

    def step(self, idx: Tensor | slice, state: Tensor) -> tuple[Tensor, Tensor]:
        """Chunks `idx` from their states [b, H, Dk, Dv] -> (o [b, H, C, Dv], the state after the whole chunk)."""
        st = state.transpose(-1, -2)  # [b, H, Dv, Dk]
        v_new = self.new_values[idx] - _contract(self.k_cumdecay[idx], st)
        o = _contract(self.q_decayed[idx], st) + _contract(self.intra[idx], v_new.transpose(-1, -2))
        end = state * _exp(self.cum[idx][..., -1])[..., None, None] + _contract(
            self.k_to_end[idx].transpose(-1, -2), v_new.transpose(-1, -2))
        return o, end


def _zeros_state(n: int, v: Tensor, dk: int) -> Tensor:
    return torch.zeros(n, v.shape[1], dk, v.shape[2], dtype=torch.float32, device=v.device)


def invariant_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                   state: Tensor | None = None, kept: Kept | None = None,
                   kept_len: list[int] | None = None) -> tuple[Tensor, Tensor, Kept, list[int]]:
    """Packed sequences, each continuing from its boundary state (zeros where None) after its `kept_len` kept raw
    rows -> (o [T, Hv, Dv] in v's dtype, each one's state at its last complete chunk, its kept rows after (those
    past that boundary, zero-padded to CHUNK), their counts). Reads cu_seqlens on the host (the trainer, prefills)."""
    C = CHUNK
    bounds = cu_seqlens.tolist()
    N = len(bounds) - 1
    m = kept_len or [0] * N
    g, beta = g.float(), beta.float()
    raw, spans = [], []  # per sequence: its chunks' raw rows; (first chunk, chunks, kept rows, total rows)
    first = 0
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        ks, vs, gs, bs = k[a:b], v[a:b], g[a:b], beta[a:b]
        qs = q[a:b]
        if m[s]:
            kk, kv, kg, kb = (t[s, :m[s]] for t in kept)
            ks, vs, gs, bs = torch.cat([kk, ks]), torch.cat([kv, vs]), torch.cat([kg, gs]), torch.cat([kb, bs])
            qs = torch.cat([qs.new_zeros(m[s], *qs.shape[1:]), qs])
        total = m[s] + b - a
        n_chunks = -(-total // C)
        pad = n_chunks * C - total
        raw.append([F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).reshape(n_chunks, C, *t.shape[1:])
                    for t in (qs, ks, vs, gs, bs)])
        spans.append((first, n_chunks, m[s], total))
        first += n_chunks
    chunks = [torch.cat(parts) for parts in zip(*raw, strict=True)] if raw else None
    states = list((_zeros_state(N, v, q.shape[-1]) if state is None else state.float()).unbind(0))
    outs: list[Tensor | None] = [None] * first
    if first:
        intra = _Intra(*_prepare(*chunks))
        for j in range(max(n for _, n, _, _ in spans)):  # chunk j of every sequence that has one, together
            seqs = [s for s, (_, n, _, _) in enumerate(spans) if n > j]
            idx = torch.tensor([spans[s][0] + j for s in seqs], device=q.device)
            o, end = intra.step(idx, torch.stack([states[s] for s in seqs]))
            for i, s in enumerate(seqs):
                outs[spans[s][0] + j] = o[i]
                if (j + 1) * C <= spans[s][3]:  # a complete chunk: the state advances
                    states[s] = end[i]
    Hv, Dv = v.shape[1], v.shape[2]
    o_seqs, tails, tail_len = [], [], []
    for f, n, mk, total in spans:
        if n:
            o_s = torch.stack(outs[f:f + n]).permute(0, 2, 1, 3).reshape(n * C, Hv, Dv)
            o_seqs.append(o_s[mk:total])
        rest = total % C
        tails.append([t[f + n - 1] if rest else torch.zeros_like(t[0]) for t in chunks[1:]] if n else None)
        tail_len.append(rest)
    o = torch.cat(o_seqs).to(v.dtype) if o_seqs else v.new_zeros(0, Hv, Dv)
    shapes = [(C, *k.shape[1:]), (C, *v.shape[1:]), (C, Hv), (C, Hv)]
    dtypes = [k.dtype, v.dtype, torch.float32, torch.float32]
    new_kept = tuple(torch.stack([t[i] if t is not None else torch.zeros(shapes[i], dtype=dtypes[i],
                                                                        device=v.device) for t in tails])
                     if N else v.new_zeros(0, *shapes[i]) for i in range(4))
    return o, torch.stack(states) if N else _zeros_state(0, v, q.shape[-1]), new_kept, tail_len


def invariant_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, kept: Kept,
                     position: Tensor) -> tuple[Tensor, Tensor, Kept]:
    """One token per sequence (q, k [N, Hk, Dk], ...) at `position` [N] (0-based, from the sequence's start), from
    its boundary state and kept rows -> (o [N, Hv, Dv], the state (advanced where the token completes its chunk),
    the kept rows with the token's). No host read (a CUDA graph may hold it)."""
    C = CHUNK
    r = (position % C).long()
    pos = torch.arange(C, device=q.device)
    before, at = pos[None] < r[:, None], pos[None] == r[:, None]  # [N, C]
    new = (k, v, g.float(), beta.float())

    def where(mask: Tensor, a: Tensor, b: Tensor | float) -> Tensor:  # mask [N, C] over rows [N, C, ...]
        return torch.where(mask.view(*mask.shape, *[1] * (a.dim() - 2)), a, b)

    rows = tuple(where(at, x[:, None].expand_as(kx), kx) for x, kx in zip(new, kept, strict=True))
    chunk = tuple(where(before | at, x, 0.0) for x in rows)  # the rows after the token: zeros
    q_chunk = torch.where(at.view(*at.shape, 1, 1), q[:, None], 0)
    intra = _Intra(*_prepare(q_chunk, *chunk))
    o, end = intra.step(slice(None), state.float())
    o = o.gather(2, r.view(-1, 1, 1, 1).expand(o.shape[0], o.shape[1], 1, o.shape[3]))[:, :, 0]
    full = (r == C - 1).view(-1, 1, 1, 1)
    return o.to(v.dtype), torch.where(full, end, state.float()), rows
