"""Generator on CPU: HF greedy parity, log-prob parity with a full forward, seeded sampling, prefix
sharing, stops, continuous batching and KV budget errors. Tiny random HF checkpoints, fp32."""

from __future__ import annotations

import pytest
import torch

from monorl.distributed.weight_sync import weight_pairs
from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.generate.runner import static_prefill_pack
from monorl.generate.sampling import gumbel_noise, sample, sequence_key
from monorl.model.attention import VarlenContext
from monorl.model.hf_checkpoint import load_checkpoint
from monorl.model.logprobs import token_logprobs
from monorl.model.pack_layout import bucket_size
from monorl.model.tokenizer import eos_ids

PROMPT_LENS = [3, 17, 9, 33, 1]


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def ckpt(make_hf_checkpoint):
    # eos 1; a tied, GQA tiny model. Logits are O(1) (conftest.randomize_hf_model), so greedy is not degenerate.
    return make_hf_checkpoint(tie_word_embeddings=True, num_hidden_layers=2, eos_token_id=1)


@pytest.fixture
def model(ckpt):
    return load_checkpoint(ckpt)


def gen(model, eos=(1,), tokenizer=None, **kw) -> Generator:
    cfg = dict(max_num_seqs=8, max_model_len=256, block_size=4)
    cfg.update(kw)
    return Generator(model, GeneratorConfig(**cfg), tokenizer=tokenizer, eos_token_ids=eos)


def test_greedy_matches_hf_generate(ckpt, model, load_hf_model):
    hf = load_hf_model(ckpt)
    prompts = prompts_of(PROMPT_LENS, model.config.vocab_size)
    out = gen(model).generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0))
    lengths = []
    for p, [c] in zip(prompts, out, strict=True):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                          max_new_tokens=24, eos_token_id=1, pad_token_id=0)[0, len(p):].tolist()
        assert c.token_ids == ref
        assert c.finish_reason == ("stop" if ref[-1] == 1 else "length")
        lengths.append(len(ref))
    assert max(lengths) == 24 and len({tuple(c.token_ids) for [c] in out}) == len(prompts)  # not degenerate


def full_forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor(prompt + completion)
    ctx = VarlenContext.from_lengths([len(ids)], "cpu")
    with torch.no_grad():
        logits = model.compute_logits(model(ids, ctx.positions, ctx))
    L = len(prompt)
    return token_logprobs(logits[L - 1:L - 1 + len(completion)], torch.tensor(completion), temperature)


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5)])
def test_logprobs_match_full_forward(model, temperature, top_p, top_k):
    prompts = prompts_of([5, 12, 20], model.config.vocab_size, seed=1)
    sp = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=top_p, top_k=top_k, seed=3,
                        ignore_eos=True)
    out = gen(model).generate(prompts, sp, n=3)
    for p, comps in zip(prompts, out, strict=True):
        for c in comps:
            ref = full_forward_logprobs(model, p, c.token_ids, sp.logprob_temperature)
            assert len(c.logprobs) == len(c.token_ids) == 16
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible_and_batch_independent(model):
    prompts = prompts_of([6, 14, 3], model.config.vocab_size, seed=2)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    a = gen(model).generate(prompts, sp, n=4)
    b = gen(model).generate(prompts, sp, n=4)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    # samples of one prompt differ from each other, and a different seed gives different samples
    assert len({tuple(c.token_ids) for c in a[0]}) == 4
    c = gen(model).generate(prompts, SamplingParams(**{**sp.__dict__, "seed": 8}), n=4)
    assert [x.token_ids for x in c[0]] != [x.token_ids for x in a[0]]
    # a sample depends on (seed, prompt index, sample index) only: not on slots or what else runs
    d = gen(model, max_num_seqs=3).generate(prompts, sp, n=4)
    assert [[c.token_ids for c in g] for g in d] == [[c.token_ids for c in g] for g in a]
    e = gen(model).generate(prompts[:1], sp, n=4)
    assert [c.token_ids for c in e[0]] == [c.token_ids for c in a[0]]


def test_prefix_sharing_n_greedy_equals_separate_runs(model, monkeypatch):
    prompts = prompts_of([13, 8], model.config.vocab_size, seed=3)  # 13 = 3 full blocks + a partial one
    g = gen(model)
    prefilled: list[int] = []
    orig = g.runner.prefill

    def counting_prefill(ps, slots, **kw):
        prefilled.extend(len(p) for p in ps)
        return orig(ps, slots, **kw)

    monkeypatch.setattr(g.runner, "prefill", counting_prefill)
    sp = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    shared = g.generate(prompts, sp, n=4)
    assert prefilled == [13, 8]  # each prompt prefilled once for its 4 samples
    for p, comps in zip(prompts, shared, strict=True):
        [[alone]] = gen(model).generate([p], sp)
        assert all(c.token_ids == alone.token_ids for c in comps)
        torch.testing.assert_close(torch.tensor(comps[3].logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    assert g.cache.blocks.num_free() == g.cache.blocks.usable_blocks  # every block came back


def test_prefix_sharing_shares_blocks(model):
    g = gen(model, max_num_seqs=8)
    sched_peak = []
    orig = g.runner.decode

    def spy(live, width, params):
        sched_peak.append(g.cache.blocks.usable_blocks - g.cache.blocks.num_free())
        return orig(live, width, params)

    g.runner.decode = spy
    prompt = prompts_of([40], model.config.vocab_size)[0]  # 10 full blocks of 4
    g.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True), n=8)
    # shared: 10 prompt blocks + 8 * 1 own block (positions 40..42), not 8 * 11
    assert max(sched_peak) == 10 + 8


def test_stop_tokens(model):
    prompts = prompts_of([7, 11], model.config.vocab_size, seed=4)
    free = gen(model, eos=()).generate(prompts, SamplingParams(max_new_tokens=30, temperature=0.0))
    stop = free[0][0].token_ids[5]  # a token the first completion emits at step 6
    first = free[0][0].token_ids.index(stop)
    for interval in (1, 4):
        out = gen(model, eos=(), stop_check_interval=interval).generate(
            prompts, SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=(stop,)))
        c = out[0][0]
        assert c.token_ids == free[0][0].token_ids[:first + 1] and c.finish_reason == "stop"
        assert len(c.logprobs) == len(c.token_ids)
        other = free[1][0].token_ids
        k = other.index(stop) + 1 if stop in other else len(other)
        assert out[1][0].token_ids == other[:k]
    # eos from the generator, and ignore_eos
    eos_out = gen(model, eos=(stop,)).generate(prompts[:1], SamplingParams(max_new_tokens=30, temperature=0.0))
    assert eos_out[0][0].token_ids == free[0][0].token_ids[:first + 1]
    ign = gen(model, eos=(stop,)).generate(prompts[:1], SamplingParams(max_new_tokens=30, temperature=0.0,
                                                                         ignore_eos=True))
    assert ign[0][0].token_ids == free[0][0].token_ids and ign[0][0].finish_reason == "length"


class LetterTokenizer:
    """id -> one letter; enough for stop strings."""

    eos_token_ids = ()

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings(model):
    tok = LetterTokenizer()
    prompt = prompts_of([9], model.config.vocab_size, seed=5)
    free = gen(model, eos=(), tokenizer=tok).generate(prompt, SamplingParams(max_new_tokens=30, temperature=0.0))
    text = free[0][0].text
    assert text == tok.decode(free[0][0].token_ids)
    stop_str = text[6:8]
    cut = text.index(stop_str)
    for interval in (1, 5):
        out = gen(model, eos=(), tokenizer=tok, stop_check_interval=interval).generate(
            prompt, SamplingParams(max_new_tokens=30, temperature=0.0, stop_strings=("zzzzzz", stop_str)))
        c = out[0][0]
        assert c.finish_reason == "stop"
        assert c.token_ids == free[0][0].token_ids[:cut + 2]  # up to the token that completes the stop string
        assert c.text == text[:cut]
    with pytest.raises(ValueError, match="tokenizer"):
        gen(model).generate(prompt, SamplingParams(stop_strings=("x",)))


def test_more_sequences_than_slots(model):
    prompts = prompts_of([5, 30, 2, 17, 9, 11, 4], model.config.vocab_size, seed=6)
    for sp in (SamplingParams(max_new_tokens=15, temperature=0.0),
               SamplingParams(max_new_tokens=15, temperature=0.9, top_k=20, seed=1)):
        ref = gen(model, max_num_seqs=32).generate(prompts, sp, n=3)
        # 2 slots; and a KV budget that holds ~3 sequences, so admission also waits on memory
        g = gen(model, max_num_seqs=2, stop_check_interval=3)
        small = gen(model, max_num_seqs=6, kv_cache_bytes=g.cache.kv[:, :, :40].numel() * 4)
        for eng in (g, small):
            out = eng.generate(prompts, sp, n=3)
            assert [[c.token_ids for c in x] for x in out] == [[c.token_ids for c in x] for x in ref]
            assert [[c.finish_reason for c in x] for x in out] == [[c.finish_reason for c in x] for x in ref]
            assert eng.cache.blocks.num_free() == eng.cache.blocks.usable_blocks


def test_deferred_ring_reads_equal_reads_before_the_next_steps(model):
    """Without stops the engine queues the next decode steps before it reads the last ones' tokens
    (`Generator.defer_ring_reads`): tokens, log-probs and finish reasons are the ones of reading first, with slots
    freed, moved and refilled by admissions mid-run, and every block comes back."""
    prompts = prompts_of([5, 30, 2, 17, 9, 11, 4], model.config.vocab_size, seed=8)
    sps = [SamplingParams(max_new_tokens=m, temperature=0.9, seed=s, ignore_eos=True)
           for m, s in ((5, 1), (23, 2), (9, 3), (1, 4), (14, 5), (30, 6), (7, 7))]
    outs = []
    for defer in (True, False):
        g = gen(model, max_num_seqs=4)
        g.defer_ring_reads = defer
        outs.append(g.generate(prompts, sps, n=2))
        assert g.cache.blocks.num_free() == g.cache.blocks.usable_blocks
    (a, b) = outs
    for x, y in zip(a, b, strict=True):
        assert [c.token_ids for c in x] == [c.token_ids for c in y]
        assert [c.logprobs for c in x] == [c.logprobs for c in y]
        assert [c.finish_reason for c in x] == [c.finish_reason for c in y] == ["length", "length"]
    assert [len(x[0].token_ids) for x in a] == [sp.max_new_tokens for sp in sps]


def test_per_prompt_sampling_params(model):
    prompts = prompts_of([6, 19, 4], model.config.vocab_size, seed=7)
    sps = [SamplingParams(max_new_tokens=m, temperature=0.9, seed=s, ignore_eos=True)
           for m, s in ((5, 1), (17, 2), (9, 3))]
    out = gen(model, max_num_seqs=2).generate(prompts, sps, n=2)
    for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)):
        assert [len(c.token_ids) for c in out[i]] == [sp.max_new_tokens] * 2
        # prompt index is part of the sample key: compare with the same prompt at the same index
        alone = gen(model).generate(prompts[:i] + [p], sps[:i] + [sp], n=2)[i]
        assert [c.token_ids for c in alone] == [c.token_ids for c in out[i]]
    with pytest.raises(ValueError, match="temperature"):
        gen(model).generate(prompts[:2], [sps[0], SamplingParams(temperature=0.5)])


def test_kv_budget_and_length_errors(model):
    g = gen(model, kv_cache_bytes=None, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        g.generate([[3] * 50], SamplingParams(max_new_tokens=20))
    tiny = gen(model, kv_cache_bytes=6 * gen(model).cache.kv[:, :, :1].numel() * 4)  # 5 usable blocks of 4
    with pytest.raises(ValueError, match="KV blocks"):
        tiny.generate([[3] * 10], SamplingParams(max_new_tokens=20))
    # 3 prompt blocks + 2 own per sample: one sample at a time fits, the others wait for its blocks
    out = tiny.generate([[3] * 10], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True), n=3)
    assert all(c.token_ids == out[0][0].token_ids and len(c.token_ids) == 4 for c in out[0])
    assert tiny.cache.blocks.num_free() == tiny.cache.blocks.usable_blocks
    with pytest.raises(ValueError, match="empty"):
        g.generate([[]], SamplingParams())


def test_load_weights_in_place(model):
    g = Generator(model, GeneratorConfig(max_num_seqs=2, max_model_len=64, dtype="bfloat16"))
    assert g.model is not model and all(p.dtype == torch.bfloat16 for p in g.model.parameters())
    ptrs = [p.data_ptr() for p in g.model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    g.load_weights_(model)
    assert [p.data_ptr() for p in g.model.parameters()] == ptrs
    for name, view, src in weight_pairs(g.model, model):
        assert torch.equal(view, src.to(torch.bfloat16)), name
    same = Generator(model, GeneratorConfig(max_num_seqs=2, max_model_len=64))
    assert same.model is not model and same.dtype == torch.float32  # its own copy, even in the model's dtype


def test_eos_ids_from_tokenizer_or_model_config(model):
    assert eos_ids(LetterTokenizer()) == ()
    assert eos_ids(None, model.config) == (1,) == gen(model, eos=None).eos_token_ids  # the checkpoint's config
    assert gen(model, eos=()).eos_token_ids == ()  # given explicitly: no eos at all
    tok = LetterTokenizer()
    tok.eos_token_ids, tok.eos_token_id = [], 5
    assert eos_ids(tok, model.config) == (5,)
    tok.eos_token_ids = [7, 5]
    assert eos_ids(tok, model.config) == (7, 5) == gen(model, eos=None, tokenizer=tok).eos_token_ids


def test_sampler_distribution_and_truncation():
    torch.manual_seed(0)
    V, N = 8, 40000
    logits = torch.randn(1, V).expand(N, V) * 2
    keys = torch.tensor([sequence_key(0, 0, i) for i in range(N)])
    pos = torch.full((N,), 5)
    probs = torch.softmax(logits[0] / 0.8, -1)
    tok, lp = sample(logits, keys, pos, SamplingParams(temperature=0.8))
    freq = torch.bincount(tok, minlength=V).float() / N
    assert (freq - probs).abs().max() < 0.015
    torch.testing.assert_close(lp, probs.log()[tok])  # log-prob of the untruncated, tempered distribution
    order = probs.argsort(descending=True)
    tok_k, _ = sample(logits, keys, pos, SamplingParams(temperature=0.8, top_k=3))
    assert set(tok_k.tolist()) == set(order[:3].tolist())
    nucleus = int((probs[order].cumsum(0) < 0.7).sum()) + 1
    tok_p, _ = sample(logits, keys, pos, SamplingParams(temperature=0.8, top_p=0.7))
    assert set(tok_p.tolist()) == set(order[:nucleus].tolist())
    renorm = probs[order[:nucleus]] / probs[order[:nucleus]].sum()
    freq_p = torch.bincount(tok_p, minlength=V).float()[order[:nucleus]] / N
    assert (freq_p - renorm).abs().max() < 0.015
    greedy, _ = sample(logits[:4], keys[:4], pos[:4], SamplingParams(temperature=0.0))
    assert (greedy == order[0]).all()


def test_gumbel_noise_is_a_function_of_key_and_position():
    keys, pos = torch.tensor([11, 11, 12]), torch.tensor([3, 4, 3])
    a = gumbel_noise(keys, pos, 50)
    assert torch.equal(a, gumbel_noise(keys, pos, 50))
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert torch.equal(gumbel_noise(keys[1:], pos[1:], 50), a[1:])


@pytest.mark.parametrize("lengths", [(37, 50, 21), (64,), (1, 1), (300, 5, 17, 2, 90)])
def test_static_prefill_pack_only_adds_filler(model, lengths):
    """The static pack of a CUDA prefill keeps the prompts first and in order, adds filler sequences (token 0, slot 0:
    the scratch block's) up to a token bucket and zero-length entries up to a power-of-two count; the prompts'
    hidden states in it equal the unpadded pack's (a filler sequence attends only to itself)."""
    prompts = prompts_of(list(lengths), model.config.vocab_size)
    slots = [list(range(1000 * i + 4, 1000 * i + 4 + n)) for i, n in enumerate(lengths)]
    ids, flat, seq_lengths, max_seqlen = static_prefill_pack(prompts, slots)
    real = sum(lengths)
    assert ids[:real] == [t for p in prompts for t in p] and flat[:real] == [s for ss in slots for s in ss]
    assert len(ids) == len(flat) == sum(seq_lengths) == bucket_size(real, 64)
    assert set(ids[real:]) <= {0} and set(flat[real:]) <= {0}
    assert seq_lengths[:len(lengths)] == list(lengths) and max(seq_lengths) <= max_seqlen
    assert len(seq_lengths) >= 8 and len(seq_lengths) & (len(seq_lengths) - 1) == 0

    def hidden(ids: list[int], seq_lengths: list[int], max_seqlen: int | None) -> torch.Tensor:
        ctx = VarlenContext.from_lengths(seq_lengths, "cpu", max_seqlen=max_seqlen)
        with torch.no_grad():
            return model(torch.tensor(ids), ctx.positions, ctx)

    torch.testing.assert_close(hidden(ids, seq_lengths, max_seqlen)[:real], hidden(ids[:real], list(lengths), None),
                               rtol=1e-5, atol=1e-5)


def test_trace_kernels_leaves_the_generator_as_it_was(model):
    """The pass `monorl.speedups.precompile` traces runs on a scratch KV cache and runner: the generator's own cache,
    decode state and results are untouched."""
    prompts = prompts_of([5, 9], model.config.vocab_size)
    sp = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=1)
    g = gen(model)
    expected = g.generate(prompts, sp, n=2)
    kv = g.cache.kv.clone()
    g.trace_kernels(prompts, [sp, SamplingParams(max_new_tokens=4, temperature=0.0)], n=2)
    assert torch.equal(g.cache.kv, kv)
    got = g.generate(prompts, sp, n=2)
    assert [[c.token_ids for c in row] for row in got] == [[c.token_ids for c in row] for row in expected]


def test_decode_splits_fill_idle_sms_only():
    """The default mode's decode splits a row's keys only when rows * kv heads leave SMs idle: a power of two,
    capped, 1 once the rows fill the GPU (the batch-invariant decode never splits)."""
    from monorl.ops.attention.kernel import decode_splits
    from monorl.ops.tunables import HOPPER, tuned

    MAX_SPLITS = tuned("attention.max_splits", HOPPER)
    picks = {rows: decode_splits(rows, 8, 132, chip=HOPPER) for rows in (1, 8, 32, 40, 64, 128, 256, 1024)}
    assert picks[40] == picks[256] == picks[1024] == 1 and picks[1] == MAX_SPLITS and picks[32] == 8
    assert all(s & (s - 1) == 0 and 1 <= s <= MAX_SPLITS for s in picks.values())
    assert list(picks.values()) == sorted(picks.values(), reverse=True)
    # a sliding-window layer's few keys: at most `attention.window_split_keys` a split (never more than the rest)
    per = tuned("attention.window_split_keys", HOPPER)
    for window in (per // 2, 2 * per, 4 * per, 64 * per):
        for rows in (1, 8, 32):
            got = decode_splits(rows, 1, 132, chip=HOPPER, window=window)
            assert got == min(decode_splits(rows, 1, 132, chip=HOPPER), max(1, window // per)), (window, rows)


def test_gumbel_noise_is_finite_for_every_hash():
    """Every 32-bit hash class maps to a uniform strictly inside (0, 1) in fp32, so every noise is finite: the
    former (top 24 bits + 0.5) / 2**24 rounded the largest to 1.0, an infinite noise for one hash in 2**24."""
    from monorl.generate.sampling import uniform_from_hash

    x = torch.arange(0, 1 << 24, dtype=torch.int64) << 8 | 0xFF  # every top-24-bit class, low bits set
    u = uniform_from_hash(x)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    g = -torch.log(-torch.log(u))
    assert torch.isfinite(g).all() and float(g.max()) < 17.0


def test_a_large_vocabulary_never_samples_a_token_with_no_mass():
    """Gemma 3's 262,144 tokens, one holding all the mass at T = 0.8 (the others 40 logits below: e^-50 each):
    no row may pick another. With the infinite noise above, 1.6% of rows took a uniformly random token (RL on
    Gemma-3-270M then trained on that junk, its tails filled with it, and its accuracy fell: H100, 2026-12-07)."""
    V, rows = 262144, 512
    logits = torch.full((64, V), -40.0)
    logits[:, 7] = 0.0
    picked = []
    for s in range(0, rows, 64):
        keys = torch.tensor([sequence_key(3, s + i, 0) for i in range(64)])
        tok, _ = sample(logits, keys, torch.arange(64) + s, SamplingParams(temperature=0.8))
        picked.append(tok)
    picked = torch.cat(picked)
    assert (picked == 7).all(), f"{int((picked != 7).sum())} of {rows} rows sampled a token with no mass"
