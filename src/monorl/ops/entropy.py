"""Each row's entropy of softmax(logits / temperature), the trainer's entropy metric, in one Triton program per
row on CUDA: two reads of the row's logits in their own dtype, no fp32 copy of them. In PyTorch ops the metric
was ~10 ms of a Qwen3-0.6B trainer step (an fp32 copy, log_softmax, exp, mul and sum over [4000, 151936]
logits, benchmarks/RESULTS.md 2026-11-25 (later)); this reads 1.2 GB twice. A metric: no gradient, and no
batch invariance needed (nothing compares it bitwise).
"""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, unit_stride, use_triton
from monorl.ops.tunables import chip_for, tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _entropy_kernel(x_ptr, o_ptr, V, stride_x, inv_t, BLOCK_V: tl.constexpr):
        # H = -sum p log p with p = e / S, e = exp(z - m), z = logit / T: H = m + log S - sum(e z) / S
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        offs = tl.arange(0, BLOCK_V)
        m_vec = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
        for s in range(0, V, BLOCK_V):
            z = tl.load(base + s + offs, mask=s + offs < V, other=float("-inf")).to(tl.float32) * inv_t
            m_vec = tl.maximum(m_vec, z)
        m = tl.max(m_vec, axis=0)
        s_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
        t_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
        for s in range(0, V, BLOCK_V):
            z = tl.load(base + s + offs, mask=s + offs < V, other=float("-inf")).to(tl.float32) * inv_t
            e = tl.exp(z - m)
            s_vec += e
            t_vec += tl.where(e > 0, e * (z - m), 0.0)  # z - m: the sum stays small; a masked lane adds 0
        S = tl.sum(s_vec, axis=0)
        tl.store(o_ptr + row, tl.log(S) - tl.sum(t_vec, axis=0) / S)


def token_entropy(logits: Tensor, temperature: float = 1.0, block: int = 256) -> Tensor:
    """Entropy (nats) of each row's temperature-scaled distribution, softmax(logits / temperature):
    logits [N, V] -> [N] fp32, detached. Off CUDA in PyTorch ops, `block` rows at a time, so the fp32
    temporaries stay a fraction of one logprob chunk."""
    logits = logits.detach()
    if use_triton(logits):
        N, V = logits.shape
        x = unit_stride(logits)
        out = torch.empty(N, dtype=torch.float32, device=x.device)
        if N:
            chip = chip_for(x)
            _entropy_kernel[(N,)](x, out, V, x.stride(0), 1.0 / float(temperature),
                                  BLOCK_V=tuned("entropy.block", chip), num_warps=tuned("entropy.warps", chip))
        return out
    out = []
    with torch.no_grad():
        for s in range(0, logits.shape[0], block):
            z = logits[s:s + block].float()
            if temperature != 1.0:
                z = z / temperature
            logp = torch.log_softmax(z, dim=-1)
            del z
            out.append(-torch.exp(logp).mul_(logp).sum(-1))
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)
