"""Batch-invariant mode, as a conversion of the model: afterwards a token's log-prob depends neither on what
else is in the batch nor on the layout (a decode step, a prefill, a packed training forward). Convert the
trainer's model and the generator's copy, and the generator's log-probs equal the trainer's recomputed ones
bit for bit.

Why the defaults are not invariant: cuBLAS / MKL pick GEMM tilings and split-K by the number of rows, CUDA
reductions split a row across more threads when there are few rows, and flash attention's key-block order
differs between a prefill and a decode step. The kernels that fix their reduction order up front are in
`monorl.ops` (one file per family); backward stays ordinary math, since only forward values must match.

`make_batch_invariant_(model)` converts once, in place, by giving each piece its batch-invariant subclass
(`module.__class__ = ...`, as `torch.nn.utils.parametrize` does: parameters, buffers and hooks stay; only
forward's kernels change). Nothing inside the model branches on a mode, and a model not converted is
untouched:

- `Linear` -> `BatchInvariantLinear`, `RMSNorm` -> `BatchInvariantRMSNorm`: the invariant matmul / norm,
  the weight cast to the input's dtype (outside the op, so an fp32 master still gets its gradient);
- a LoRA projection (`monorl.model.lora.LoRALinear`) -> `BatchInvariantLoRALinear`: the base matmul and both
  adapter matmuls invariant (its `lora_A` / `lora_B` convert as ordinary `Linear`s). Bitwise trainer ==
  generator then needs the generator's copy to compute the same unmerged sum (LoRA applied to its unfused
  copy too, synced adapter by adapter): a merged weight W + scale * B @ A rounds differently;
- a mixture-of-experts block (`monorl.model.moe.SparseMoeBlock`) -> `BatchInvariantSparseMoeBlock`: fixed-order
  router softmax, every expert product on the invariant GEMM, so each token is routed to the same experts, and
  gets the same outputs from them, on both sides (its router is a `Linear`, converted as above);
- the vision tower's LayerNorms -> `BatchInvariantLayerNorm`: weight and bias in their input's dtype;
- the embedding -> `BatchInvariantEmbedding`: its output, and so the whole forward, in the compute dtype.
  That is autocast's dtype when autocast is on, the trainer's one setting in both modes (its fp32 masters
  then enter every op as exactly the generator's bf16 weights), else the weights' own (the generator);
- each block -> the fused Triton block kernels (`monorl.model.fused_kernels`: norms, q/k norm + RoPE, SiLU * up,
  row-local, with a backward), where the model's shape allows them (a power-of-two head_dim >= 16): one kernel
  per piece of elementwise work, shared by both sides, instead of whatever fusion each side's compile picks;
- Qwen3.5's Gated DeltaNet layers: the gated norm -> `BatchInvariantGatedRMSNorm`; in the mode's contexts the
  layer runs `monorl.ops.gated_delta_invariant` (one chunked order for the trainer, prefills and decode steps);
- the model -> `BatchInvariantDecoderForCausalLM`: the LM head and `token_logprobs` (the trainer and the
  sampler both call it through the model) use the invariant ops, and `forward` rebinds the attention
  context it is given to the invariant kernel (`ctx.batch_invariant()`): the context still says how the
  tokens are laid out, the model says which kernel attends them, whoever built the context.

Also for the process, since they are process-wide flags: TF32 and reduced-precision reductions off, which
would let cuBLAS (still used by backward) round differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from monorl.model.attention import AttentionContext
from monorl.model.decoder import DecoderForCausalLM
from monorl.model.fused_kernels import (
    FusedKernelsFinalNorm,
    FusedKernelsLinear,
    fused_kernels_supported,
    use_fused_kernels_,
)
from monorl.model.gemma3_fused import PLAIN_GEMMA3, FusedGemma3FinalNorm
from monorl.model.gpt_oss import BatchInvariantGptOssMoeBlock, GptOssMoeBlock
from monorl.model.layers import BatchInvariantOffsetRMSNorm, FusedOffsetRMSNorm, Linear, OffsetRMSNorm, RMSNorm
from monorl.model.lora import LoRALinear
from monorl.model.moe import BatchInvariantSparseMoeBlock, SparseMoeBlock
from monorl.model.qwen3_5 import BatchInvariantGatedRMSNorm, FusedGatedRMSNorm, GatedRMSNorm
from monorl.model.qwen3_5_fused import PLAIN_QWEN3_5, FusedQwen3_5FinalNorm
from monorl.ops import decode_gemm, logprob_invariant, matmul_invariant, rmsnorm_invariant


class BatchInvariantLinear(Linear):
    decode_rows_on_triton = True  # every product on the invariant GEMM (see `FusedKernelsLinear`)
    invariant_parts = True  # a decode step's o/down products may hand their K parts to the next add (`project`)

    def forward(self, x: Tensor) -> Tensor:
        y = matmul_invariant.linear(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)  # a row-local add (q/k/v biases)


class BatchInvariantLoRALinear(LoRALinear):
    def forward(self, x: Tensor) -> Tensor:
        a = matmul_invariant.linear(x, self.lora_A.weight)
        y = matmul_invariant.linear(x, self.weight)
        y = y if self.bias is None else y + self.bias.to(y.dtype)
        return y + matmul_invariant.linear(a, self.lora_B.weight) * self.scale


class BatchInvariantRMSNorm(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        return rmsnorm_invariant.rms_norm(x, self.weight, self.eps)


class BatchInvariantFinalNorm(BatchInvariantRMSNorm):
    """A fused-kernels model's final norm in the mode: the last block's pending pair (h, m) summed first (m a
    product, or its split-K parts: `monorl.ops.decode_gemm.sum_parts`), then the invariant norm."""

    takes_pending = True  # `DecoderForCausalLM.forward` hands it the last block's output as it is

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        if isinstance(x, tuple):
            h, m = x
            x = h + m if m.dim() == h.dim() else h + decode_gemm.sum_parts(m, h.dtype)
        return super().forward(x)


class BatchInvariantEmbedding(nn.Embedding):
    def forward(self, input_ids: Tensor) -> Tensor:
        x = super().forward(input_ids)
        device = x.device.type
        return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


class BatchInvariantLayerNorm(nn.LayerNorm):
    """The vision tower's LayerNorms in the mode: weight and bias as the input's dtype holds them (the trainer's
    fp32 masters rounded as the generator's bf16 copy; unrounded, a Qwen3-VL tower's log-probs differed after an
    update, `tests/test_mode_master_rounding.py`), computed in fp32 and rounded to the input's dtype on both sides
    (CUDA autocast runs layer_norm in fp32 and hands the next product fp32 rows; the generator has no autocast)."""

    def forward(self, x: Tensor) -> Tensor:
        w, b = (None if t is None else t.to(x.dtype).float() for t in (self.weight, self.bias))
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


class BatchInvariantDecoderForCausalLM(DecoderForCausalLM):
    token_logprobs = staticmethod(logprob_invariant.token_logprobs)

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext,
                kv_cache: Sequence[Any] | None = None, rope: tuple[Tensor, Tensor] | None = None,
                inputs_embeds: Tensor | None = None,
                deepstack: tuple[Tensor, Sequence[Tensor]] | None = None) -> Tensor:
        return super().forward(input_ids, positions, ctx.batch_invariant(), kv_cache, rope, inputs_embeds, deepstack)

    def compute_logits(self, hidden: Tensor, weight: Tensor | None = None) -> Tensor:
        return matmul_invariant.linear(hidden, self.lm_head_weight if weight is None else weight)


_CONVERTED = {Linear: BatchInvariantLinear, FusedKernelsLinear: BatchInvariantLinear,
              LoRALinear: BatchInvariantLoRALinear, RMSNorm: BatchInvariantRMSNorm,
              FusedKernelsFinalNorm: BatchInvariantFinalNorm,
              nn.Embedding: BatchInvariantEmbedding, DecoderForCausalLM: BatchInvariantDecoderForCausalLM,
              SparseMoeBlock: BatchInvariantSparseMoeBlock, OffsetRMSNorm: BatchInvariantOffsetRMSNorm,
              FusedOffsetRMSNorm: BatchInvariantOffsetRMSNorm,  # (the generator's CUDA copy: `use_fused_norms_`)
              GatedRMSNorm: BatchInvariantGatedRMSNorm, FusedGatedRMSNorm: BatchInvariantGatedRMSNorm,
              GptOssMoeBlock: BatchInvariantGptOssMoeBlock,
              nn.LayerNorm: BatchInvariantLayerNorm, FusedGemma3FinalNorm: BatchInvariantOffsetRMSNorm,
              FusedQwen3_5FinalNorm: BatchInvariantOffsetRMSNorm,
              **PLAIN_GEMMA3, **PLAIN_QWEN3_5}  # (the generator's fused Gemma 3, Qwen3.5 layers back to plain ones)


def make_batch_invariant_(model: DecoderForCausalLM) -> DecoderForCausalLM:
    """Convert `model` in place (see the module docstring); idempotent. Returns it."""
    if not isinstance(model, DecoderForCausalLM):
        raise TypeError(f"make_batch_invariant_ converts a DecoderForCausalLM, got {type(model).__name__}")
    if fused_kernels_supported(model):
        use_fused_kernels_(model)
    for m in model.modules():
        if type(m) in _CONVERTED:
            m.__class__ = _CONVERTED[type(m)]
        elif isinstance(m, nn.Linear | nn.Embedding) and type(m) not in _CONVERTED.values():
            raise TypeError(f"make_batch_invariant_: no batch-invariant form of {type(m).__name__}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    return model


def is_batch_invariant(model: nn.Module) -> bool:
    return isinstance(model, BatchInvariantDecoderForCausalLM)
