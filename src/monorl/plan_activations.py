"""The trainer's activation model for the memory plan (`monorl.plan`): what one micro-batch's forward and backward
hold, per token and layer, as a linear model in the layer's widths whose coefficients were measured
(`benchmarks/fit_activations.py`, `benchmarks/memory.py`; `ACTIVATION_COEFFS` says where each set comes from)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from monorl.model.config import ModelConfig

# a no-grad forward's transient (the generator's prefill, a reward model's packs): ~4 [tokens, width] tensors of
# its dtype alive in a layer at a time
FORWARD_TENSORS_PER_TOKEN_WIDTH = 4
PREFILL_BYTES_PER_TOKEN_LAYER_WIDTH = 2 * FORWARD_TENSORS_PER_TOKEN_WIDTH  # an engine's prefill, in bf16
_LOGPROB_BYTES_PER_ROW_VOCAB = 16  # a chunk's fp32 logits, log-softmax and (backward) their gradient


@dataclass(frozen=True)
class ActivationCoeffs:
    """Saved bytes per token per layer = h*hidden + i*intermediate + q*(heads*head_dim) + kv*(kv_heads*head_dim)
    + c; `checkpointed`: bytes per token per layer kept by a checkpointed block (its fp32 input)."""

    h: float
    i: float
    q: float
    kv: float
    c: float
    checkpointed: float

    def per_token_layer(self, m: ModelConfig) -> float:
        return (self.h * m.hidden_size + self.i * m.intermediate_size + self.q * m.num_heads * m.head_dim
                + self.kv * m.num_kv_heads * m.head_dim + self.c)


# bfloat16 (CUDA, bf16 autocast over fp32 masters, Inductor-compiled blocks): fitted to the trainer's warm-up peak
# on an H200 (benchmarks/bench_memory.py, 2026-11-23: Qwen3-0.6B 54.5 KB and 1.7B 91.3 KB per token and layer at
# 11264 tokens, after the LM-head chunk and final hidden states), and checked on the slope between 4000- and
# 10000-token packs (benchmarks/fit_activations.py, 2026-11-23, H200): 0.6B 53.0, 1.7B 82.8, 4B 130.8 KB per
# token and layer against 54.2 / 90.9 / 132.5 here. bfloat16-eager (the same without compile): those slopes were
# 88.7 / 141.6 / 213.8 KB, 1.63-1.71x the compiled ones, so 1.67x the compiled coefficients (within +7%).
# float32 (CPU): measured with torch.autograd.graph.saved_tensors_hooks on this model's eager forward (unique
# storages, parameters excluded, slope over two pack sizes).
_COMPILED_BF16 = ActivationCoeffs(h=20, i=5.3, q=6, kv=5, c=0, checkpointed=4)
ACTIVATION_COEFFS: dict[str, ActivationCoeffs] = {
    "bfloat16": _COMPILED_BF16,
    "bfloat16-eager": ActivationCoeffs(**{k: 1.67 * v for k, v in dataclasses.asdict(_COMPILED_BF16).items()
                                          if k != "checkpointed"}, checkpointed=4),
    "float32": ActivationCoeffs(h=28, i=16, q=20, kv=16, c=2400, checkpointed=4),
}


# a Gated DeltaNet layer's saved bytes per token beyond an attention layer's of the same widths, per channel of its
# conv (`conv_dim`: q, k and v of all heads): the plain-PyTorch chunked rule (what CUDA runs while fla is off) and
# batch-invariant mode's rule (its per-chunk fp32 products). Measured with saved_tensors_hooks on one bf16 eager
# layer, slope over 512- and 1024-token packs (CPU, 2026-12-07): qwen3_5-0.8b and
# the 2b-like shape (16 heads of 128, conv_dim 6144) both 209.5 KB and 684.5 KB a token above their attention
# layer's 99.1 / 147.1 KB; one linear shape measured, so per channel is an assumption for other head counts. An
# H100 RL step on the 0.8B in the mode ran out of memory with the plan counting attention layers only.
LINEAR_ATTENTION_BYTES_PER_TOKEN_CHANNEL = {False: 209.5 * 1024 / 6144, True: 684.5 * 1024 / 6144}


def linear_attention_bytes(m: ModelConfig, tokens: int, batch_invariant: bool, layers: int | None = None) -> int:
    """What `layers` (default: all) of a model's Gated DeltaNet layers save for backward over `tokens`, beyond the
    attention-layer model (`LINEAR_ATTENTION_BYTES_PER_TOKEN_CHANNEL`)."""
    if "linear_attention" not in m.layer_types:
        return 0
    n = sum(m.layer_type(i) == "linear_attention" for i in range(m.num_layers)) if layers is None else layers
    conv_dim = 2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim
    return int(n * tokens * conv_dim * LINEAR_ATTENTION_BYTES_PER_TOKEN_CHANNEL[batch_invariant])


def activation_shape(m: ModelConfig) -> ModelConfig:
    """`m` with the MLP width one token's activations have, averaged over layers, as its intermediate_size: a
    sparse layer's k routed experts (k * moe_intermediate_size, plus its k sorted copies of the input, counted as
    width), for the per-token activation coefficients, which were measured on dense models (not measured on MoE)."""
    if not m.is_moe:
        return m
    sparse = sum(map(m.sparse_layer, range(m.num_layers)))
    moe_width = m.num_experts_per_tok * (m.moe_intermediate_size + m.hidden_size)
    width = (sparse * moe_width + (m.num_layers - sparse) * m.intermediate_size) // m.num_layers
    return m.replace(intermediate_size=max(1, width))


def trainer_activation_bytes(m: ModelConfig, tokens: int, compute_dtype: str, checkpointing: bool,
                             logprob_chunk: int, weight_copy_params: int, residual_bytes: int = 4,
                             compiled: bool = True, batch_invariant: bool = False) -> int:
    """Peak transient bytes of one micro-batch's forward + backward of `tokens` packed tokens, gradients apart.
    residual_bytes: the residual stream's element size (fp32 over fp32 masters; a LoRA run's bf16 base: 2).
    weight_copy_params: parameters autocast casts to bf16 (the fp32 masters' projections; 0 for a bf16 base).
    Measured (benchmarks/fit_activations.py, H200): without checkpointing the peak is at the start of backward,
    every block's activations and the bf16 weight casts alive (the same intercept compiled or not); with it,
    each block keeps its input and the peak is at the end of backward, where eager autocast still holds the casts
    (compiled blocks do not) or the LM-head chunk is alive. A hybrid's Gated DeltaNet layers save more
    (`linear_attention_bytes`): all of them, or with checkpointing the one block recomputed at a time."""
    lm_head = _LOGPROB_BYTES_PER_ROW_VOCAB * min(logprob_chunk, tokens) * m.vocab_size
    hidden = 2 * 4 * m.hidden_size * tokens  # final hidden states (fp32) and their gradient
    casts = 2 * weight_copy_params if compute_dtype == "bfloat16" else 0
    if checkpointing:
        inputs = residual_bytes * m.hidden_size * tokens * m.num_layers + linear_attention_bytes(
            m, tokens, batch_invariant, layers=1)
        if compute_dtype != "bfloat16":  # fp32 (CPU): one block's activations exist at a time, twice
            co = ACTIVATION_COEFFS[compute_dtype]
            return int(inputs + 2 * co.per_token_layer(m) * tokens + lm_head + hidden)
        return int(inputs + max(lm_head, 0 if compiled else casts) + hidden)
    key = compute_dtype if compute_dtype != "bfloat16" or compiled else "bfloat16-eager"
    acts = ACTIVATION_COEFFS[key].per_token_layer(m) * tokens * m.num_layers
    acts += linear_attention_bytes(m, tokens, batch_invariant)
    return int(acts + lm_head + hidden + casts)


def prefill_bytes(m: ModelConfig, tokens: int, width: int, rows: int) -> int:
    """An engine's prefill transient over `tokens` (no gradients: one layer's tensors at a time, `width` its hidden
    plus MLP widths, a rank's share under TP), and the logits of its `rows` sequences' last tokens, the only ones the
    engine computes (`ModelRunner._prefill_forward`): fp32, with the sampler's softmax and sort beside them."""
    return PREFILL_BYTES_PER_TOKEN_LAYER_WIDTH * tokens * width + 3 * 4 * min(rows, tokens) * m.vocab_size
