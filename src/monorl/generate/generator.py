"""`Generator`: the generator's own copy of the policy, its cache (`monorl.generate.cache`) and model runner, and
`generate`: prompts (token ids) -> n sampled completions each, with per-token log-probs.

Runs the one `DecoderForCausalLM` through the generator's attention contexts: a paged KV cache, prefix
sharing across the n samples of a prompt, continuous batching over `max_num_seqs` decode slots (the request
engine, `monorl.generate.engine`; `generate` is a thin function over it, `monorl.generate.batch`), and
(on CUDA) a decode step replayed from a CUDA graph per batch-size bucket, with sampling and the
log-prob inside the graph.

Log-probs: each returned log-prob is `monorl.model.logprobs.token_logprobs` -- the trainer's function
-- of the sampled token under the temperature-scaled distribution `log_softmax(logits / T)`, before
top-k / top-p truncation; for greedy decoding (temperature 0) T = 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from monorl.compile import CompileConfig, compile_generator
from monorl.distributed.weight_sync import share_frozen_, sync_weights_
from monorl.generate.attention import paged_decode_splits, triton_decode_supported
from monorl.generate.batch import generate_batch
from monorl.generate.cache import (
    Cache,
    blocks_for,
    blocks_in_budget,
    bytes_per_block,
    bytes_per_sequence,
    kv_cache_bytes_needed,
    sequence_rows,
    slot_mapping,
)
from monorl.generate.requests import Completion
from monorl.generate.runner import ModelRunner
from monorl.generate.sampling import SamplingParams, sample
from monorl.generate.tensor_parallel import NO_TP, TensorParallel, build_tensor_parallel_model, shard_config
from monorl.model.batch_invariant import is_batch_invariant
from monorl.model.decoder import DecoderForCausalLM, build_model
from monorl.model.fused_kernels import fused_kernels_supported, use_fused_kernels_, use_fused_norms_
from monorl.model.image_processing import ImageProcessor
from monorl.model.lora import LoRAConfig, apply_lora_
from monorl.model.tokenizer import eos_ids
from monorl.model.vision_prompt import ImageInputs

_CPU_DEFAULT_KV_BYTES = 256 << 20


def generator_dtype(name: str | None, device: torch.device | str) -> torch.dtype:
    """The generator copy's dtype (`GeneratorConfig.dtype`), decided here for the generator, the run's parts and the
    memory plan: the named one, else bf16 on CUDA and fp32 elsewhere."""
    if name:
        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@dataclass
class GeneratorConfig:
    max_num_seqs: int = 64  # decode slots
    kv_cache_bytes: int | None = None  # KV budget; None: what max_num_seqs * max_model_len needs, capped by
    #                                    half the free GPU memory (on CPU: 256 MiB of blocks beside the
    #                                    per-sequence rows, e.g. window rings)
    block_size: int = 16  # tokens per KV-cache block
    max_model_len: int | None = None  # context length (prompt + completion); None: the model's max_position_embeddings
    stop_check_interval: int = 1  # decode steps between host-side stop checks (results do not depend on it)
    max_prefill_tokens: int = 8192  # tokens per packed prefill forward (a longer prompt runs alone)
    # the copy's weights, activations and KV cache (`generator_dtype`): None is bf16 on CUDA and fp32 elsewhere;
    # float32 on CUDA samples from the model as an fp32 trainer computes it (TRL's generation from its fp32 model
    # under autocast keeps an fp32 residual stream), at twice the weight and KV bytes a decode step reads
    dtype: Literal["bfloat16", "float32"] | None = None
    # CUDA: each block's norms, RoPE and SiLU, and the sampler, in fused Triton kernels (monorl.model.fused_kernels,
    # monorl.ops.sample_kernels), so the decode step replayed from a CUDA graph is fast without torch.compile;
    # false: the model's and the sampler's PyTorch ops (a batch-invariant run's blocks run the kernels regardless:
    # its trainer runs them too, monorl.model.batch_invariant)
    fused_kernels: bool = True
    # tensor-parallel generation (vLLM's name): one copy split over N ranks of a node, its heads, MLP columns, KV
    # cache and vocabulary divided by N (monorl.generate.tensor_parallel), for a model whose bf16 copy does not fit
    # one GPU; N must divide the heads, kv heads, MLP width and vocabulary
    tensor_parallel_size: int = 1
    # a LoRA policy's generator: true merges the adapters into a copy of the base at every sync (the fastest
    # decode; two copies of the base); false keeps them separate matmuls over the policy's own frozen base tensors
    # (one copy: what a large model's LoRA run needs to fit one GPU; decode pays the adapters' small matmuls). A
    # batch-invariant run keeps them separate regardless (its bitwise guarantee is for that form)
    merge_lora: bool = True


class Generator:
    # Without stops, queue a decode chunk before reading the one before it (`Engine(defer_reads=)`); False reads each
    # chunk's tokens before the next is queued (a test compares the two)
    defer_ring_reads = True

    def __init__(self, model: DecoderForCausalLM, config: GeneratorConfig | None = None, tokenizer=None,
                 eos_token_ids: tuple[int, ...] | list[int] | None = None, compile: CompileConfig | None = None,
                 fused: bool = True, allocate_kv: bool = True, lora: LoRAConfig | None = None,
                 tp: TensorParallel = NO_TP) -> None:
        """Builds the generator's own copy of `model` (on its device, in `config.dtype`), which `load_weights_`
        refreshes in place. eos_token_ids: None takes them from the tokenizer, else the model config
        (`monorl.model.tokenizer.eos_ids`). compile: the run's compile policy (default: eager, decode CUDA graphs on
        CUDA). fused: one q/k/v and one gate/up GEMM per layer (a batch-invariant copy too: its invariant GEMM
        computes each output column as the trainer's unfused one does). allocate_kv=False defers the KV cache to
        `allocate_kv_cache` (the RL loop sizes it once training's memory is measured). lora: give the copy the
        policy's LoRA adapters, run as separate matmuls (batch-invariant runs); without, a LoRA policy's adapters
        are merged into the copy's weights at every sync. tp: this rank's tensor-parallel group
        (`tensor_parallel.tensor_parallel_group`, of `config.tensor_parallel_size` ranks): the copy is this rank's
        shard, and every rank of the group must make the same calls with the same arguments."""
        config = config or GeneratorConfig()
        if config.max_num_seqs < 1 or config.stop_check_interval < 1 or config.block_size < 1:
            raise ValueError(f"invalid GeneratorConfig: {config}")
        if config.tensor_parallel_size != tp.size:
            raise ValueError(f"generator.tensor_parallel_size={config.tensor_parallel_size} needs a tensor-parallel "
                             f"group of that many ranks (tensor_parallel_group), got one of {tp.size}")
        if tp.size > 1 and lora is not None:
            raise ValueError("generator.tensor_parallel_size > 1 merges LoRA adapters into its copy: a copy with "
                             "separate adapters (batch-invariant LoRA, or generator.merge_lora false) is not "
                             "tensor-parallel")
        self.tp = tp
        self.config, self.tokenizer = config, tokenizer
        cfg = model.config
        # what the KV cache and the attention kernels are shaped by: this rank's kv heads (all of them without TP)
        self.kv_config = shard_config(cfg, tp.size)
        p = next(model.parameters())
        device = p.device
        dtype = generator_dtype(config.dtype, device)
        if tp.size > 1:  # this rank's shard (weight sync cuts its pieces: `TensorParallelPlacement`)
            self.model = build_tensor_parallel_model(cfg, tp, device, dtype, fused=fused)
        else:
            self.model = build_model(cfg, device=device, dtype=dtype, seed=None, fused=fused and lora is None)
        if lora is not None:
            apply_lora_(self.model, lora)  # adapters are overwritten by load_weights_
            self.model.to(dtype)
            # the frozen base, when held in this dtype (a LoRA run's), is the policy's own tensors: no second copy
            share_frozen_(self.model, model)
        self.model.requires_grad_(False).eval()
        self.load_weights_(model)  # before any graph capture: later syncs write the same memory
        self.device, self.dtype = device, dtype
        self.eos_token_ids = eos_ids(tokenizer, cfg) if eos_token_ids is None else tuple(int(t) for t in eos_token_ids)
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.decode_backend = "triton" if triton_decode_supported(device, dtype, cfg.head_dim) else "torch"
        kernels = (config.fused_kernels and self.decode_backend == "triton" and fused and lora is None
                   and fused_kernels_supported(self.model))  # (not a family with its own decoder layer)
        if kernels:
            use_fused_kernels_(self.model)
        elif config.fused_kernels and self.decode_backend == "triton":  # a family with its own decoder layers
            use_fused_norms_(self.model)
        sampler = sample if config.fused_kernels else functools.partial(sample, kernels=False)
        self.sampler, self.use_graphs = compile_generator(self.model, sampler, compile or CompileConfig(), device,
                                                          self.decode_backend, fused_kernels=kernels)
        # the version of the weights this copy holds (the trainer's steps behind them), recorded per sampled token;
        # whoever loads new weights sets it
        self.policy_version = 0
        # a vision-language policy's (`ImageProcessor.for_model` with the checkpoint's preprocessor_config.json, set
        # by the run); None: the tower's patch sizes with Qwen3-VL's defaults
        self.image_processor: ImageProcessor | None = None
        # batch-invariant (a converted policy; its copy is converted too): the cache's rows are the mode's
        self.batch_invariant = is_batch_invariant(model)
        self.cache: Cache | None = None
        if allocate_kv:
            self.allocate_kv_cache()

    def kv_bytes_needed(self) -> int:
        """What `max_num_seqs` sequences of `max_model_len` tokens need."""
        c = self.config
        return kv_cache_bytes_needed(self.kv_config, c.max_num_seqs, self.max_model_len, c.block_size, self.dtype,
                                     batch_invariant=self._invariant_cache())

    def _invariant_cache(self) -> bool:
        return self.batch_invariant or is_batch_invariant(self.model)

    def allocate_kv_cache(self, budget: int | None = None) -> None:
        """Allocate the KV cache and the model runner. budget: bytes (None: `config.kv_cache_bytes`, else what
        `kv_bytes_needed` says, capped by half the free GPU memory, or on CPU by 256 MiB of blocks beside the
        per-sequence rows every cache allocates: a window model's rings alone can pass 256 MiB)."""
        if self.cache is not None:
            raise RuntimeError("the generator's KV cache is already allocated")
        config, bs = self.config, self.config.block_size
        per_block, need = bytes_per_block(self.kv_config, bs, self.dtype), self.kv_bytes_needed()
        if budget is None and config.kv_cache_bytes is not None:
            budget = config.kv_cache_bytes
        elif budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = min(need, free // 2)
        elif budget is None:
            rows = sequence_rows(config.max_num_seqs) * bytes_per_sequence(self.kv_config, self.dtype,
                                                                           self._invariant_cache(), bs)
            budget = min(need, rows + _CPU_DEFAULT_KV_BYTES)
        # a TP group's ranks schedule alike: the same blocks
        num_blocks = self.tp.min_int(blocks_in_budget(self.kv_config, budget, config.max_num_seqs, bs, self.dtype,
                                                      self._invariant_cache()))
        if num_blocks < 2:
            raise ValueError(f"kv_cache_bytes={budget} holds {num_blocks} blocks of {per_block} bytes; need >= 2")
        self.cache = Cache(self.kv_config, num_blocks, bs, self.device, self.dtype, config.max_num_seqs,
                           batch_invariant=self._invariant_cache())
        self.runner = self._runner(self.cache, self.use_graphs)

    def release_graphs(self) -> None:
        """Drop the captured graphs (`ModelRunner.release_graphs`): a multi-rank run does it before its process
        groups go."""
        if getattr(self, "runner", None) is not None:
            self.runner.release_graphs()

    def _runner(self, cache: Cache, cuda_graphs: bool) -> ModelRunner:
        c = self.config
        return ModelRunner(self.model, cache, c.max_num_seqs, blocks_for(self.max_model_len, c.block_size),
                           ring_size=max(256, c.stop_check_interval), decode_backend=self.decode_backend,
                           cuda_graphs=cuda_graphs, sample_fn=self.sampler, tp=self.tp)

    def capture_decode_graphs(self, sampling: SamplingParams) -> None:
        """Capture every decode batch bucket's CUDA graph for this sampler configuration now, as a serving engine
        does at start-up; without it a bucket is captured when a decode step first needs it (the RL loop uses a
        few of them). No-op without graphs."""
        if self.cache is None:
            self.allocate_kv_cache()
        if self.runner.use_graphs:
            self.runner.capture_buckets(sampling)

    @torch.inference_mode()
    def trace_kernels(self, prompts: list[list[int]], samplers: list[SamplingParams], n: int) -> None:
        """Launch what `generate(prompts, sp, n)` launches for each sampler -- the prefill, the first tokens'
        sampler, decode steps -- on a scratch KV cache and runner shaped as the real ones
        (block size, table width, buckets), without graphs, for `monorl.speedups.precompile.recording()` to see the
        Triton kernels (their outputs are garbage there, and dropped; the decode state is reset after each step)."""
        bs = self.config.block_size
        lengths = [len(p) for p in prompts]
        scratch = Cache(self.kv_config, 1 + sum(blocks_for(L, bs) for L in lengths), bs, self.device, self.dtype,
                        self.config.max_num_seqs, batch_invariant=self._invariant_cache())
        runner = self._runner(scratch, cuda_graphs=False)
        slots, block = [], 1  # block 0 is the scratch block
        for L in lengths:
            slots.append(slot_mapping(list(range(block, block + blocks_for(L, bs))), 0, L, bs))
            block += blocks_for(L, bs)
        rows = runner.prefill(prompts, slots).repeat_interleave(n, dim=0)
        keys = torch.zeros(rows.shape[0], dtype=torch.int64, device=self.device)
        positions = torch.tensor([L for L in lengths for _ in range(n)], dtype=torch.int64, device=self.device)
        for sp in samplers:
            runner.sample_fn(rows, keys, positions, sp, self.model.token_logprobs)
            for B in self._trace_buckets(runner):
                runner._decode_step(B, runner.width, sp)
                runner.reset_slots(0)  # the step wrote its (garbage) tokens into the decode state

    def _trace_buckets(self, runner: ModelRunner) -> list[int]:
        """Decode batch buckets whose launches cover every bucket's kernels: the smallest and the largest (no kernel
        takes the batch size as an argument Triton would specialise on, 1 / multiples of 16, today; these two would
        cover both classes if one did), and one per key-split count of the ordinary paged decode (a constexpr; a
        batch-invariant copy's decode never splits)."""
        buckets = {runner.buckets[0], runner.buckets[-1]}
        if self.decode_backend == "triton" and not is_batch_invariant(self.model):
            per_split: dict[int, int] = {}
            for B in runner.buckets:
                per_split.setdefault(paged_decode_splits(B, self.kv_config.num_kv_heads, self.device), B)
            buckets |= set(per_split.values())
        return sorted(buckets)

    # ---- weights -----------------------------------------------------------------------------------
    def load_weights_(self, src: nn.Module) -> None:
        """Copy src's parameters (HF names, e.g. the trainer's fp32 masters) into the generator's copy, in
        place: captured CUDA graphs stay valid (`monorl.distributed.weight_sync`)."""
        sync_weights_(self.model, src)

    # ---- generate ----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams], n: int = 1,
                 first_prompt_index: int = 0,
                 between_chunks: Callable[[], None] | None = None,
                 images: list[ImageInputs | None] | None = None) -> list[list[Completion]]:
        """For each prompt, n completions (results[prompt][sample]): `monorl.generate.batch.generate_batch`."""
        return generate_batch(self, prompts, sampling, n, first_prompt_index, between_chunks, images)
