"""Tensor-parallel generation on 2 GPUs (NCCL): decode steps replayed from CUDA graphs with their collectives
captured (the row-parallel all-reduces and the vocabulary all-gather) give the tokens and log-probs eager decoding
gives, on both ranks alike, in the default and the fixed-order (batch-invariant) sums; and stay near one GPU's
(bf16: the row-parallel sums round differently, so the tokens may part after a near tie -- compared loosely)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from monorl.compile import CompileConfig
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.sampling import SamplingParams
from monorl.generate.tensor_parallel import TensorParallel, tensor_parallel_group
from monorl.model.config import model_shape
from monorl.model.decoder import build_model

pytestmark = pytest.mark.gpu
PROMPTS = [[3, 17, 5, 9, 22], [40, 2, 11], [7, 7, 8, 1, 30, 31, 2]]


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tp = tensor_parallel_group(rank, 2, 2)
        cfg = model_shape("tiny")
        model = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if not n.endswith("norm.weight"):
                    p.mul_(5.0)
        gcfg = GeneratorConfig(max_num_seqs=8, max_model_len=128)
        sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        out = {}
        for fixed in (False, True):
            group = TensorParallel(tp.size, tp.rank, tp.group, fixed_order=fixed)
            for graphs in (False, True):
                gen = Generator(model, dataclasses.replace(gcfg, tensor_parallel_size=2), eos_token_ids=(),
                                compile=CompileConfig(decode_cuda_graphs=graphs), tp=group)
                res = gen.generate(PROMPTS, sp, n=2)
                out[(fixed, graphs)] = ([c.token_ids for g in res for c in g], [c.logprobs for g in res for c in g])
                out[(fixed, graphs, "used_graphs")] = bool(gen.runner.graphs)
                gen.release_graphs()  # NCCL kernels in graphs: gone before the group is destroyed (pytorch#115388)
                assert not gen.runner.graphs and not gen.runner.graph_sets
        one = Generator(model, gcfg, eos_token_ids=()).generate(PROMPTS, sp, n=2)
        out["one"] = ([c.token_ids for g in one for c in g], [c.logprobs for g in one for c in g])
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp_decode_graphs_capture_collectives(tmp_path: Path) -> None:
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for fixed in (False, True):
        assert r0[(fixed, True, "used_graphs")]
        assert r0[(fixed, True)] == r0[(fixed, False)], fixed  # graph replay == eager, collectives included
        assert r0[(fixed, True)] == r1[(fixed, True)], fixed  # both ranks alike
    tokens, lps = r0[(True, True)]
    one_tokens, one_lps = r0["one"]
    first = [t[0] for t in tokens]
    assert first == [t[0] for t in one_tokens]  # the prefill's first token: before any drift
    assert abs(lps[0][0] - one_lps[0][0]) < 0.05
