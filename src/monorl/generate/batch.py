"""`generate_batch` (`Generator.generate`): prompts -> n completions each, as one-turn requests on a fresh `Engine`.

Sample j of prompt i is request (first_prompt_index + i, j), a member of prompt i's group (the prompt prefilled once,
its blocks shared), finished at its turn's end. Requests are admitted in that order, so the decode and prefill
batches are those of the engine's admission rounds over them.

Log-probs: each returned log-prob is `monorl.model.logprobs.token_logprobs` -- the trainer's function -- of the
sampled token under the temperature-scaled distribution `log_softmax(logits / T)`, before top-k / top-p truncation;
for greedy decoding (temperature 0) T = 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from monorl.generate.cache import blocks_for
from monorl.generate.engine import Engine, EngineHost
from monorl.generate.requests import Completion, completion_of
from monorl.generate.sampling import SamplingParams
from monorl.model.vision_prompt import ImageInputs


@torch.inference_mode()
def generate_batch(gen: EngineHost, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                   n: int = 1, first_prompt_index: int = 0,
                   between_chunks: Callable[[], None] | None = None,
                   images: list[ImageInputs | None] | None = None) -> list[list[Completion]]:
    """For each prompt, n completions (results[prompt][sample]). `sampling` is one SamplingParams for all prompts, or
    one per prompt (those may differ in lengths, stops and seed, not in the sampler). first_prompt_index: the index of
    prompts[0] in the sampling keys (`sequence_key`): a rank generating prompts [k, m) of a batch passes k, so each
    prompt draws the noise it would draw in the whole batch. between_chunks: called after each decode chunk is
    queued, while sequences are in flight; it may load new weights in place (and set `policy_version`): the
    sequences go on with them and keep their KV cache (an in-flight weight update), each token recording the version
    that sampled it (`Completion.versions`). images: each prompt's (`ImageInputs`, its placeholders expanded) or
    None."""
    if gen.cache is None:
        gen.allocate_kv_cache()
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    _validate(gen, prompts, params, n)
    images = [None] * len(prompts) if images is None else list(images)
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} image inputs for {len(prompts)} prompts")
    if not prompts:
        return []
    engine = Engine(gen, max_tokens=max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params, strict=True)),
                    defer_reads=getattr(gen, "defer_ring_reads", False))
    ids = [[(first_prompt_index + i, j) for j in range(n)] for i in range(len(prompts))]
    done: dict[Any, Completion] = {}
    try:
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            for request_id in ids[i]:
                engine.add(request_id, p, sp, one_turn=True, group=("prompt", i), images=images[i])
        while engine.has_work():
            for ev in engine.step():
                done[ev.request_id] = completion_of(gen.tokenizer, engine.finish(ev.request_id))
            if between_chunks is not None and engine.decoded and (engine.running or engine.queue):
                with torch.inference_mode(False):  # it may train (a colocated trainer step); the next chunk runs on
                    between_chunks()               # what it loads
    finally:
        engine.close()  # an exception mid-generation must not leak blocks into the next call
    return [[done[k] for k in row] for row in ids]


def _validate(gen: EngineHost, prompts: list[list[int]], params: list[SamplingParams], n: int) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    if len({sp.sampler_key() for sp in params}) > 1:
        raise ValueError("per-prompt SamplingParams may differ in lengths, stops and seeds, "
                         "not in temperature / top_p / top_k")
    if any(sp.stop_strings for sp in params) and gen.tokenizer is None:
        raise ValueError("stop_strings need a tokenizer (Generator(..., tokenizer=...))")
    assert gen.cache is not None
    V, bs, usable = gen.model.config.vocab_size, gen.cache.block_size, gen.cache.blocks.usable_blocks
    for i, (p, sampling) in enumerate(zip(prompts, params, strict=True)):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if min(p) < 0 or max(p) >= V:
            raise ValueError(f"prompt {i} has token ids outside [0, {V})")
        total = len(p) + sampling.max_new_tokens
        if total > gen.max_model_len:
            raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens {sampling.max_new_tokens} = {total} "
                             f"exceeds max_model_len {gen.max_model_len}")
        # the prompt's blocks (its group's) and a sample's own: what one sample of it needs at worst
        need = blocks_for(len(p), bs) + blocks_for(total - 1, bs) - len(p) // bs
        if need > usable:
            raise ValueError(
                f"prompt {i}: {len(p)} tokens + max_new_tokens {sampling.max_new_tokens} needs {need} KV blocks "
                f"of {bs} tokens, but the KV cache has {usable} (raise GeneratorConfig.kv_cache_bytes or lower "
                f"max_new_tokens)")
