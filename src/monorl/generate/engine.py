"""`Generator`: prompts (token ids) -> n sampled completions each, with per-token log-probs.

Runs the one `DecoderForCausalLM` through the generator's attention contexts: a paged KV cache, prefix
sharing across the n samples of a prompt, continuous batching over `max_num_seqs` decode slots, and
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

import torch
from torch import nn

from monorl.compile import CompileConfig, compile_generator
from monorl.distributed.weight_sync import share_frozen_, sync_weights_
from monorl.generate.attention import paged_decode_splits, triton_decode_supported
from monorl.generate.kv_cache import (
    BlockManager,
    KVCache,
    blocks_for,
    bytes_per_block,
    kv_cache_bytes_needed,
    slot_mapping,
    table_tensor,
)
from monorl.generate.runner import ModelRunner
from monorl.generate.sampling import SamplingParams, sample, sequence_key
from monorl.generate.scheduler import Group, Scheduler, Sequence
from monorl.generate.tensor_parallel import NO_TP, TensorParallel, build_tensor_parallel_model, shard_config
from monorl.model.batch_invariant import is_batch_invariant
from monorl.model.decoder import DecoderForCausalLM, build_model
from monorl.model.fused_kernels import use_fused_kernels_
from monorl.model.lora import LoRAConfig, apply_lora_
from monorl.model.tokenizer import eos_ids

_CPU_DEFAULT_KV_BYTES = 256 << 20


@dataclass
class GeneratorConfig:
    max_num_seqs: int = 64  # decode slots
    kv_cache_bytes: int | None = None  # KV budget; None: what max_num_seqs * max_model_len needs, capped by
    #                                    half the free GPU memory (256 MiB on CPU)
    block_size: int = 16  # tokens per KV-cache block
    max_model_len: int | None = None  # context length (prompt + completion); None: the model's max_position_embeddings
    stop_check_interval: int = 1  # decode steps between host-side stop checks (results do not depend on it)
    max_prefill_tokens: int = 8192  # tokens per packed prefill forward (a longer prompt runs alone)
    dtype: torch.dtype | None = None  # None: bf16 on CUDA, the model's dtype elsewhere
    # CUDA: each block's norms, RoPE and SiLU, and the sampler, in fused Triton kernels (monorl.model.fused_kernels,
    # monorl.ops.sample_kernels), so the decode step replayed from a CUDA graph is fast without torch.compile;
    # false: the model's and the sampler's PyTorch ops (a batch-invariant run's blocks run the kernels regardless:
    # its trainer runs them too, monorl.model.batch_invariant)
    fused_kernels: bool = True
    # tensor-parallel generation (vLLM's name): one copy split over N ranks of a node, its heads, MLP columns, KV
    # cache and vocabulary divided by N (monorl.generate.tensor_parallel), for a model whose bf16 copy does not fit
    # one GPU; N must divide the heads, kv heads, MLP width and vocabulary
    tensor_parallel_size: int = 1


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    # decoded with special tokens skipped (what TRL's reward functions and vLLM's default text hold), cut before a
    # stop string and without the stop token; None without a tokenizer. token_ids keep every token.
    text: str | None = None
    versions: list[int] | None = None  # per token: the policy version of the weights that sampled it


class Generator:
    # Without stops, queue a decode chunk before reading the one before it (`generate`); False reads each chunk's
    # tokens before the next is queued (a test compares the two)
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
                             "separate adapters (batch-invariant LoRA) is not tensor-parallel")
        self.tp = tp
        self.config, self.tokenizer = config, tokenizer
        cfg = model.config
        # what the KV cache and the attention kernels are shaped by: this rank's kv heads (all of them without TP)
        self.kv_config = shard_config(cfg, tp.size)
        p = next(model.parameters())
        device = p.device
        dtype = config.dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
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
        kernels = config.fused_kernels and self.decode_backend == "triton" and fused and lora is None
        if kernels:
            use_fused_kernels_(self.model)
        sampler = sample if config.fused_kernels else functools.partial(sample, kernels=False)
        self.sampler, self.use_graphs = compile_generator(self.model, sampler, compile or CompileConfig(), device,
                                                          self.decode_backend, fused_kernels=kernels)
        # the version of the weights this copy holds (the trainer's steps behind them), recorded per sampled token;
        # whoever loads new weights sets it
        self.policy_version = 0
        self.kv: KVCache | None = None
        if allocate_kv:
            self.allocate_kv_cache()

    def kv_bytes_needed(self) -> int:
        """What `max_num_seqs` sequences of `max_model_len` tokens need."""
        c = self.config
        return kv_cache_bytes_needed(self.kv_config, c.max_num_seqs, self.max_model_len, c.block_size, self.dtype)

    def allocate_kv_cache(self, budget: int | None = None) -> None:
        """Allocate the KV cache and the model runner. budget: bytes (None: `config.kv_cache_bytes`, else what
        `kv_bytes_needed` says, capped by half the free GPU memory, or 256 MiB on CPU)."""
        if self.kv is not None:
            raise RuntimeError("the generator's KV cache is already allocated")
        config, bs = self.config, self.config.block_size
        per_block, need = bytes_per_block(self.kv_config, bs, self.dtype), self.kv_bytes_needed()
        if budget is None and config.kv_cache_bytes is not None:
            budget = config.kv_cache_bytes
        elif budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = min(need, free // 2)
        elif budget is None:
            budget = min(need, _CPU_DEFAULT_KV_BYTES)
        num_blocks = self.tp.min_int(budget // per_block)  # a TP group's ranks schedule alike: the same blocks
        if num_blocks < 2:
            raise ValueError(f"kv_cache_bytes={budget} holds {num_blocks} blocks of {per_block} bytes; need >= 2")
        self.kv = KVCache(self.kv_config, num_blocks, bs, self.device, self.dtype)
        self.blocks = BlockManager(num_blocks)
        self.runner = self._runner(self.kv, self.use_graphs)

    def release_graphs(self) -> None:
        """Drop the captured graphs (`ModelRunner.release_graphs`): a multi-rank run does it before its process
        groups go."""
        if getattr(self, "runner", None) is not None:
            self.runner.release_graphs()

    def _runner(self, kv: KVCache, cuda_graphs: bool) -> ModelRunner:
        c = self.config
        return ModelRunner(self.model, kv, c.max_num_seqs, blocks_for(self.max_model_len, c.block_size),
                           ring_size=max(256, c.stop_check_interval), decode_backend=self.decode_backend,
                           cuda_graphs=cuda_graphs, sample_fn=self.sampler, tp=self.tp)

    def capture_decode_graphs(self, sampling: SamplingParams) -> None:
        """Capture every decode batch bucket's CUDA graph for this sampler configuration now, as a serving engine
        does at start-up; without it a bucket is captured when a decode step first needs it (the RL loop uses a
        few of them). No-op without graphs."""
        if self.kv is None:
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
        kv = KVCache(self.kv_config, 1 + sum(blocks_for(L, bs) for L in lengths), bs, self.device, self.dtype)
        runner = self._runner(kv, cuda_graphs=False)
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
    def _validate(self, prompts: list[list[int]], params: list[SamplingParams], n: int, sched: Scheduler) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        if len({sp.sampler_key() for sp in params}) > 1:
            raise ValueError("per-prompt SamplingParams may differ in lengths, stops and seeds, "
                             "not in temperature / top_p / top_k")
        if any(sp.stop_strings for sp in params) and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer (Generator(..., tokenizer=...))")
        V = self.model.config.vocab_size
        for i, (p, sampling) in enumerate(zip(prompts, params, strict=True)):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= V:
                raise ValueError(f"prompt {i} has token ids outside [0, {V})")
            total = len(p) + sampling.max_new_tokens
            if total > self.max_model_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens {sampling.max_new_tokens} = {total} "
                                 f"exceeds max_model_len {self.max_model_len}")
            need = sched.blocks_needed(len(p), sampling.max_new_tokens)
            if need > self.blocks.usable_blocks:
                raise ValueError(
                    f"prompt {i}: {len(p)} tokens + max_new_tokens {sampling.max_new_tokens} needs {need} KV blocks "
                    f"of {self.kv.block_size} tokens, but the KV cache has {self.blocks.usable_blocks} "
                    f"(raise GeneratorConfig.kv_cache_bytes or lower max_new_tokens)")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                 n: int = 1, first_prompt_index: int = 0,
                 between_chunks: Callable[[], None] | None = None) -> list[list[Completion]]:
        """For each prompt, n completions (results[prompt][sample]). `sampling` is one SamplingParams for
        all prompts, or one per prompt (those may differ in lengths, stops and seed, not in the sampler).
        first_prompt_index: the index of prompts[0] in the sampling keys (`sequence_key`): a rank generating
        prompts [k, m) of a batch passes k, so each prompt draws the noise it would draw in the whole batch.
        between_chunks: called after each decode chunk is queued, while sequences are in flight; it may load new
        weights in place (and set `policy_version`): the sequences go on with them and keep their KV cache (an
        in-flight weight update), each token recording the version that sampled it (`Completion.versions`)."""
        cfg = self.config
        if self.kv is None:
            self.allocate_kv_cache()
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        sched = Scheduler(self.blocks, self.kv.block_size, cfg.max_num_seqs, cfg.max_prefill_tokens)
        self._validate(prompts, params, n, sched)
        if not prompts:
            return []
        sampling = params[0]  # the sampler configuration (shared by all prompts)
        default_seed = self.tp.broadcast_int(int(torch.randint(0, 2**31 - 1, ()).item()))
        stops_possible = False
        results: list[list[Sequence]] = []
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            stop_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else frozenset(self.eos_token_ids))
            stops_possible |= bool(stop_ids or sp.stop_strings)
            g = Group(prompt=list(p), sampling=sp, pending=n, stop_ids=stop_ids)
            seed = sp.seed if sp.seed is not None else default_seed
            seqs = [Sequence(group=g, sample_index=j, key=sequence_key(seed, first_prompt_index + i, j))
                    for j in range(n)]
            results.append(seqs)
            for s in seqs:
                sched.add(s)
        runner = self.runner
        runner.slot_owner = self  # an EpisodeEngine sharing this runner restores its slots before its next step
        if runner.use_graphs and runner.graph_key != sampling.sampler_key():
            runner.select_graphs(sampling)  # nothing is live yet (see ModelRunner.select_graphs)
        runner.reset_slots(0)
        # Without stop tokens or strings a sequence finishes after max_new_tokens, which the host knows without its
        # tokens: the next steps are queued before the last ones' tokens are read (`ModelRunner.copy_ring`), and the
        # host appends those while the GPU runs on (with a read and its bookkeeping between every two launches of
        # steps, the GPU idled ~0.1-0.2 s of a 5.7 s throughput run, H200). `produced`: tokens a sequence has had
        # sampled, read or not.
        defer = self.defer_ring_reads and not stops_possible
        produced: dict[int, int] = {}
        unread: Callable[[], None] | None = None
        try:
            while sched.waiting or sched.running:
                self._admit(sched, sampling)
                if not sched.running:
                    continue
                left = min(s.group.sampling.max_new_tokens - produced.get(id(s), len(s.tokens))
                           for s in sched.running)
                steps = min(left, runner.ring_size)
                if stops_possible:
                    steps = min(steps, cfg.stop_check_interval)
                live = len(sched.running)
                width = max(len(s.table) for s in sched.running)
                for _ in range(steps):
                    runner.decode(live, width, sampling)
                if not defer:
                    toks, lps = runner.read_ring(steps, live)
                    for seq, seq_toks, seq_lps in zip(sched.running, toks, lps, strict=True):
                        self._extend(seq, seq_toks, seq_lps, self.policy_version)
                    self._reap(sched)
                    if between_chunks is not None and (sched.running or sched.waiting):
                        with torch.inference_mode(False):  # it may train (a colocated trainer step)
                            between_chunks()
                    continue
                read = self._deferred_read(runner.copy_ring(steps, live), list(sched.running), self.policy_version)
                for seq in sched.running:
                    produced[id(seq)] = n = produced.get(id(seq), len(seq.tokens)) + steps
                    if n >= seq.group.sampling.max_new_tokens:
                        seq.finish_reason = "length"
                self._reap(sched)  # queued behind the copy: the slots move after their tokens are copied
                if unread is not None:
                    unread()  # the steps before these: their copy is done, these steps run meanwhile
                unread = read
                if between_chunks is not None and (sched.running or sched.waiting):
                    with torch.inference_mode(False):  # queued behind the chunk; the next one runs on what it loads
                        between_chunks()
            if unread is not None:
                unread()
        finally:
            # An exception mid-generation must not leak blocks into the next call.
            for s in sched.running:
                if s.finish_reason is None:
                    sched.finish(s, "abort")
            for seqs in results:
                g = seqs[0].group
                if g.blocks:
                    g.pending = 0
                    sched.release_group_if_done(g)
        return [[self._completion(s) for s in seqs] for seqs in results]

    def _admit(self, sched: Scheduler, sampling: SamplingParams) -> None:
        # Prefill first: keep admitting (one packed prefill per round) while slots and blocks last.
        while self._admit_round(sched, sampling):
            pass
        if not sched.running and sched.waiting:
            raise RuntimeError("scheduler could not admit any sequence (KV cache accounting bug)")

    def _admit_round(self, sched: Scheduler, sampling: SamplingParams) -> bool:
        groups, seqs, copies = sched.admit()
        if not seqs:
            return False
        runner = self.runner
        if groups:
            bs = self.kv.block_size
            slots = [slot_mapping(g.blocks, 0, len(g.prompt), bs) for g in groups]
            logits = runner.prefill([g.prompt for g in groups], slots)
            for g, row in zip(groups, logits, strict=True):
                g.last_logits, g.logits_version = row, self.policy_version
        self.kv.copy_blocks([c[0] for c in copies], [c[1] for c in copies])
        # At least 2 rows (the one row repeated): Dynamo specialises a size-1 dimension, so one row would
        # compile the sampler a second time. Rows are sampled independently; the extra one is dropped.
        pad = [seqs[0]] if len(seqs) == 1 else []
        rows = torch.stack([s.group.last_logits for s in seqs + pad])
        keys = torch.tensor([s.key for s in seqs + pad], dtype=torch.int64, device=self.device)
        positions = torch.tensor([s.prompt_len for s in seqs + pad], dtype=torch.int64, device=self.device)
        first, first_lp = runner.sample_fn(rows, keys, positions, sampling, self.model.token_logprobs)
        first, first_lp = first[:len(seqs)], first_lp[:len(seqs)]
        for s in seqs:
            sched.release_group_if_done(s.group)
        first_host, lp_host = first.tolist(), first_lp.tolist()
        keep = []
        for i, s in enumerate(seqs):
            self._append(s, first_host[i], lp_host[i], s.group.logits_version)
            if s.finish_reason is None:
                keep.append(i)
            else:
                sched.finish(s, s.finish_reason)
        if not keep:
            return True
        start = len(sched.running)
        new = [seqs[i] for i in keep]
        sched.running.extend(new)
        idx = torch.tensor(keep, device=self.device)
        runner.set_slots(list(range(start, start + len(new))), first[idx], [s.prompt_len for s in new],
                         [s.key for s in new], table_tensor([s.table for s in new], runner.width, self.device))
        return True

    def _deferred_read(self, wait: Callable[[], tuple[list[list[int]], list[list[float]]]],
                       seqs: list[Sequence], version: int) -> Callable[[], None]:
        """What appends a deferred ring read's tokens to the sequences that were live for it, in slot order
        (`version`: the weights' when the steps were queued)."""
        def append() -> None:
            toks, lps = wait()
            for seq, seq_toks, seq_lps in zip(seqs, toks, lps, strict=True):
                self._extend(seq, seq_toks, seq_lps, version)
        return append

    def _extend(self, seq: Sequence, toks: list[int], lps: list[float], version: int) -> None:
        """`_append` each of a sequence's new tokens until it finishes; without stop tokens or strings, by whole
        lists (the reference workload appended ~4,000 tokens a step one by one, with the GPU idle)."""
        sampling = seq.group.sampling
        if seq.group.stop_ids or sampling.stop_strings:
            for tok, lp in zip(toks, lps, strict=True):
                self._append(seq, tok, lp, version)
                if seq.finish_reason is not None:
                    return
            return
        n = min(len(toks), sampling.max_new_tokens - len(seq.tokens))
        seq.tokens += toks[:n]
        seq.logprobs += lps[:n]
        seq.versions += [version] * n
        if len(seq.tokens) >= sampling.max_new_tokens:
            seq.finish_reason = "length"

    def _append(self, seq: Sequence, tok: int, lp: float, version: int) -> None:
        sampling = seq.group.sampling
        seq.tokens.append(tok)
        seq.logprobs.append(lp)
        seq.versions.append(version)
        if tok in seq.group.stop_ids:
            seq.finish_reason = "stop"
        elif sampling.stop_strings and self._hit_stop_string(seq, sampling.stop_strings):
            seq.finish_reason = "stop"
        elif len(seq.tokens) >= sampling.max_new_tokens:
            seq.finish_reason = "length"

    def _hit_stop_string(self, seq: Sequence, stops: tuple[str, ...]) -> bool:
        return stop_string_hit(self.tokenizer, seq.tokens, stops) is not None

    def _reap(self, sched: Scheduler) -> None:
        done = [s for s in sched.running if s.finish_reason is not None]
        if not done:
            return
        for s in done:
            sched.finish(s, s.finish_reason)
        src, dst = sched.compact()
        self.runner.move_slots(src, dst)
        self.runner.reset_slots(len(sched.running))

    def _completion(self, seq: Sequence) -> Completion:
        return make_completion(self.tokenizer, seq.tokens, seq.logprobs, seq.versions, seq.finish_reason or "length",
                               seq.group.stop_ids, seq.group.sampling.stop_strings)


def make_completion(tokenizer, tokens: list[int], logprobs: list[float], versions: list[int], finish_reason: str,
                    stop_ids: frozenset[int], stop_strings: tuple[str, ...]) -> Completion:
    """A finished sample as the caller gets it: its tokens as sampled, and (with a tokenizer) its text."""
    text = None
    if tokenizer is not None:
        ids = tokens
        if finish_reason == "stop" and ids and ids[-1] in stop_ids:
            ids = ids[:-1]  # the stop token stays in token_ids (the policy must learn to emit it), not in text
        # stop strings are matched on the raw text as generated (`_hit_stop_string`), cut here in the text
        # without special tokens
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if stop_strings:
            cut = [text.find(s) for s in stop_strings if s in text]
            if cut:
                text = text[:min(cut)]
    return Completion(token_ids=list(tokens), logprobs=list(logprobs), finish_reason=finish_reason, text=text,
                      versions=list(versions))


def stop_string_hit(tokenizer, tokens: list[int], stops: tuple[str, ...]) -> str | None:
    """The first of `stops` found in the decoded tail of `tokens`, or None. Decodes only a tail window: a stop string
    of c characters spans at most ~c tokens."""
    window = max(len(s) for s in stops) + 8
    tail = tokenizer.decode(tokens[-window:], skip_special_tokens=False)
    return next((s for s in stops if s in tail), None)
