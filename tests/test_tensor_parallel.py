"""Tensor-parallel generation (issue #45, item 3) on CPU: two real processes over gloo against one.

- greedy: the same tokens on 2 TP ranks as on 1; sampled (T = 1, keyed by (seed, sequence, position)): the same
  tokens too, as the sampler runs on the whole vocabulary gathered on every rank;
- log-probs within LOGPROB_ATOL of one rank's (fp32): the row-parallel o_proj / down_proj products are summed over
  two partial products instead of one GEMM's K loop, which moves the last bits of every hidden state: observed max
  |diff| 1.9e-6 to 2.9e-6 over 12 tokens (a few fp32 ulps of log-probs down to -7; the weights scaled for O(1)
  logits), never bitwise equal; the tokens do not move (the tolerance leaves ~3x room);
- weight sync from an FSDP-sharded trainer (gathered one block at a time) into each TP rank's copy equals slicing
  the one-rank fused copy by heads / columns / vocabulary rows, written independently here;
- a degree that does not divide the heads is refused in one line.
"""

from __future__ import annotations

import copy
import os
from itertools import islice
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from monorl.distributed.weight_sync import sync_weights_, syncs_from_shards
from monorl.distributed.world import SINGLE, World
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams
from monorl.generate.tensor_parallel import (
    TensorParallel,
    build_tensor_parallel_model,
    check_tensor_parallel,
    tensor_parallel_group,
)
from monorl.model.config import ModelConfig, model_shape
from monorl.model.decoder import build_model
from monorl.model.lora import LoRAConfig, apply_lora_
from monorl.model.tokenizer import CharTokenizer
from monorl.rl.rollouts.rollout import generate_rollouts
from tests.conftest import DigitsTask

LOGPROB_ATOL = 1e-5
PROMPTS = [[3, 17, 5, 9, 22], [40, 2, 11], [7, 7, 8, 1, 30, 31, 2]]
GEN = dict(max_num_seqs=8, max_model_len=64, block_size=4)


def _configs() -> dict[str, ModelConfig]:
    tiny = model_shape("tiny")  # Qwen3: q/k norm, tied head
    # Llama with attention biases, untied: q/k/v biases sliced, o_proj's bias added once, a head of its own
    llama = tiny.replace(tie_word_embeddings=False, num_layers=2).with_family("llama", attention_bias=True)
    # Qwen3-MoE: each expert's MLP columns split, the router whole, the sparse block's output summed over the ranks;
    # its first layer dense (mlp_only_layers), so both kinds of MLP are in one model
    moe = model_shape("tiny-moe").replace(mlp_only_layers=(0,))
    # (#57) GPT-OSS: sinks per q head, q/k/v/o biases, window and full layers, its own experts (gate and up
    # interleaved, biased; the down bias added once). Gemma 3: window layers of 8 keys around a full one, so prompts
    # and 12 new tokens pass the window; each rank's window rings and full-layer blocks hold its kv heads only
    from tests.test_gpt_oss_generate import GPT_OSS_TINY as gpt_oss
    from tests.test_window_recycling import CFG as gemma3

    return {"qwen3_tied": tiny, "llama_bias": llama, "qwen3_moe": moe, "gemma3_window": gemma3, "gpt_oss": gpt_oss}


def _model(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    model = build_model(cfg, seed=seed)
    with torch.no_grad():  # O(1) logits, so greedy decoding is not degenerate (tests/test_generate_gpu.py)
        for n, p in model.named_parameters():
            if not n.endswith("norm.weight"):
                p.mul_(5.0)
    return model


def _generate(gen: Generator) -> dict[str, list]:
    out = {}
    for name, sp in (("greedy", SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)),
                     ("sampled", SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True))):
        res = gen.generate(PROMPTS, sp, n=2)
        out[name] = [[c.token_ids for c in group] for group in res]
        out[name + "_lp"] = [[c.logprobs for c in group] for group in res]
    return out


def _rollouts(gen: Generator, world: World) -> list[list[tuple[list[int], float]]]:
    tok = CharTokenizer()
    task = DigitsTask()
    prompts = list(islice(task.train_prompts(0), 4))
    groups = generate_rollouts(gen, tok, task, prompts, SamplingParams(max_new_tokens=8, seed=2), 2, 64, world=world)
    return [[(r.completion_ids, r.rewards["digits"]) for r in g] for g in groups]


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tp = tensor_parallel_group(rank, world, world)
        result: dict = {}
        for key, cfg in _configs().items():
            model = _model(cfg, 1)
            one = Generator(model, GeneratorConfig(**GEN), eos_token_ids=())
            two = Generator(model, GeneratorConfig(**GEN, tensor_parallel_size=world), eos_token_ids=(), tp=tp)
            fixed = Generator(model, GeneratorConfig(**GEN, tensor_parallel_size=world), eos_token_ids=(),
                              tp=TensorParallel(tp.size, tp.rank, tp.group, fixed_order=True))
            result[key] = {"one": _generate(one), "two": _generate(two), "fixed": _generate(fixed),
                           "kv_heads": two.cache.kv.shape[-2], "config_whole": two.model.config == cfg}
            if key == "qwen3_tied":  # the RL step's rollouts: the TP group generates the step's groups once
                result["rollouts"] = {name: _rollouts(gen, World(rank=rank, size=world) if name == "two" else SINGLE)
                                      for name, gen in (("one", one), ("two", two))}
            # weight sync from an FSDP-sharded trainer with other weights than the copies were built from
            trainer = _model(cfg, 2)
            full = copy.deepcopy(trainer)
            one.load_weights_(full)
            from monorl.distributed.fsdp import shard_model_

            shard_model_(trainer, torch.device("cpu"))
            result[key]["from_shards"] = syncs_from_shards(two.model, trainer)
            two.load_weights_(trainer)
            result[key]["full_copy"] = {n: p.clone() for n, p in one.model.named_parameters()}
            result[key]["tp_copy"] = {n: p.clone() for n, p in two.model.named_parameters()}
            result[key]["after_sync"] = _generate(two)
            result[key]["one_after_sync"] = _generate(one)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("tp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True, start_method="spawn")
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("key", list(_configs()))
def test_two_tp_ranks_generate_what_one_rank_does(ranks: list[dict], key: str) -> None:
    for res in ranks:
        r = res[key]
        for when, one, two in (("built", r["one"], r["two"]), ("fixed order", r["one"], r["fixed"]),
                               ("after sync", r["one_after_sync"], r["after_sync"])):
            for kind in ("greedy", "sampled"):
                assert two[kind] == one[kind], (when, kind)
                a, b = torch.tensor(two[kind + "_lp"]), torch.tensor(one[kind + "_lp"])
                torch.testing.assert_close(a, b, atol=LOGPROB_ATOL, rtol=0)
        # of two ranks an all-reduce's sum is one commutative add, rounded once: the fixed order's bits exactly
        assert r["fixed"] == r["two"]
    cfg = _configs()[key]
    assert ranks[0][key]["kv_heads"] == cfg.num_kv_heads // 2  # a rank's KV cache holds its kv heads only
    assert ranks[0][key]["config_whole"]  # the copy's config is the model's (a checkpoint's config.json)
    # both ranks of the group saw the same tokens and log-probs, bit for bit (they sample the same gathered logits)
    assert ranks[0][key]["two"] == ranks[1][key]["two"]


def test_tp_rollouts_are_the_steps_groups_once(ranks: list[dict]) -> None:
    for res in ranks:
        assert len(res["rollouts"]["two"]) == 4  # not once per TP rank
        assert res["rollouts"]["two"] == res["rollouts"]["one"]


def _expected_shard(cfg: ModelConfig, full: dict[str, torch.Tensor], rank: int, n: int) -> dict[str, torch.Tensor]:
    """One TP rank's parameters, cut from the one-rank fused copy by hand."""
    q, kv, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size

    def part(t: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
        return t.narrow(dim, rank * size // n, size // n)

    out = {}
    for name, t in full.items():
        if "qkv_proj" in name:  # [q | k | v] rows: this rank's q heads, then its kv heads'
            out[name] = torch.cat([part(t[:q], q), part(t[q:q + kv], kv), part(t[q + kv:], kv)])
        elif name.endswith("self_attn.sinks"):  # GPT-OSS: a logit per q head
            out[name] = part(t, cfg.num_heads)
        elif cfg.model_type == "gpt_oss" and ".experts." in name:  # [E, H, 2I] interleaved, [E, 2I], [E, I, H]
            e = cfg.moe_intermediate_size
            if name.endswith("down_proj_bias"):
                out[name] = t if rank == 0 else torch.zeros_like(t)
            else:
                out[name] = part(t, 2 * e if "gate_up" in name else e, dim=t.dim() - 1 if "gate_up" in name else 1)
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: every expert's gate rows, then its up rows
            e = cfg.moe_intermediate_size
            out[name] = torch.cat([part(t[:, :e], e, dim=1), part(t[:, e:], e, dim=1)], dim=1)
        elif name.endswith("experts.down_proj"):  # [E, H, I]: every expert's columns
            out[name] = part(t, t.shape[2], dim=2)
        elif "gate_up_proj" in name:
            out[name] = torch.cat([part(t[:i], i), part(t[i:], i)])
        elif "o_proj.weight" in name or "down_proj.weight" in name:
            out[name] = part(t, t.shape[1], dim=1)
        elif "o_proj.bias" in name:
            out[name] = t if rank == 0 else torch.zeros_like(t)
        else:
            out[name] = t
    head = full["model.embed_tokens.weight"] if cfg.tie_word_embeddings else full["lm_head.weight"]
    out["lm_head.weight"] = part(head, cfg.vocab_size)
    return out


@pytest.mark.parametrize("key", list(_configs()))
def test_weight_sync_into_the_tp_copy_equals_slicing_the_full_copy(ranks: list[dict], key: str) -> None:
    cfg = _configs()[key]
    for rank, res in enumerate(ranks):
        assert res[key]["from_shards"]  # each rank cut its pieces from its own shards (FSDP ranks = the TP group)
        got, want = res[key]["tp_copy"], _expected_shard(cfg, res[key]["full_copy"], rank, 2)
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (rank, name)
    # the ranks hold different pieces
    assert not torch.equal(ranks[0][key]["tp_copy"]["lm_head.weight"], ranks[1][key]["tp_copy"]["lm_head.weight"])


def test_a_lora_policy_syncs_merged_into_each_tp_shard() -> None:
    """A LoRA policy's adapters merged (W + scale B A, in fp32) before each rank cuts its piece; in one process, as
    weight sync needs only each rank's place (no group)."""
    cfg = model_shape("tiny")
    policy = _model(cfg, 1)
    apply_lora_(policy, LoRAConfig(rank=4), seed=3)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()  # B starts at zero: make the merge matter
    full = build_model(cfg, seed=None, fused=True)
    sync_weights_(full, policy)
    for rank in range(2):
        shard = build_tensor_parallel_model(cfg, TensorParallel(size=2, rank=rank), "cpu", torch.float32)
        sync_weights_(shard, policy)
        want = _expected_shard(cfg, dict(full.named_parameters()), rank, 2)
        for name, p in shard.named_parameters():
            assert torch.equal(p, want[name]), (rank, name)


def test_a_degree_that_does_not_divide_the_heads_is_refused() -> None:
    cfg = model_shape("tiny")  # 4 heads, 2 kv heads
    with pytest.raises(ValueError) as err:
        check_tensor_parallel(cfg, 3)
    assert "\n" not in str(err.value) and "tensor_parallel_size=3" in str(err.value)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        check_tensor_parallel(cfg, 4)
    with pytest.raises(ValueError, match="needs a tensor-parallel group"):
        Generator(build_model(cfg), GeneratorConfig(tensor_parallel_size=2))
    # a Qwen3.5-MoE shared expert (even with full attention on every layer): not sharded, refused
    moe = cfg.with_family("qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          norm_topk_prob=True, shared_expert_intermediate_size=64)
    with pytest.raises(ValueError, match="shared expert .* not sharded yet"):
        check_tensor_parallel(moe, 2)


def test_full_copy_sync_unchanged_without_tp() -> None:
    """A plain (one-rank) copy carries no placement: sync is the whole-tensor copy it was."""
    model = build_model(model_shape("tiny"), seed=3)
    gen = Generator(model, GeneratorConfig(**GEN), eos_token_ids=())
    other = build_model(model_shape("tiny"), seed=4)
    sync_weights_(gen.model, other)
    assert torch.equal(gen.model.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert getattr(gen.model, "weight_place", None) is None
