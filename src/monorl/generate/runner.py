"""The model runner: static per-slot device state, the prefill forward, and the decode step (eager or
replayed from a CUDA graph captured per batch-size bucket).

Decode state lives on the device in fixed buffers indexed by slot (live sequences occupy slots
0..live-1): the last token, its position, the sampling key and the block table. One decode step reads
them, runs the model, samples, writes the new token / log-prob into a ring buffer row (a device
counter picks the row) and advances token and position -- all on the device, so consecutive steps
need no host involvement and the host reads the ring only when it checks for stops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from monorl.compile import capture_cuda_graph, clone_tensors, copy_into, is_compiled
from monorl.generate.attention import CachedPrefillContext, DecodeContext, PrefillContext
from monorl.generate.cache import Cache
from monorl.generate.sampling import SamplingParams, sample
from monorl.generate.tensor_parallel import NO_TP, TensorParallel, gather_vocab
from monorl.model.attention import VarlenContext, resolve_backend
from monorl.model.decoder import DecoderForCausalLM
from monorl.model.pack_layout import bucket_size, filler_lengths, static_max_seqlen
from monorl.model.qwen3_vl import image_embeds, pack_positions, placeholder_spans, window_images, window_inputs
from monorl.model.rope import model_rope
from monorl.model.vision_prompt import ImageInputs
from monorl.ops.decode_state import commit_step, step_inputs

PREFILL_GRAPHS = 16  # prefill shapes (prompts' and turn boundaries') kept as CUDA graphs; later ones run eagerly
# A prefill shape is captured at its third eager run: the RL loop's warm-up and its validations before and after
# repeat their prompts twice, and a capture costs about two eager runs.
PREFILL_CAPTURE_AT = 3
TURN_PREFILLS = ("auto", "paged", "varlen", "decode")  # how `prefill_cached` attends (its docstring)


def rope_positions(ctx: CachedPrefillContext, chunks: list[list[int]], offsets: list[int] | None) -> Tensor:
    """The RoPE positions of a turn boundary's new tokens: their positions in `ctx`, each less its sequence's
    offset (fillers none)."""
    if not offsets or not any(offsets):
        return ctx.positions
    per_token = [o for c, o in zip(chunks, offsets, strict=True) for _ in c]
    shift = torch.tensor(per_token + [0] * (ctx.positions.numel() - len(per_token)), dtype=torch.int64)
    return ctx.positions - shift.to(ctx.positions.device)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes on CUDA (graph and eager). The smallest is 2, even for max_num_seqs 1: Dynamo
    specialises a dimension of size 1, so a bucket of 1 would compile every block and the sampler once more.
    A single live sequence runs in the bucket of 2; its padded row writes to the scratch block (see
    `monorl.compile`'s notes on size-1 dimensions)."""
    top = max(2, max_num_seqs)
    small = [b for b in (2, 4, 8, 16, 24, 32) if b < top]
    return small + list(range(48, top, 16)) + [top]


def static_prefill_pack(prompts: list[list[int]],
                        slots: list[list[int]]) -> tuple[list[int], list[int], list[int], int]:
    """Prompts (and their KV slots) laid out as a static pack, as the trainer's (`packing.pack(static=True)`): the
    token count rounded up to a bucket with filler sequences of token 0 whose KV goes to slot 0 (the scratch
    block's), the sequence count to a power of two (>= 8) with zero-length entries, max_seqlen to a power of two.
    Returns (token ids, slots, sequence lengths, max_seqlen); the prompts come first, in order."""
    lengths = [len(p) for p in prompts]
    real = sum(lengths)
    size = bucket_size(real, 64)
    max_seqlen = static_max_seqlen(lengths, size)
    ids = [t for p in prompts for t in p] + [0] * (size - real)
    flat = [s for ss in slots for s in ss] + [0] * (size - real)
    return ids, flat, filler_lengths(lengths, size, max_seqlen, static=True), max_seqlen


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, cache: Cache, max_num_seqs: int, max_blocks_per_seq: int,
                 ring_size: int, decode_backend: str, cuda_graphs: bool, sample_fn: Callable = sample,
                 tp: TensorParallel = NO_TP) -> None:
        """sample_fn: `sampling.sample`, or its compiled form (`monorl.compile.compile_generator` decides). tp: the
        model is this rank's tensor-parallel shard; its vocabulary shards' logits are gathered whole on every rank."""
        self.model, self.cache, self.tp = model, cache, tp
        self.cfg = model.config
        self.device = cache.device
        self.block_size = cache.block_size
        self.max_num_seqs, self.width = max_num_seqs, max_blocks_per_seq
        self.decode_backend = decode_backend
        self.prefill_backend = resolve_backend("auto", self.device, cache.dtype)
        self.ring_size = ring_size
        self.buckets = graph_buckets(max_num_seqs)
        dev, S = self.device, self.buckets[-1]  # slot state rows: the largest bucket (>= max_num_seqs)
        self.tok = torch.zeros(S, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(S, dtype=torch.int64, device=dev)
        # each row's token index minus its RoPE position (a prompt with images: M-RoPE positions run shorter)
        self.pos_offset = torch.zeros(S, dtype=torch.int64, device=dev)
        self.keys = torch.zeros(S, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(S, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.ring_tok = torch.zeros(ring_size + 1, S, dtype=torch.int64, device=dev)  # +1: overflow row
        self.ring_lp = torch.zeros(ring_size + 1, S, dtype=torch.float32, device=dev)
        self.ring_idx = torch.zeros(1, dtype=torch.int64, device=dev)
        # on CUDA, RoPE's cos / sin of every position a sequence can reach, for the decode step to gather
        # (`monorl.ops.decode_state`): computed here by the op the model runs, so the values are the op's
        self.rope_tables = None
        cfg = model.config
        if dev.type == "cuda" and len({cfg.rope_kind(i) for i in range(cfg.num_layers)}) == 1:
            # (a model whose layer kinds rotate differently, Gemma 3's, computes its tables per step instead)
            dtype = model.model.embed_tokens.weight.dtype
            self.rope_tables = model_rope(cfg, torch.arange(max_blocks_per_seq * self.block_size, device=dev), dtype)
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        # one set of graphs per sampler configuration (e.g. greedy validation and sampled rollouts), kept
        # so that alternating between them does not re-capture. A bucket's graph is captured when a decode step
        # first needs it (a run uses a few of the buckets: the reference preset's 2 of 16); a compiled model's are
        # all captured up front, so that its compiles stay in the warm-up. Rank-local without tensor parallelism: a
        # decode step has no collective (ranks of one run may capture different buckets at different steps); a TP
        # group's ranks schedule alike, so they capture the same buckets at the same steps, collectives included
        self.capture_all = is_compiled(model)
        self.graph_sets: dict[tuple, dict[int, torch.cuda.CUDAGraph]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_key: tuple | None = None
        self.graph_pool: Any = None
        # prefill graphs, keyed by static pack shape and prompt count (turn boundaries': "cached" and their static
        # layout's sizes); not for a compiled model (Dynamo would meet each new pack shape inside a capture)
        self.graph_prefill = self.use_graphs and not is_compiled(model) and cache.prefill_graphs
        self.prefill_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple, Tensor]] = {}
        self.prefill_seen: dict[tuple, int] = {}  # eager runs per shape
        self.prefill_pool: Any = None
        self.timings = {"compile_warmup_s": 0.0, "graph_capture_s": 0.0}
        self.host_ring: list[tuple[Tensor, Tensor]] = []  # pinned copies of the ring (`copy_ring`), made at first use
        self.host_turn = 0
        self.sample_fn = sample_fn
        self.slot_owner: object | None = None  # which engine set the slot state last (`Engine._own_slots`)

    # ---- prefill -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[list[int]],
                images: list[ImageInputs | None] | None = None) -> Tensor:
        """Run packed prompts, write their KV to `slots`; return last-token logits [P, V]. images: each prompt's
        (`ImageInputs` or None): the tower's embeddings replace its placeholder tokens' (one tower run for the
        pack), at its M-RoPE positions; such a pack runs eagerly (its shapes vary with the images).

        On CUDA the pack is static (`static_prefill_pack`), so that its shapes recur. With graphs, a shape is
        captured at its PREFILL_CAPTURE_AT-th run and replayed after: eager, a prefill's ~300 launches took ~20 ms
        of host time for ~2 ms of GPU work (Qwen3-0.6B, 5 prompts of ~150 tokens, H100). Every row is computed as
        in the unpadded pack (the ops are row- or sequence-local); only GEMM tilings chosen by the row count may
        round differently, the same in eager and graph runs."""
        dev = self.device
        if dev.type == "cuda":
            ids, flat_slots, lengths, max_seqlen = static_prefill_pack(prompts, slots)
        else:
            ids, flat_slots = [t for p in prompts for t in p], [s for ss in slots for s in ss]
            lengths, max_seqlen = [len(p) for p in prompts], None
        varlen = VarlenContext.from_lengths(lengths, dev, backend=self.prefill_backend, max_seqlen=max_seqlen)
        inputs = (torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
                  torch.tensor(flat_slots, dtype=torch.int64).to(dev, non_blocking=True), varlen)
        P = len(prompts)
        if images is not None and any(im is not None for im in images):
            return self._prefill_forward(P, *inputs, images=images, lengths=[len(p) for p in prompts])
        key = (inputs[0].numel(), len(lengths), max_seqlen, P)
        return self._prefill_graphed(key, inputs, lambda args: self._prefill_forward(P, *args), P)

    def _prefill_graphed(self, key: tuple, inputs: tuple, forward: Callable[[tuple], Tensor], rows: int) -> Tensor:
        """The first `rows` rows of `forward(inputs)`, replayed from the graph of its shape `key` if one is kept; else
        run eagerly and counted: at a shape's PREFILL_CAPTURE_AT-th run (while fewer than PREFILL_GRAPHS are kept)
        captured for next time."""
        if not self.graph_prefill:
            return forward(inputs)[:rows]
        if key in self.prefill_graphs:
            graph, static, out = self.prefill_graphs[key]
            copy_into(static, inputs)
            graph.replay()
            return out[:rows].clone()  # the graph's output buffer is rewritten by its next replay
        logits = forward(inputs)[:rows]
        seen = self.prefill_seen[key] = self.prefill_seen.get(key, 0) + 1
        if seen != PREFILL_CAPTURE_AT or len(self.prefill_graphs) >= PREFILL_GRAPHS:
            return logits
        static, out = clone_tensors(inputs), {}

        def fwd() -> None:
            out["logits"] = forward(static)

        if self.prefill_pool is None:  # apart from the decode graphs': a prefill's output outlives a decode
            self.prefill_pool = torch.cuda.graph_pool_handle()
        # no warm-up: the eager run just before used the same kernels and shapes
        graph, _, capture_s = capture_cuda_graph(fwd, self.device, self.prefill_pool, warmup=0)
        self.timings["graph_capture_s"] += capture_s
        self.prefill_graphs[key] = (graph, static, out["logits"])
        return logits

    def _prefill_forward(self, P: int, ids: Tensor, slot_mapping: Tensor, varlen: VarlenContext,
                         images: list[ImageInputs | None] | None = None, lengths: list[int] | None = None) -> Tensor:
        ctx = PrefillContext(varlen=varlen, slot_mapping=slot_mapping)
        if images is None:
            hidden = self.model(ids, varlen.positions, ctx, self.cache.layers)
        else:
            embeds, deepstack = image_embeds(self.model, ids, images, placeholder_spans(lengths, images))
            positions = pack_positions(lengths, images, ids.numel()).to(self.device)
            hidden = self.model(ids, positions, ctx, self.cache.layers, inputs_embeds=embeds, deepstack=deepstack)
        last = varlen.cu_seqlens[1:P + 1].long() - 1
        return self.logits(hidden[last])

    @torch.inference_mode()
    def prefill_cached(self, chunks: list[list[int]], starts: list[int], tables: list[list[int]],
                       turn_prefill: str = "auto", offsets: list[int] | None = None,
                       images: list[ImageInputs | None] | None = None) -> Tensor:
        """Run each sequence's new tokens chunks[i] at positions starts[i].. over the K/V its block table already
        holds for the positions before (an episode's next turn), write their K/V; return each sequence's last-token
        logits [P, V]. One forward for all sequences; its attention (`CachedPrefillContext`) per turn_prefill:
        "paged": the Triton kernel reads each sequence's keys through its block table, a tile of its new tokens at a
        time (`cached_attention_triton`); "varlen": each layer gathers every sequence's keys once and runs one varlen
        attention (flash on CUDA); "auto": paged where the kernel runs, else varlen (`turn_prefill_form`);
        "decode": one paged-decode row per new token (the decode step's kernel: each row reads its keys alone, in a
        tile of mostly padding rows; the form before the varlen one). A batch-invariant model runs the
        decode rows either way, on its kernel, so a token's result is the trainer's (and a varlen prefill's) bit for
        bit.

        On CUDA the layout is static (`CachedPrefillContext.build(static=True)`) and, with graphs, a shape is
        captured at its PREFILL_CAPTURE_AT-th run and replayed after, as `prefill` does: eager, a turn boundary of
        Qwen3-0.6B (64 episodes x 65 tokens over ~1.1k cached) took 33-45 ms of host time for 12-16 ms of GPU work
        (H100). offsets: each sequence's token index minus its RoPE position (`Request.position_offset`; a prompt
        with images), applied to its new tokens' RoPE positions. images: each sequence's (`Request.images`): where
        its new tokens hold images (a tool's, `window_images`), the tower's embeddings replace their placeholders'
        at their M-RoPE positions, eagerly (as `prefill` does)."""
        form = self.turn_prefill_form(turn_prefill)
        P, static = len(chunks), self.device.type == "cuda"
        ctx = CachedPrefillContext.build(chunks, starts, tables, self.block_size, self.device,
                                         "paged" if form == "paged" else self.prefill_backend, static=static)
        ids = [t for c in chunks for t in c]
        ids = torch.tensor(ids + [0] * (ctx.positions.numel() - len(ids)), dtype=torch.int64)
        inputs = (ids.to(self.device, non_blocking=True), ctx, rope_positions(ctx, chunks, offsets))
        # every sequence's row, fillers and zero-length entries included (those rows are dropped): one graph for any
        # P of the layout, and no size-1 dimension for a compiled model to specialise on
        S = ctx.cu_seqlens_q.numel() - 1
        windows = [im and window_images(im, s, s + len(c)) for im, s, c in zip(images or [None] * P, starts, chunks,
                                                                               strict=True)]
        if any(w is not None for w in windows):
            embeds, rows, deepstack = window_inputs(self.model, inputs[0], inputs[2], [len(c) for c in chunks], windows)
            return self._cached_forward(S, form, inputs[0], ctx, rows, (embeds, deepstack))[:P]
        key = ("cached", form, ids.numel(), S, ctx.key_slots.numel(), *ctx.bounds.shape[:2],
               ctx.block_tables.shape[1])
        return self._prefill_graphed(key, inputs, lambda args: self._cached_forward(S, form, *args), P)

    def turn_prefill_form(self, turn_prefill: str) -> str:
        """`prefill_cached`'s form for `turn_prefill`: auto is paged where the Triton kernel runs (the generator's
        decode backend is), else varlen."""
        if turn_prefill not in TURN_PREFILLS:
            raise ValueError(f"turn_prefill must be one of {TURN_PREFILLS}, got {turn_prefill!r}")
        paged = self.decode_backend == "triton"
        if turn_prefill == "paged" and not paged:
            raise ValueError("turn_prefill paged needs the Triton attention kernel (CUDA, bf16 or fp16, a power-of-two "
                             "head_dim); use auto or varlen")
        return ("paged" if paged else "varlen") if turn_prefill == "auto" else turn_prefill

    def _cached_forward(self, P: int, form: str, ids: Tensor, ctx: CachedPrefillContext,
                        positions: Tensor | None = None, images: tuple | None = None) -> Tensor:
        """positions: the new tokens' RoPE positions (`rope_positions`; default the context's); images: their
        (inputs_embeds, deepstack) where they hold images (`window_inputs`)."""
        layout = ctx if form != "decode" else ctx.decode_rows(self.decode_backend)
        embeds, deepstack = images or (None, None)
        hidden = self.model(ids, ctx.positions if positions is None else positions, layout, self.cache.layers,
                            inputs_embeds=embeds, deepstack=deepstack)
        return self.logits(hidden[ctx.cu_seqlens_q[1:P + 1].long() - 1])

    def logits(self, hidden: Tensor) -> Tensor:
        """The LM head's logits of `hidden`, the whole vocabulary (a TP shard's gathered: `gather_vocab`)."""
        return gather_vocab(self.model.compute_logits(hidden), self.tp)

    def release_graphs(self) -> None:
        """Reset and drop every captured graph. A tensor-parallel copy's graphs hold NCCL kernels of its group, and
        NCCL's communicator teardown (`destroy_process_group`) hangs while such graphs exist (pytorch#115388: a TP 2
        run on 2 H200s finished its steps and never exited)."""
        # `graphs` is one of `graph_sets`' dicts: each graph once
        graphs = {id(g): g for gs in [*self.graph_sets.values(), self.graphs] for g in gs.values()}
        graphs |= {id(g): g for g, _, _ in self.prefill_graphs.values()}
        if graphs:
            torch.cuda.synchronize(self.device)
        for g in graphs.values():
            g.reset()
        self.graph_sets.clear()
        self.graphs = {}
        self.graph_key = None
        self.prefill_graphs.clear()

    # ---- decode ------------------------------------------------------------------------------------
    def _decode_step(self, B: int, width: int, params: SamplingParams) -> None:
        tok, pos, bt = self.tok[:B], self.pos[:B], self.block_tables[:B, :width]
        # Padded rows keep advancing between host checks; step_inputs clamps their (scratch) writes in range.
        offset = self.pos_offset[:B]
        slots, seq_lens, next_pos, rope = step_inputs(pos, bt, self.block_size, self.rope_tables, offset)
        ctx = DecodeContext(block_tables=bt, seq_lens=seq_lens, slot_mapping=slots, backend=self.decode_backend)
        # RoPE positions: each token's index less its row's offset (given tables, `rope` holds their cos / sin)
        hidden = self.model(tok, pos if rope is not None else pos - offset, ctx, self.cache.layers, rope)
        logits = self.logits(hidden)
        nxt, lp = self.sample_fn(logits, self.keys[:B], next_pos, params, self.model.token_logprobs)
        commit_step(nxt, lp, self.ring_tok, self.ring_lp, self.ring_idx, self.tok, self.pos)

    def bucket(self, live: int) -> int:
        for b in self.buckets:
            if b >= live:
                return b
        raise AssertionError(f"{live} live sequences > max_num_seqs {self.max_num_seqs}")

    @torch.inference_mode()
    def decode(self, live: int, width: int, params: SamplingParams) -> None:
        """One decode step for slots 0..live-1 (eager: exactly `live` rows, tables cut to `width`)."""
        if not self.use_graphs:
            # On CUDA, eager runs the graph's bucket size too: the same shapes pick the same GEMM kernels,
            # so eager and graph decoding give identical tokens (bf16 GEMMs are not batch-size invariant).
            self._decode_step(self.bucket(live) if self.device.type == "cuda" else live, width, params)
            return
        if params.sampler_key() != self.graph_key:
            self.select_graphs(params)
        B = self.bucket(live)
        if B not in self.graphs:
            self.capture_bucket(B, params)
        self.graphs[B].replay()

    @torch.inference_mode()
    def select_graphs(self, params: SamplingParams) -> None:
        """Switch to this sampler configuration's graphs (a new, empty set the first time; for a compiled model,
        every bucket captured now, which must then be while no sequence is live)."""
        key = params.sampler_key()
        self.graphs, self.graph_key = self.graph_sets.setdefault(key, {}), key
        if self.capture_all:
            self._capture_missing(params)

    @torch.inference_mode()
    def capture_buckets(self, params: SamplingParams) -> None:
        """Capture every bucket's decode graph for this sampler configuration that is not captured yet."""
        self.select_graphs(params)
        self._capture_missing(params)

    def _capture_missing(self, params: SamplingParams) -> None:
        for B in reversed(self.buckets):  # largest first, so smaller graphs reuse the pool's memory
            if B not in self.graphs:
                self.capture_bucket(B, params)

    @torch.inference_mode()
    def capture_bucket(self, B: int, params: SamplingParams) -> None:
        """Capture the decode step of bucket B for this sampler configuration, at any point of a generation: the
        slot state is set aside, the warm-up step runs on the scratch block (every row's table and position
        zeroed; its ring row is one the next real step overwrites), and the state is put back."""
        state = (self.tok, self.pos, self.keys, self.block_tables, self.ring_idx)
        saved = [t.clone() for t in state]
        for t in state[:4]:
            t.zero_()
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        # a warm-up step launches every kernel (and Triton specialisation) of this bucket before the capture;
        # Dynamo's first passes want two
        g, warm_s, capture_s = capture_cuda_graph(lambda: self._decode_step(B, self.width, params),
                                                  self.device, self.graph_pool, warmup=2 if self.capture_all else 1)
        for t, s in zip(state, saved, strict=True):
            t.copy_(s)
        self.timings["compile_warmup_s"] += warm_s
        self.timings["graph_capture_s"] += capture_s
        self.graphs[B] = g

    # ---- slot bookkeeping --------------------------------------------------------------------------
    def reset_slots(self, start: int) -> None:
        """Point rows start.. at the scratch block (padding for graph buckets)."""
        self.tok[start:].zero_()
        self.pos[start:].zero_()
        self.pos_offset[start:].zero_()
        self.keys[start:].zero_()
        self.block_tables[start:].zero_()
        self.ring_idx.zero_()

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for buf in (self.tok, self.pos, self.pos_offset, self.keys, self.block_tables):
            buf[d] = buf[s]

    def set_slots(self, rows: list[int], tokens: Tensor, positions: list[int], keys: list[int],
                  tables: Tensor, offsets: list[int] | None = None) -> None:
        """positions: each row's token index; offsets: that index minus its RoPE position (default 0)."""
        r = torch.tensor(rows, device=self.device)
        self.tok[r] = tokens
        self.pos[r] = torch.tensor(positions, dtype=torch.int64, device=self.device)
        self.pos_offset[r] = torch.tensor(offsets or [0] * len(rows), dtype=torch.int64, device=self.device)
        self.keys[r] = torch.tensor(keys, dtype=torch.int64, device=self.device)
        self.block_tables[r] = tables

    def read_ring(self, steps: int, live: int) -> tuple[list[list[int]], list[list[float]]]:
        """[slot][step] tokens and log-probs of the last `steps` steps (one host sync): a sequence's new tokens are
        one list, which the engine extends by whole (`Request.record`)."""
        return self.copy_ring(steps, live)()

    def copy_ring(self, steps: int, live: int) -> Callable[[], tuple[list[list[int]], list[list[float]]]]:
        """`read_ring` without waiting for it: the last `steps` steps' ring rows are copied to pinned host memory
        behind the work queued so far, and the ring index is reset; the returned function waits for that copy
        alone (not for work queued after it) and gives `read_ring`'s lists. Two pinned buffers serve in turn, so
        at most two copies may be outstanding (the engine reads each before it queues the one after the next).
        On CPU the copy is the read."""
        if self.device.type != "cuda":
            toks, lps = self.ring_tok[:steps, :live].t().tolist(), self.ring_lp[:steps, :live].t().tolist()
            self.ring_idx.zero_()
            return lambda: (toks, lps)
        if not self.host_ring:
            self.host_ring = [(torch.empty(self.ring_tok.shape, dtype=torch.int64, pin_memory=True),
                               torch.empty(self.ring_lp.shape, dtype=torch.float32, pin_memory=True))
                              for _ in range(2)]
        tok_h, lp_h = self.host_ring[self.host_turn]
        self.host_turn ^= 1
        tok_h[:steps].copy_(self.ring_tok[:steps], non_blocking=True)  # whole rows: contiguous copies
        lp_h[:steps].copy_(self.ring_lp[:steps], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.ring_idx.zero_()

        def wait() -> tuple[list[list[int]], list[list[float]]]:
            done.synchronize()
            return tok_h[:steps, :live].t().tolist(), lp_h[:steps, :live].t().tolist()

        return wait
