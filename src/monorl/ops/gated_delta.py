"""Gated DeltaNet's token mixing (Qwen3.5's linear-attention layers, `monorl.model.qwen3_5`): the causal depthwise
convolution with its carried state, and the gated delta rule over packed sequences with carried recurrent states.

Plain PyTorch references, monorl's own (CPU, the CI's path, and every device where `fla` is absent):
`chunk_gated_delta_rule` (training and prefill: transformers' `torch_chunk_gated_delta_rule` algorithm, chunks of 64
from each sequence's start, autograd through it) and `recurrent_gated_delta_rule` (one token at a time: decode).
Both take the state of each sequence (`initial_state`, zeros where None) and return each one's final state, so a
pack of sequences is computed as each alone. `fla` (the `linear-attention` extra, `fla-core`: the kernels transformers
and vLLM call) serves on CUDA while `FLA_ENABLED` is on (the default); `rule_path` (below) is where monorl decides,
per call, which rule runs, and logs each choice once:

- fla's forward wherever it is enabled and installed (no grad: prefill, old/reference log-probs);
- with a gradient on Hopper under Triton 3.4.0 .. 3.7.0 (torch 2.11's Triton is 3.6), fla's backward raises (its
  gated `chunk_bwd_dqkwg` computes wrongly there, fla #640) unless fla's tilelang backend is usable: then the
  reference runs the training forward and backward. tilelang is no cure here: a 50 MB wheel that pulls z3-solver,
  apache-tvm-ffi and needs nvcc at run time to JIT its kernels (2026-12-06). fla's forward with the reference's
  backward would cost the reference's forward again in backward, more than the reference alone.

Where fla serves the trainer pack (its rule with the gradient needed, `gated_delta_padded.serves`), the pack's conv
and rule run on one padded sequence with no host read (`monorl.ops.gated_delta_padded`: a trainer CUDA graph holds
it). Where fla serves only the forward (its backward guarded), the pack's conv still runs on fla's varlen causal conv
(`packed_causal_conv`) and one forward's layers share one `fla_bounds` (fla's chunk indices built once, from a host
copy).

On an H100 (2026-12-07, fla-core 0.6.0, Triton 3.6; tests/test_qwen3_5_gpu.py) the hybrid generator with fla in
prefill and the in-place decode kernels was as exact as the trainer against a float64 forward, in bf16, as it was on
the plain paths; so fla and those kernels are on by default. (Earlier runs failed a direct generator-trainer
tolerance of 0.1 on the plain paths too: at the test's weights bf16 rounding alone moves the trainer up to 0.97
off the float64 forward, `benchmarks/check_hybrid_generator.py`.) A generator's decode step on CUDA runs neither rule:
`monorl.ops.gated_delta_decode` updates each row's states in place. fla compiles and autotunes its kernels on first
use (54-148 s on a fresh H100, 2026-12-07) and keeps the results on disk (`FLA_CACHE_RESULTS`).

Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv] (Hv a multiple of Hk: each key head serves Hv / Hk consecutive value
heads); g (log decay, <= 0) and beta [T, Hv]; states [N, Hv, Dk, Dv] in fp32; cu_seqlens [N + 1]. q and k are
L2-normalised here (transformers' `use_qk_l2norm_in_kernel=True`) and q scaled by Dk ** -0.5.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from monorl.ops import sequence_of_rows
from monorl.ops.row_copies import take_rows

CHUNK = 64  # the chunked form's chunk (transformers' and fla's)
FLA_ENABLED = True  # fla's kernels on CUDA (off: monorl's references everywhere; the module docstring)
FLA_BAD_TRITON = ((3, 4, 0), (3, 7, 1))  # [from, to): Hopper + these Triton versions miscompute fla's gated backward
log = logging.getLogger(__name__)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """fp32, q/k heads repeated to v's, q and k L2-normalised, q scaled: [H, T, D] / [H, T]."""
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.t().float(), beta.t().float()


def _chunks(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
            chunk: int) -> tuple[Tensor, Tensor]:
    """Sequences prepared and padded to whole chunks ([..., n, D], g and beta [..., n]; the leading dims a batch of
    sequences and heads), each from its `state` [..., Dk, Dv]: transformers' chunked algorithm, batched."""
    *lead, n, _ = q.shape
    C, Dv = n // chunk, v.shape[-1]
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(*lead, C, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(*lead, C, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    # (I + strictly-lower(system)) x = rhs: the UT transform of the chunk's delta-rule updates
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                               unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = []
    for i in range(C):
        v_new = new_values[..., i, :, :] - k_cumdecay[..., i, :, :] @ state
        out.append(q[..., i, :, :] @ state + intra[..., i, :, :] @ v_new)
        state = state * chunk_decay[..., i, :, :] + k[..., i, :, :].transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=-3).reshape(*lead, n, Dv) if out else v.new_zeros(*lead, 0, Dv)
    return o, state


def _states(initial_state: Tensor | None, n: int, v: Tensor, dk: int) -> Tensor:
    if initial_state is not None:
        return initial_state.float()
    return torch.zeros(n, v.shape[1], dk, v.shape[2], dtype=torch.float32, device=v.device)


@functools.lru_cache(maxsize=16)  # every Gated DeltaNet layer of a forward has the same sequences
def _chunk_layout(bounds: tuple[int, ...], chunk: int, zero: int,
                  device: torch.device) -> tuple[list[tuple[list[int], Tensor]], Tensor, Tensor]:
    """Sequences at `bounds` grouped by chunk count -> ([(a group's sequences, their tokens [n, C * chunk], the
    zero token `zero` past each end)], each token's row in the groups' outputs end to end, the order that puts the
    groups' final states back in sequence order), on `device` (copied there once for all the forward's layers).
    Made outside inference mode wherever it is first asked for: the cache outlives the generator's prefill that may
    make it, and a trainer forward with the same bounds saves these indices for backward (an inference tensor there
    raises)."""
    with torch.inference_mode(False):
        return _make_chunk_layout(bounds, chunk, zero, device)


def _make_chunk_layout(bounds: tuple[int, ...], chunk: int, zero: int,
                       device: torch.device) -> tuple[list[tuple[list[int], Tensor]], Tensor, Tensor]:
    start = bounds[0]
    groups: dict[int, list[int]] = {}
    for s in range(len(bounds) - 1):
        groups.setdefault(-(-(bounds[s + 1] - bounds[s]) // chunk), []).append(s)
    layout, rows, order, done = [], torch.zeros(bounds[-1] - start, dtype=torch.long), [], 0
    for C, seqs in groups.items():
        first = torch.tensor([bounds[s] for s in seqs])[:, None]
        end = torch.tensor([bounds[s + 1] for s in seqs])[:, None]
        tok = first + torch.arange(C * chunk)
        valid = tok < end
        rows[tok[valid] - start] = done + torch.arange(tok.numel()).view(tok.shape)[valid]
        layout.append((seqs, torch.where(valid, tok, zero).to(device)))
        order += seqs
        done += tok.numel()
    back = torch.tensor(sorted(range(len(order)), key=order.__getitem__), dtype=torch.long)
    return layout, rows.to(device), back.to(device)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                           initial_state: Tensor | None = None, chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """The chunked reference over packed sequences -> (o [T, Hv, Dv] fp32, final states [N, ...] fp32). Reads
    cu_seqlens on the host. Sequences of one chunk count are computed together, each padded with zero tokens to
    its whole chunks (k = 0 and beta = 0: a padded token leaves the state as it is, as the per-sequence form's
    padding did), so a pack costs one batched pass per distinct chunk count, not one per sequence (a Qwen3.5-0.8B
    RL step trained 13 s on an H100 that way, 2026-12-07)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    H, T, Dv = v.shape
    bounds = tuple(cu_seqlens.tolist())
    states = _states(initial_state, len(bounds) - 1, v.transpose(0, 1), q.shape[-1])
    if bounds[-1] == bounds[0]:
        return v.new_zeros(0, H, Dv), states
    layout, rows, order = _chunk_layout(bounds, chunk, T, q.device)
    # the zero token at index T: what every sequence is padded with
    q, k, v = (torch.cat([x, x.new_zeros(H, 1, x.shape[-1])], dim=1) for x in (q, k, v))
    g, beta = (torch.cat([x, x.new_zeros(H, 1)], dim=1) for x in (g, beta))
    outs, finals = [], []
    for seqs, tok in layout:
        o, st = _chunks(*(x[:, tok].transpose(0, 1) for x in (q, k, v, g, beta)), states[seqs], chunk)
        outs.append(o.transpose(1, 2).reshape(-1, H, Dv))  # [n, H, L, Dv] -> a row per (sequence, position)
        finals.append(st)
    return torch.cat(outs)[rows], torch.cat(finals)[order]


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                               initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The token-by-token reference (transformers' `torch_recurrent_gated_delta_rule`), same contract as
    `chunk_gated_delta_rule`. With one token per sequence (decode) it reads nothing on the host."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    N = cu_seqlens.shape[0] - 1
    state = _states(initial_state, N, v.transpose(0, 1), q.shape[-1])
    if q.shape[1] == N:  # one token each: [H, N, ...] -> [N, H, ...], one batched step
        o, state = _step(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t(), state)
        return o, state
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        st = state[s]
        for t in range(a, b):
            o, st = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], st)
            outs.append(o)
        finals.append(st)
    o = torch.stack(outs) if outs else v.new_zeros(0, v.shape[0], v.shape[-1])
    return o, torch.stack(finals)


def _step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token per state: q, k [..., Dk], v [..., Dv], g, beta [...], state [..., Dk, Dv]."""
    state = state * g.exp()[..., None, None]
    memory = (state * k[..., None]).sum(dim=-2)
    delta = (v - memory) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


@functools.cache
def _fla() -> Any:
    """fla's gated delta rule ops, or None where `fla-core` is not installed (the optional extra)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as recurrent
    except ImportError:
        return None
    return chunk, recurrent


@functools.cache
def fla_conv() -> Any:
    """fla's causal depthwise conv (Triton, varlen, with its backward), or None where `fla-core` is not installed."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return None
    return causal_conv1d


def fla_serves(t: Tensor) -> bool:
    """Whether fla's kernels may run on `t`'s device: CUDA, `FLA_ENABLED`, fla-core installed (for the rule,
    `rule_path` then also checks its backward's Triton versions)."""
    return t.is_cuda and FLA_ENABLED and _fla() is not None


def fla_bounds(cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """cu_seqlens as fla's varlen kernels take it: int64 on its device, and a host copy (one device read). Made once
    per forward and handed to every layer: fla memoizes its chunk indices by the identity of these tensors, and with
    the host copy builds them without reading the device. Without both, each layer's fla call read the device
    (`repeat_interleave` over device counts) and the host fell behind the GPU at every layer."""
    return cu_seqlens.long(), cu_seqlens.detach().to("cpu", torch.long)


def version_tuple(version: str) -> tuple[int, ...]:
    """'3.7.1+gitabc' -> (3, 7, 1): the leading numbers of a version string."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def rule_path(cuda_capability: tuple[int, int] | None, needs_grad: bool, enabled: bool, fla_installed: bool,
              triton_version: str, tilelang_usable: bool) -> tuple[str, str]:
    """Which rule runs -> ("fla" | "reference", why). cuda_capability: the device's (None off CUDA)."""
    if cuda_capability is None:
        return "reference", "not on CUDA"
    if not enabled:
        return "reference", "fla off (monorl.ops.gated_delta.FLA_ENABLED)"
    if not fla_installed:
        return "reference", "fla-core not installed (the linear-attention extra)"
    lo, hi = FLA_BAD_TRITON
    if needs_grad and cuda_capability[0] == 9 and lo <= version_tuple(triton_version) < hi and not tilelang_usable:
        return "reference", (f"with a gradient: fla's gated backward is wrong on Hopper with Triton {triton_version} "
                             "(fla #640; Triton >= 3.7.1 or fla's tilelang backend fixes it)")
    return "fla", "fla-core's kernels"


@functools.cache
def fla_tilelang_usable() -> bool:
    """Whether fla routes its gated chunk backward to tilelang (installed, nvcc found, not switched off)."""
    try:
        from fla.ops.common.backends.tilelang import CommonTileLangBackend
    except ImportError:
        return False
    return bool(CommonTileLangBackend.can_use())


@functools.cache
def _log_path(path: str, why: str) -> None:
    log.info("gated delta rule: %s (%s)", path, why)


def choose_fla(q: Tensor, tensors: tuple[Tensor | None, ...], reference: bool) -> Any:
    """fla's ops for this call, or None for the references (`rule_path`, logged once per choice)."""
    if reference or not q.is_cuda:
        return None
    import triton  # on CUDA, torch brings it

    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    fla = _fla() if FLA_ENABLED else None
    path, why = rule_path(torch.cuda.get_device_capability(q.device), needs_grad, FLA_ENABLED, fla is not None,
                          triton.__version__, fla is not None and fla_tilelang_usable())
    _log_path(path, why)
    return fla if path == "fla" else None


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                     initial_state: Tensor | None, one_token_each: bool, reference: bool = False,
                     bounds: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The rule over packed sequences: fla's kernels or the references, as `rule_path` decides (`reference`: the
    references); one_token_each (decode): the recurrent step, else the chunked form. bounds: `fla_bounds` of
    cu_seqlens, shared by a forward's layers (made here when None)."""
    fla = choose_fla(q, (q, k, v, g, beta, initial_state), reference)
    if fla is None:
        if one_token_each:
            return recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state)
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state)
    chunk, recurrent = fla
    state = None if initial_state is None else initial_state.float()
    # g and beta by keyword: fla 0.6's fused_recurrent takes (q, k, v, g, gk, gv, beta, ...), so a positional beta
    # lands in gk (a per-key log decay), beta defaults to ones, and the state grows without bound
    if one_token_each:  # [B, 1, H, D]: each sequence its own batch row
        o, final = recurrent(q[:, None], k[:, None], v[:, None], g=g[:, None].float(), beta=beta[:, None],
                             initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o[:, 0], final
    cu, cu_host = bounds if bounds is not None else fla_bounds(cu_seqlens)
    o, final = chunk(q[None], k[None], v[None], g=g[None].float(), beta=beta[None], initial_state=state,
                     output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_host, use_qk_l2norm_in_kernel=True)
    return o[0], final


def packed_causal_conv(x: Tensor, weight: Tensor, cu_seqlens: Tensor,
                       bounds: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """SiLU(causal depthwise conv) of packed sequences that start from zeros and keep no state (the trainer's pack)
    -> out [T, C]: fla's varlen kernel (forward and backward; the weight rounded to x's dtype first, as
    `causal_conv` does) where `fla_serves` (fla #640 concerns the rule's backward, not the conv's), else
    `causal_conv`. fla's kernel sums the taps in fp32, `causal_conv` rounds each to x's dtype: the default mode's
    trainer and generator may differ there by bf16 rounding (measured each step as logprob_diff); batch-invariant
    mode runs `causal_conv` on both sides. On an H100 the gathers' forward and index_add_ backward
    took ~0.2 s of a Qwen3.5-0.8B RL step's training (2026-12-07)."""
    fla = fla_conv() if fla_serves(x) else None
    if fla is None:
        return causal_conv(x, weight, cu_seqlens, None)[0]
    _log_path("fla for the causal conv too", "fla-core's varlen kernel")
    cu, cu_host = bounds if bounds is not None else fla_bounds(cu_seqlens)
    y, _ = fla(x[None], weight.to(x.dtype), activation="silu", cu_seqlens=cu, cu_seqlens_cpu=cu_host)
    return y[0]


def causal_conv(x: Tensor, weight: Tensor, cu_seqlens: Tensor, initial: Tensor | None,
                silu: Callable[[Tensor], Tensor] = F.silu) -> tuple[Tensor, Tensor]:
    """SiLU(causal depthwise conv) of packed sequences x [T, C] by weight [C, K], each sequence continuing from its
    state initial [N, K - 1, C] (its K - 1 inputs before; zeros where None) -> (out [T, C], final states
    [N, K - 1, C]: the last K - 1 inputs, state rows included). Gathers, no host read; row-local (a token's
    output is the same whatever else is packed).

    The inputs are laid out once as each sequence's K - 1 state rows then its tokens (a permutation of x and the
    states' rows); each tap is then one gather of distinct rows, so every backward is an index_add_ without
    duplicates (`take_rows`). A single [T, K] gather of x names each row K times, and autograd's backward of it is
    CUDA's sort-based accumulating index_put (the cost #62 found in the trainer's row gathers)."""
    T, C = x.shape
    K = weight.shape[1]
    N = cu_seqlens.shape[0] - 1
    dev = x.device
    if initial is None:
        initial = x.new_zeros(N, K - 1, C)
    cu = cu_seqlens.long()
    t = torch.arange(T, device=dev)
    pos = t + (sequence_of_rows(cu, t) + 1) * (K - 1)  # each token's row in the layout
    starts = cu[:-1] + torch.arange(N, device=dev) * (K - 1)  # each sequence's first state row there
    state_rows = (starts[:, None] + torch.arange(K - 1, device=dev)).flatten()
    source = torch.empty(T + N * (K - 1), dtype=torch.long, device=dev)  # the layout's row -> a row of src
    source[pos] = t
    source[state_rows] = torch.arange(T, T + N * (K - 1), device=dev)
    laid = take_rows(torch.cat([x, initial.to(x.dtype).reshape(N * (K - 1), C)]), source)
    taps = weight.t().to(x.dtype)  # [K, C]; tap i reads the input K - 1 - i before
    out = take_rows(laid, pos - (K - 1)) * taps[0]
    for i in range(1, K):  # the taps added in one fixed order (batch-invariant mode relies on it)
        out = out + take_rows(laid, pos - (K - 1) + i) * taps[i]
    # the last K - 1 rows of each sequence's block: its last inputs, state rows where it is shorter
    last = (cu[1:] + torch.arange(N, device=dev) * (K - 1))[:, None] + torch.arange(K - 1, device=dev)
    return silu(out), take_rows(laid, last.flatten()).view(N, K - 1, C)
