"""`prefill_cached` on CUDA: flash attention over the gathered keys (its causal mask aligned bottom-right) and the
Triton kernel reading the keys through the block tables (paged) are each sequence's causal attention over its cached
prefix and its new tokens, as the per-token decode rows (the Triton paged decode) and an fp32 reference are; the
runner's varlen form equals its decode rows, a whole prefill and (bf16) its paged form, in the static layout a graph
replays (bf16: flash, fp32: SDPA). Episodes end to end in both modes: tests/test_episodes_gpu.py."""

from __future__ import annotations

import pytest
import torch

from monorl.compile import CompileConfig
from monorl.generate.attention import CachedPrefillContext, cached_prefill_attention, decode_attention
from monorl.generate.cache import blocks_for
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from tests.test_cached_prefill import three_ways

pytestmark = pytest.mark.gpu
# (prefix, appended): one-token appends, appends within a 16-token block, across blocks, an episode's later turns
CASES = [(1, 1), (15, 2), (16, 64), (17, 65), (300, 33), (700, 130)]


def test_flash_is_each_sequences_causal_attention():
    """Qwen3-0.6B's heads (16 query, 8 kv, 128 wide), a bf16 paged cache with scattered blocks: flash and the decode
    rows against SDPA in fp32 on the same inputs."""
    torch.manual_seed(0)
    bs, Hq, Hkv, D = 16, 16, 8, 128
    need = [blocks_for(p + n, bs) for p, n in CASES]
    blocks = (torch.randperm(sum(need)) + 1).tolist()  # block 0 is the scratch block
    tables = [blocks[sum(need[:s]):sum(need[:s + 1])] for s in range(len(CASES))]
    cache = torch.randn(2, sum(need) + 1, bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
    chunks, starts = [[0] * n for _, n in CASES], [p for p, _ in CASES]
    T = sum(len(c) for c in chunks)
    q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = {}
    for backend in ("flash", "sdpa"):
        ctx = CachedPrefillContext.build(chunks, starts, tables, bs, torch.device("cuda"), backend)
        f32 = backend == "sdpa"  # the reference: fp32 math on the same (bf16) values
        c = cache.clone().float() if f32 else cache.clone()
        args = (q.float(), k.float(), v.float()) if f32 else (q, k, v)
        out[backend] = cached_prefill_attention(*args, c, ctx.slot_mapping, ctx.key_slots, ctx.cu_seqlens_q,
                                                ctx.cu_seqlens_k, ctx.bounds, ctx.block_tables, backend,
                                                False).float()
    paged = CachedPrefillContext.build(chunks, starts, tables, bs, torch.device("cuda"), "paged")
    out["paged"] = cached_prefill_attention(q, k, v, cache.clone(), paged.slot_mapping, paged.key_slots,
                                            paged.cu_seqlens_q, paged.cu_seqlens_k, paged.bounds, paged.block_tables,
                                            "paged", False).float()
    rows = ctx.decode_rows("triton")
    out["decode"] = decode_attention(q, k, v, cache.clone(), rows.slot_mapping, rows.block_tables, rows.seq_lens,
                                     "triton", False).float()
    torch.testing.assert_close(out["flash"], out["sdpa"], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out["decode"], out["sdpa"], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out["paged"], out["sdpa"], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_varlen_equals_decode_rows_and_whole_prefill(dtype):
    model = build_model(model_shape("tiny"), device="cuda", dtype=dtype, seed=0)
    with torch.no_grad():  # O(1) logits, as tests/test_generate_gpu.py's tiny_cuda_model
        for n, p in model.named_parameters():
            if not n.endswith("norm.weight"):
                p.mul_(5.0)
    gen = Generator(model, GeneratorConfig(max_num_seqs=8, max_model_len=1024, dtype=str(dtype).removeprefix("torch.")),
                    compile=CompileConfig(backend="none"))
    assert gen.runner.prefill_backend == ("flash" if dtype == torch.bfloat16 else "sdpa")
    paged = dtype == torch.bfloat16  # the Triton kernel's dtypes
    assert gen.runner.turn_prefill_form("auto") == ("paged" if paged else "varlen")
    varlen, decode, whole, *more, kv = three_ways(gen, CASES, ways=("varlen", "decode", "whole") + ("paged",) * paged)
    tol = (0.05 if dtype == torch.bfloat16 else 1e-4) * float(whole.abs().max())
    for other in more:  # paged: the same attention, no key gathered
        torch.testing.assert_close(other, whole, atol=tol, rtol=0)
    torch.testing.assert_close(varlen, decode, atol=tol, rtol=0)
    torch.testing.assert_close(varlen, whole, atol=tol, rtol=0)
    kv_tol = (0.05 if dtype == torch.bfloat16 else 1e-4) * float(kv.abs().max())
    torch.testing.assert_close(kv[0], kv[1], atol=kv_tol, rtol=0)
    for i in range(1, len(kv)):
        torch.testing.assert_close(kv[0], kv[i], atol=kv_tol, rtol=0)
