"""The decode measurement the decode benchmarks share (`bench_hybrid_decode.py`, `bench_window_decode.py`): `rows`
prompts of `context` tokens prefilled, then decode chunks of `chunk` engine steps timed (graphs on CUDA, as the
generator's defaults run), the median over `chunks` chunks after a warm one. CUDA events on a GPU; on the CPU (a smoke
run) `time.perf_counter`, and no memory check or peak."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch

from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.generate.cache import kv_cache_bytes_needed
from monorl.generate.engine import Engine

GiB = 1 << 30
BLOCK_SIZE = 16  # GeneratorConfig's default


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds `fn` takes: CUDA events around it on a GPU (then a synchronize), else the wall clock."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def decode_len(context: int, chunk: int, chunks: int) -> int:
    """The max_model_len a case runs with: its prompt, every chunk it decodes, and a margin."""
    return context + chunk * (chunks + 3) + 8


def decode_case(model, rows: int, context: int, chunk: int, chunks: int,
                inspect: Callable[[Engine], dict] | None = None) -> dict:
    """Prefill `rows` prompts of `context` tokens, then time decode chunks of `chunk` steps (engine steps).
    inspect: called with the engine after the timed chunks (its rows still running), its dict added to the result.
    A case whose KV cache needs more than 0.8 x the free GPU memory is returned as {"skipped": why}."""
    cfg = model.config
    p = next(model.parameters())
    cuda = p.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else p.dtype  # the generator's default
    max_len = decode_len(context, chunk, chunks)
    need = kv_cache_bytes_needed(cfg, rows, max_len, BLOCK_SIZE, dtype)
    if cuda:
        free, _ = torch.cuda.mem_get_info()
        if need > 0.8 * free:
            return {"skipped": f"KV cache needs {need / GiB:.1f} GiB, {free / GiB:.1f} GiB free"}
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    gen = Generator(model, GeneratorConfig(max_num_seqs=rows, max_model_len=max_len, kv_cache_bytes=need,
                                           stop_check_interval=chunk))
    engine = Engine(gen)
    g = torch.Generator().manual_seed(context)
    sp = SamplingParams(max_new_tokens=max_len - context, temperature=1.0, seed=1, ignore_eos=True,
                        stop_token_ids=(cfg.vocab_size - 1,))  # a stop: decode chunks of `chunk` steps
    for i in range(rows):
        engine.add(i, torch.randint(0, cfg.vocab_size - 1, (context,), generator=g).tolist(), sp, one_turn=True)
    prefill_s = timed(p.device, engine.step)  # every prompt prefilled (admission rounds), then the first chunk
    engine.step()  # a warm chunk
    times = [timed(p.device, engine.step) for _ in range(chunks)]
    live = len(engine.running)
    med = statistics.median(times)
    out = {"rows": rows, "context": context, "live": live, "prefill_and_first_chunk_s": prefill_s,
           "decode_step_ms": med / chunk * 1e3, "decode_tokens_s": live * chunk / med,
           "kv_cache_gib": gen.cache.allocated_bytes() / GiB,
           "peak_gib": torch.cuda.max_memory_allocated() / GiB if cuda else None}
    if inspect is not None:
        out |= inspect(engine)
    del engine, gen
    free_cuda()
    return out


def free_cuda() -> None:
    """Give back what the last case held (its cache, CUDA graphs and their pools: the engine and generator refer to
    each other, so only a collection frees them) before the next case measures the free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
