"""The memory plan: what one run holds on its GPU, computed from the config alone before anything is allocated,
so that a run that cannot fit is refused at startup with the cheapest change that makes it fit (never a CUDA
OOM at step 1), and `monorl plan --gpu_memory_gb N` answers "does this fit?" on a machine without a GPU.

What the run holds (bytes are exact where the run's own code decides them, estimated where kernels do):
- persistent: the policy's weights (fp32 masters; with LoRA the frozen base once in the compute dtype and fp32
  adapters), its gradients and AdamW's two moments (trainable parameters only), the KL reference copy, the
  generator's bf16 copy and the KV cache (`max_num_seqs x max_model_len` tokens, or what is left of the GPU when
  that does not fit, at least one step's rollouts; both 1/N with tensor-parallel generation), the generator's
  decode-graph pool;
- transient, one phase at a time: the trainer's largest micro-batch (saved activations, the compute-dtype weight
  copies autocast keeps for backward, the chunked LM head), and the generator's largest prefill. With trainer
  CUDA graphs the trainer's activations live in the graphs' private pool, which nothing else can use: they turn
  persistent (all captured shapes share that one pool, so it is the largest shape's, not their sum).

Activations per token and layer are a linear model in the layer's widths whose coefficients were measured
(`monorl.plan_activations`: `ACTIVATION_COEFFS` says where each set comes from). The plan's peak is what
`torch.cuda.max_memory_allocated` should report; the fit check adds the CUDA context and allocator slack
(`reserve_bytes`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from monorl.distributed.fsdp import GATHER_BUCKET_BYTES
from monorl.distributed.placement import role_share
from monorl.generate.build import lora_kept_separate
from monorl.generate.cache import bytes_per_block, bytes_per_sequence, kv_cache_bytes_needed, sequence_rows
from monorl.generate.generator import generator_dtype
from monorl.generate.tensor_parallel import check_tensor_parallel, shard_config
from monorl.model.config import ModelConfig
from monorl.model.pack_layout import bucket_size
from monorl.plan_activations import activation_shape, prefill_bytes, trainer_activation_bytes
from monorl.plan_images import vision_activation_bytes
from monorl.plan_params import (
    active_param_count,
    lora_param_count,
    param_counts,
    tensor_parallel_copy_params,
)
from monorl.plan_rewards import MODEL_REWARD_ROWS, ModelRewards, model_reward_rows
from monorl.plan_table import GiB, MemoryPlan, MemoryRow, reserve_for
from monorl.train.graphs import graph_blocker

if TYPE_CHECKING:
    from monorl.config import RunConfig


def largest_micro_batch(cfg: RunConfig, max_prompt_tokens: int, ranks: int = 1) -> int:
    """Tokens of the step's largest packed micro-batch: all rollouts of a step (of a rank's share of them), at
    most micro_batch_tokens, rounded up to the packer's bucket."""
    r = cfg.rollout
    step_tokens = -(-r.prompts_per_step // ranks) * r.group_size * (max_prompt_tokens + r.max_new_tokens)
    return min(cfg.trainer.micro_batch_tokens, bucket_size(min(step_tokens, cfg.trainer.micro_batch_tokens)))


def plan_memory(cfg: RunConfig, m: ModelConfig, max_prompt_tokens: int, device_bytes: int | None,
                on_gpu: bool = True, activation_checkpointing: bool | None = None,
                max_model_len: int | None = None, ranks: int = 1, role: str = "both",
                teacher: ModelConfig | None = None, image_tokens: int = 0, tool_image_tokens: int = 0,
                rewards: ModelRewards | None = None) -> MemoryPlan:
    """The plan for `cfg` on one GPU of `device_bytes` (see the module docstring). on_gpu=False plans a CPU run
    (fp32 everywhere, no graphs); activation_checkpointing overrides `trainer.activation_checkpointing`.
    ranks > 1: one GPU of an FSDP run (`monorl.distributed`): the policy, its gradients and AdamW's state are
    sharded over the ranks, a rank trains its share of the step, and holds a gathered block or two at a time.
    `generator.tensor_parallel_size` N > 1: the generator's copy and KV cache are split over N of those ranks
    (`monorl.generate.tensor_parallel`), each group of N generating its share of the step's prompt groups. role
    "trainer" / "generator": a disaggregated rank's rows alone (`ranks`: those of its role; `role_share`). teacher:
    a distillation teacher's architecture (frozen, in the generator's dtype, sharded over the trainer ranks).
    image_tokens: those of max_prompt_tokens that are a vision-language prompt's images (`monorl.plan_images`);
    tool_image_tokens: those an agent episode's tools may insert (`tool_image_tokens_bound`). rewards: a judge's and a
    reward model's rows (`monorl.plan_rewards`)."""
    t, g, cc, lora = cfg.trainer, cfg.generator, cfg.compile, cfg.lora
    tp = g.tensor_parallel_size
    if ranks % tp:
        raise ValueError(f"generator.tensor_parallel_size={tp} does not divide the {ranks} ranks")
    gen_m = shard_config(m, tp)  # one rank's heads, kv heads and MLP columns (the model itself when tp = 1)
    counts = param_counts(m)
    total = sum(counts.values())
    compute = ("bfloat16" if on_gpu else "float32") if t.compute_dtype == "auto" else t.compute_dtype
    gen_dtype = generator_dtype(g.dtype, "cuda" if on_gpu else "cpu")
    gen_bytes = gen_dtype.itemsize
    ac = t.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    ac = bool(ac)
    rows: list[MemoryRow] = []
    if lora.enabled:
        n_lora = lora_param_count(m, lora)
        base_bytes = 2 if compute == "bfloat16" else 4
        rows.append(MemoryRow("policy weights", (total * base_bytes + n_lora * 4) // ranks,
                              f"frozen {compute} base + {n_lora / 1e6:.1f}M fp32 LoRA parameters"))
        trainable, copy_params, residual = n_lora, 0, base_bytes
    else:
        size = f"{total / 1e9:.2f}B" if total >= 1e8 else f"{total / 1e6:.2f}M"
        active = f", {active_param_count(m) / 1e9:.2f}B active" if m.is_moe else ""
        rows.append(MemoryRow("policy weights", total * 4 // ranks, f"{size} fp32 masters{active}"))
        trainable, residual = total - counts["vision"] * cfg.model.freeze_vision, 4
        # autocast's bf16 casts of the fp32 masters. Under FSDP2 the blocks are gathered in bf16 and nothing is
        # cast, but dropping the term there was refuted (4 H100, 2026-11-27): Qwen3-8B then ran out of memory in the
        # weight sync with 21 GiB in the trainer graphs' pool, and Qwen3-14B's measured training needs came ~15 GiB
        # above the plan; the term stands in for what the graphed FSDP step holds (not itemised yet)
        copy_params = counts["linear"] + counts["experts"] + (counts["lm_head"] or counts["embed"])
    # the trainer's graphs, as `Trainer` decides (`graph_blocker`), on the flash backend and the grouped-GEMM path
    # the plan assumes elsewhere (sm90+), and a hybrid's layers served by fla (graphs' fixed gradients: the larger
    # plan, where the machine's Triton leaves them eager)
    graphs = on_gpu and cc.trainer_cuda_graphs and graph_blocker(m, cfg.batch_invariant is True, True, True,
                                                                 lambda: True) is None
    # trainer graphs write fixed gradient buffers; without them gradients exist only from backward to the
    # optimizer step, while activations are being freed: they count as a transient of the trainer phase
    rows.append(MemoryRow("gradients", trainable * 4 // ranks, "fp32" + ("" if graphs else ", freed after each step"),
                          persistent=graphs))
    rows.append(MemoryRow("optimizer state", trainable * 8 // ranks, "AdamW moments, fp32"))
    if ranks > 1:
        for row in rows:
            row.note += f" (1/{ranks}: sharded)"
        # FSDP's all-gather of the next block (prefetch) beside the one computing, in the compute dtype, and a
        # block's unsharded fp32 gradients before their reduce-scatter; with trainer graphs, in the graphs' pool
        block = (total - counts["embed"] - (counts["lm_head"] or 0)) // m.num_layers
        rows.append(MemoryRow("FSDP gathered blocks", 2 * block * (2 if compute == "bfloat16" else 4)
                              + (0 if lora.enabled else block * 4), "two blocks unsharded at a time"
                              + ("" if lora.enabled else ", one block's gradients before reduce-scatter")
                              + (", CUDA-graph pool" if graphs else ""), persistent=graphs))
    if t.loss.kl_coef > 0:
        rows.append(MemoryRow("KL reference", total * gen_bytes, "frozen copy of the starting policy"))
    if teacher is not None:  # sharded as the policy is: its share, and two of its blocks gathered in its forward
        tc = param_counts(teacher)
        t_total = sum(tc.values())
        t_block = (t_total - tc["embed"] - tc["lm_head"] - tc["vision"]) // teacher.num_layers
        gathered = 2 * t_block * gen_bytes if ranks > 1 else 0
        note = f" (1/{ranks}: sharded; two blocks gathered at a time)" if ranks > 1 else ""
        rows.append(MemoryRow("teacher weights", t_total * gen_bytes // ranks + gathered, "frozen" + note))
    if lora.enabled and lora_kept_separate(cfg) and ranks == 1:  # an unmerged copy, its frozen base the policy's
        rows.append(MemoryRow("generator weights", lora_param_count(m, lora) * gen_bytes,
                              "adapters only: the base is shared with the policy"))
    elif lora.enabled and lora_kept_separate(cfg):  # shared before FSDP sharded the policy: the copy keeps it whole
        rows.append(MemoryRow("generator weights", (total + lora_param_count(m, lora)) * gen_bytes,
                              "unmerged copy: the whole frozen base (shared with the policy before it was sharded) "
                              "and the adapters"))
    elif tp > 1:
        rows.append(MemoryRow("generator weights", tensor_parallel_copy_params(m, tp) * gen_bytes,
                              f"bf16 inference copy, 1/{tp}: tensor-parallel (embedding and norms whole)"))
    else:
        rows.append(MemoryRow("generator weights", total * gen_bytes, "bf16 inference copy" if on_gpu else ""))
    model_len = max_model_len or g.max_model_len or m.max_position_embeddings
    kv = g.kv_cache_bytes or kv_cache_bytes_needed(gen_m, g.max_num_seqs, model_len, g.block_size, gen_dtype,
                                                   batch_invariant=cfg.batch_invariant is True)
    rows.append(MemoryRow("KV cache", kv, f"{g.max_num_seqs} seqs x {model_len} tokens"
                          + (f", 1/{tp} of the kv heads" if tp > 1 else "")))
    mb = largest_micro_batch(cfg, max_prompt_tokens, ranks)
    act_shape = activation_shape(m)  # a sparse layer's per-token width, for the activation rows
    compiled = cc.backend == "inductor" and cc.trainer
    acts = trainer_activation_bytes(act_shape, mb, compute, ac, t.logprob_chunk, copy_params, residual, compiled,
                                    batch_invariant=cfg.batch_invariant is True)
    # a pack's image share: its prompts' at most, or its completions' (a tool's images are inserted tokens)
    fraction = max(image_tokens / max_prompt_tokens, tool_image_tokens / cfg.rollout.max_new_tokens)
    tower, patches = vision_activation_bytes(m, mb, fraction, compute, training=True)
    acts += tower  # the tower's blocks run inside the pack's forward
    note = f"{mb} tokens{f', the tower {patches} patches' if patches else ''}{', checkpointed' if ac else ''}"
    note += ", compiled" if compiled else ""
    if graphs:
        note += ", CUDA-graph pool"
    else:  # gradients held in no graph buffers are allocated during backward: those alive at the activation peak
        # (a rank's shard of them under FSDP)
        at_peak = (trainable * 4 if ac else min(trainable, m.vocab_size * m.hidden_size) * 4) // ranks
        acts += at_peak
        note += f", + {at_peak / GiB:.1f} GiB of gradients at its peak"
    rows.append(MemoryRow("trainer activations", acts, note, persistent=graphs))
    # what the caching allocator reserves beyond the rows above: 12% of the activations put the plan within -7% to
    # +9% of the reserved peak of 0.6B, 1.7B, 4B (AC) and 8B LoRA (AC) runs (bench_memory.py, H200, 2026-11-23; the
    # rows this was chosen on). A "3 bytes per parameter" term fitted before explained reserved memory that was the
    # eager warm-up's cache beside the graph pool, now emptied before capture (Trainer.warm_up).
    rows.append(MemoryRow("allocator slack", int(0.12 * acts), "measured: 12% of activations"))
    width = act_shape.hidden_size + activation_shape(gen_m).intermediate_size  # a TP rank's MLP share
    prefill = largest_prefill(cfg, max_prompt_tokens, ranks // tp)
    gen_transient = prefill_bytes(m, prefill, width, g.max_num_seqs)
    # the tower at a prompt's prefill, or at a turn's (the resuming episodes' tool images, up to max_prefill_tokens)
    turn = max(tool_image_tokens, min(g.max_prefill_tokens, g.max_num_seqs * tool_image_tokens))
    gen_transient += max(vision_activation_bytes(m, prefill, image_tokens / max_prompt_tokens, compute, False)[0],
                         vision_activation_bytes(m, turn, 1.0, compute, False)[0])
    rows.append(MemoryRow("generator prefill", int(gen_transient), f"{prefill} tokens", persistent=False))
    rows += model_reward_rows(rewards, cfg, max_prompt_tokens, gen_dtype)  # loaded by the producer, at first call
    if ranks > 1 and role == "both":  # a colocated FSDP run's weight sync gathers the shards into the generator
        rows.append(_weight_sync_row(m, counts, ranks, tp, lora.enabled, compute, gen_bytes))
    if on_gpu and cc.decode_cuda_graphs:
        # sampler over [max_num_seqs, vocab]: fp32 logits, sort keys and indices, nucleus arrays
        rows.append(MemoryRow("decode graph pool", 32 * max(2, g.max_num_seqs) * m.vocab_size, "sampler buffers"))
    if role != "both":
        rows = [r for r in rows if (r.name in GENERATOR_ROWS) == (role == "generator")]
    plan = MemoryPlan(rows, device_bytes, mb, ac, reserve_for(device_bytes) if device_bytes else 0)
    if on_gpu and g.kv_cache_bytes is None and plan.fits is False and role != "trainer":  # a trainer has no KV
        _kv_to_room_(plan, cfg, gen_m, max_prompt_tokens, ranks // tp, gen_dtype)
    return plan


def largest_prefill(cfg: RunConfig, max_prompt_tokens: int, groups: int) -> int:
    """Tokens in the largest prefill one of `groups` generating ranks (or TP groups) runs: its share of a step's or a
    validation's prompt groups (`World.share`), as many at once as the slots hold (a group's samples take a slot
    each, its prompt is prefilled once: `Scheduler`), each of the longest prompt, packed up to
    `generator.max_prefill_tokens` (a longer prompt runs alone). Async runs admit the next batches' groups while
    one decodes: the slots alone bound them."""
    r, v, g = cfg.rollout, cfg.validation, cfg.generator
    length = max(max_prompt_tokens, 1)

    def at_once(prompts: int, per_group: int) -> int:
        slots = max(1, g.max_num_seqs // per_group)
        return slots if r.max_staleness > 0 else min(-(-prompts // max(groups, 1)), slots)

    prompts = max(at_once(r.prompts_per_step, r.group_size), at_once(v.num_prompts, v.k) if v.num_prompts else 0)
    return max(length, min(g.max_prefill_tokens, length * prompts))


def _weight_sync_row(m: ModelConfig, counts: dict[str, int], ranks: int, tp: int, lora: bool, compute: str,
                     gen_bytes: int) -> MemoryRow:
    """What a colocated FSDP run's weight sync (`monorl.distributed.weight_sync`) holds beyond both copies, between the
    trainer's step and the next generation: a bucket of the all-gathered shards and its 1/N sent; with LoRA one FSDP
    unit gathered at a time, the largest the root (embedding and LM head), and a projection's merged fp32 weight;
    with tensor-parallel generation, the embedding (and LM head) gathered whole."""
    if lora:
        base = 2 if compute == "bfloat16" else 4
        widest = max(m.hidden_size, m.intermediate_size, m.num_heads * m.head_dim)
        return MemoryRow("weight sync", (counts["embed"] + counts["lm_head"]) * base + widest * m.hidden_size * 4,
                         "the root FSDP unit gathered, a merged LoRA weight", persistent=False)
    if tp > 1:  # from the shards the embedding alone is gathered whole; other layouts gather the root unit
        return MemoryRow("weight sync", (counts["embed"] + counts["lm_head"]) * gen_bytes,
                         "the embedding (and LM head) gathered whole", persistent=False)
    return MemoryRow("weight sync", GATHER_BUCKET_BYTES + GATHER_BUCKET_BYTES // ranks,
                     "a bucket of the all-gathered shards", persistent=False)


GENERATOR_ROWS = ("generator weights", "KV cache", "generator prefill", "decode graph pool", *MODEL_REWARD_ROWS)


def step_kv_need(cfg: RunConfig, m: ModelConfig, max_prompt_tokens: int, ranks: int,
                 dtype: torch.dtype) -> tuple[int, int, int]:
    """(sequences, tokens each, bytes): the KV cache one step's rollouts need on one rank -- its share of the prompt
    groups, every completion live at once, each of the longest fitting prompt plus max_new_tokens. The least a run
    is given: with less, a step's sequences would wait for each other's blocks (the single-GPU start-up refuses it
    too, `monorl.run.startup.Startup.size_kv_cache`). Tensor-parallel: `m` a rank's shard (`shard_config`), `ranks`
    the generator groups."""
    r = cfg.rollout
    seqs = min(cfg.generator.max_num_seqs, -(-r.prompts_per_step // ranks) * r.group_size)
    length = max_prompt_tokens + r.max_new_tokens
    return seqs, length, kv_cache_bytes_needed(m, seqs, length, cfg.generator.block_size, dtype,
                                               rows_for=cfg.generator.max_num_seqs,
                                               batch_invariant=cfg.batch_invariant is True)


def _kv_to_room_(plan: MemoryPlan, cfg: RunConfig, m: ModelConfig, max_prompt_tokens: int, ranks: int,
                 dtype: torch.dtype) -> None:
    """A plan that does not fit with the default KV cache (`max_num_seqs x max_model_len`, no
    `generator.kv_cache_bytes`): the cache gets what is left of the GPU, as the run's start-up gives it once training
    is measured (`Startup.size_kv_cache`), but never less than one step's rollouts need (`step_kv_need`); at that
    least, a plan that still does not fit is refused as before."""
    row = plan.row("KV cache")
    assert plan.device_bytes is not None
    seqs, length, least = step_kv_need(cfg, m, max_prompt_tokens, ranks, dtype)
    room = plan.device_bytes - plan.reserve_bytes - (plan.peak_bytes - row.bytes)
    per_block = bytes_per_block(m, cfg.generator.block_size, dtype)
    rows = sequence_rows(cfg.generator.max_num_seqs) * bytes_per_sequence(m, dtype, block_size=cfg.generator.block_size)
    size = min(row.bytes, max(least, rows + max(0, room - rows) // per_block * per_block))
    if size >= row.bytes:
        return
    what = "one step's rollouts, the least a run takes" if size <= least else "what is left of the GPU"
    row.note = (f"{what} (the default {row.note}: {row.bytes / GiB:.2f} GiB; this run's {seqs} seqs x "
                f"{length} tokens: {least / GiB:.2f} GiB)")
    row.bytes = size


def auto_checkpointing(cfg: RunConfig, m: ModelConfig, max_prompt_tokens: int, device_bytes: int | None,
                       on_gpu: bool = True, ranks: int = 1, role: str = "both",
                       teacher: ModelConfig | None = None, **beside: Any) -> bool:
    """`trainer.activation_checkpointing` auto (None): on only when the run does not fit without it. beside: what
    else `plan_memory` takes of the run (image_tokens, tool_image_tokens, rewards)."""
    if cfg.trainer.activation_checkpointing is not None:
        return cfg.trainer.activation_checkpointing
    if not on_gpu or device_bytes is None:
        return False
    return not plan_memory(cfg, m, max_prompt_tokens, device_bytes, on_gpu, activation_checkpointing=False,
                           ranks=ranks, role=role, teacher=teacher, **beside).fits


_RANKS = "nproc"  # the candidate change "more GPUs": not a config key, the rank count `monorl train --nproc` sets


def _changes(cfg: RunConfig, m: ModelConfig, max_prompt_tokens: int,
             ranks: int = 1) -> list[tuple[str, str, dict[str, Any]]]:
    """Candidate changes, cheapest first: (what to pass, what it costs, overrides)."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    t, r, g = cfg.trainer, cfg.rollout, cfg.generator
    if not t.activation_checkpointing:
        out.append(("--trainer.activation_checkpointing true", "one more forward per micro-batch in training",
                    {"trainer.activation_checkpointing": True}))
    # trainer graphs off: a few % of one GPU's step; under FSDP the eager step is host-bound (0.066 -> 0.300 s on
    # 2 H200s), so there it comes after smaller micro-batches
    no_graphs = [("--compile.trainer_cuda_graphs false", ("a few % of the trainer step" if ranks == 1 else
                  "the trainer step up to ~4x slower (eager FSDP)") + "; its activations then share memory with "
                  "generation", {"compile.trainer_cuda_graphs": False})] if cfg.compile.trainer_cuda_graphs else []
    out += no_graphs if ranks == 1 else []
    need_len = max_prompt_tokens + r.max_new_tokens
    if g.kv_cache_bytes is not None:  # without it the plan already gives the cache what is left (`_kv_to_room_`)
        out.append(("--generator.kv_cache_bytes null", "a KV cache sized to what is left, at least this run's "
                    "sequences", {"generator.kv_cache_bytes": None}))
    mbt = t.micro_batch_tokens
    while mbt // 2 >= max(1024, need_len):
        mbt //= 2
        out.append((f"--trainer.micro_batch_tokens {mbt}", "more, smaller trainer micro-batches",
                    {"trainer.micro_batch_tokens": mbt}))
    out += no_graphs if ranks > 1 else []
    if cfg.lora.enabled and not lora_kept_separate(cfg):
        out.append(("--generator.merge_lora false", "the generator's adapters as separate matmuls over the policy's "
                    "base (one copy of the base; slower decode)", {"generator.merge_lora": False}))
    # the generator's copy and KV cache split over N of the run's GPUs (one node's): the GPUs the run has, before
    # more of them; N must divide the run's ranks (a pair with --nproc where it does not: `advise`)
    for n in (2, 4, 8):
        if n > g.tensor_parallel_size and _divides_model(m, n):
            out.append((f"--generator.tensor_parallel_size {n}", f"tensor-parallel generation over {n} GPUs "
                        "(collectives in every forward of the generator)", {"generator.tensor_parallel_size": n}))
    # more GPUs of the same kind (FSDP2, monorl.distributed): the same training, sharded; a rank count must divide
    # the step's prompt groups
    for n in (2, 4, 8):
        if n > ranks and r.prompts_per_step % n == 0:
            out.append((f"--nproc {n}", f"{n} GPUs (FSDP2) instead of {ranks}", {_RANKS: n}))
    if not cfg.lora.enabled and m.is_moe:  # a MoE model's experts take no adapters (monorl.model.lora.apply_lora_)
        out.append(("--lora.rank 16 --lora.targets q,k,v,o", "LoRA on the attention: trains adapters only (a "
                    "different method than full fine-tuning)", {"lora.rank": 16, "lora.targets": ("q", "k", "v", "o")}))
    elif not cfg.lora.enabled:
        out.append(("--lora.rank 16", "LoRA: trains adapters only (a different method than full fine-tuning)",
                    {"lora.rank": 16}))
    return out


def _divides_model(m: ModelConfig, n: int) -> bool:
    try:
        check_tensor_parallel(m, n)
    except ValueError:
        return False
    return True


def with_overrides(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """`cfg` with a candidate change's keys set (the sections a change touches copied; "nproc" is no key)."""
    new = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer),
                              generator=dataclasses.replace(cfg.generator), compile=dataclasses.replace(cfg.compile),
                              lora=dataclasses.replace(cfg.lora))
    for key, v in overrides.items():
        if key == _RANKS:
            continue
        section, name = key.split(".")
        setattr(getattr(new, section), name, v)
    return new


def _auto_plan(cfg: RunConfig, m: ModelConfig, max_prompt_tokens: int, device_bytes: int,
               ranks: int = 1, teacher: ModelConfig | None = None, **beside: Any) -> MemoryPlan:
    ac = auto_checkpointing(cfg, m, max_prompt_tokens, device_bytes, ranks=ranks, teacher=teacher, **beside)
    return plan_memory(cfg, m, max_prompt_tokens, device_bytes, activation_checkpointing=ac, ranks=ranks,
                       teacher=teacher, **beside)


def advise(cfg: RunConfig, m: ModelConfig, max_prompt_tokens: int, device_bytes: int, ranks: int = 1,
           apply: Callable[[dict[str, Any]], RunConfig] | None = None, teacher: ModelConfig | None = None,
           **beside: Any) -> list[str]:
    """For a plan that does not fit: the cheapest single change that makes it fit, else the cheapest pair, else
    a line saying nothing here does. Changes are ordered cheapest first (more GPUs before LoRA, which changes
    the method); activation checkpointing left on auto is resolved for each candidate, as the run would. apply: the
    config a change's keys give, as the run would resolve it (`monorl.assembly.change_resolver`: `--lora.rank 16`
    also turns batch_invariant auto off, and the generator's copy is then its own), so that the peak quoted is the
    one the changed run plans; default: the keys set on `cfg` as resolved."""
    changes = _changes(cfg, m, max_prompt_tokens, ranks)
    candidates = [[c] for c in changes] + [[a, b] for i, a in enumerate(changes) for b in changes[i + 1:]
                                           if not set(a[2]) & set(b[2])]
    for combo in candidates:
        overrides = {k: v for _, _, ov in combo for k, v in ov.items()}
        n = overrides.get(_RANKS, ranks)
        if n % overrides.get("generator.tensor_parallel_size", cfg.generator.tensor_parallel_size):
            continue  # a tensor-parallel group is made of the run's ranks
        changed = apply(overrides) if apply is not None else with_overrides(cfg, overrides)
        p = _auto_plan(changed, m, max_prompt_tokens, device_bytes, n, teacher, **beside)
        if p.fits:
            flags = " ".join(flag for flag, _, _ in combo)
            ac = (" (activation checkpointing then on, auto)" if p.activation_checkpointing
                  and "trainer.activation_checkpointing" not in overrides and not cfg.trainer.activation_checkpointing
                  else "")
            return [f"{flags}  (peak {p.peak_bytes / GiB:.2f} GiB{ac}; costs {'; '.join(c for _, c, _ in combo)})"]
    return ["nothing here fits GPUs of this size: use GPUs with more memory, more of them (--nproc, with "
            "rollout.prompts_per_step a multiple of it), or a smaller model"]


class MemoryPlanError(ValueError):
    """The run does not fit its GPU (raised at startup, before any weights are loaded)."""


def device_memory_bytes(device: torch.device) -> int | None:
    """The GPU's total memory (None for a CPU run, which the plan only reports)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def run_memory_plan(cfg: RunConfig, m: ModelConfig, max_prompt_tokens: int, device: torch.device,
                    ranks: int = 1, rank: int = 0,
                    apply: Callable[[dict[str, Any]], RunConfig] | None = None,
                    teacher: ModelConfig | None = None, **beside: Any) -> MemoryPlan:
    """The plan for a run on `device` (its whole memory), with `trainer.activation_checkpointing` auto resolved.
    A run that does not fit raises MemoryPlanError naming the cheapest change that does (`advise`, with `apply`),
    after printing the table. ranks: the run's rank count (one GPU of an FSDP run); rank: this one (its role in a
    disaggregated run); beside: what else `plan_memory` takes of the run (images, model-graded rewards)."""
    on_gpu = device.type == "cuda"
    device_bytes = device_memory_bytes(device)
    role, ranks = role_share(cfg.placement, ranks, rank)
    ac = auto_checkpointing(cfg, m, max_prompt_tokens, device_bytes, on_gpu, ranks, role, teacher, **beside)
    plan = plan_memory(cfg, m, max_prompt_tokens, device_bytes, on_gpu, ac, ranks=ranks, role=role, teacher=teacher,
                       **beside)
    if plan.fits is False:
        plan.advice = advise(cfg, m, max_prompt_tokens, device_bytes, ranks, apply, teacher, **beside)
        print(f"memory plan (does not fit {device}):\n{plan.table()}", file=sys.stderr, flush=True)
        raise MemoryPlanError(f"the run does not fit {device}: planned peak {plan.peak_bytes / GiB:.1f} GiB + "
                              f"{plan.reserve_bytes / GiB:.1f} GiB context and slack > {device_bytes / GiB:.1f} GiB; "
                              f"cheapest change that fits: {plan.advice[0]}")
    return plan
