"""Tokenizers: a real HF-style tokenizer built here with the `tokenizers` library (byte-level BPE, Qwen's
special tokens and a Qwen-like chat template), checked against transformers' own tokenizer, and the
built-in CharTokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from monorl.model.hf_checkpoint import load_tokenizer
from monorl.model.tokenizer import CharTokenizer, HFTokenizer, TokenizerError

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the sum of the digits of 12345? The answer is 15.",
    "Language models learn from reinforcement learning with verifiable rewards.",
    "def add(a, b):\n    return a + b\n",
    "Héllo wörld, naïve café: unicode text ✓",
] * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2.5/Qwen3-like: optional system, tools through tojson, raise_exception, enable_thinking kwarg.
TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
    {%- if message.role != 'system' or not loop.first %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
EXPECTED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4<|im_end|>\n"
    "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
)


def build_bpe() -> Tokenizer:
    """Byte-level BPE trained on SENTENCES; special tokens added after training (ids at the end, as in Qwen)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def write_tokenizer_dir(path: Path, template: str | None = "config", eos_form: str = "str",
                        generation_eos: bool = True) -> Path:
    """An HF tokenizer directory. template: "config" (in tokenizer_config.json), "file" (chat_template.jinja)
    or None. eos_form: "str" or "dict" (AddedToken form)."""
    path.mkdir(parents=True, exist_ok=True)
    tok = build_bpe()
    tok.save(str(path / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    eos = "<|im_end|>" if eos_form == "str" else {"content": "<|im_end|>", "lstrip": False, "normalized": False,
                                                   "rstrip": False, "single_word": False, "__type": "AddedToken"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": eos,
        "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for s, i in ids.items()},
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    if template == "config":
        config["chat_template"] = TEMPLATE
    elif template == "file":
        (path / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if generation_eos:
        gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "bos_token_id": ids["<|endoftext|>"]}
        (path / "generation_config.json").write_text(json.dumps(gen), encoding="utf-8")
    return path


@pytest.fixture
def tok_dir(tmp_path) -> Path:
    return write_tokenizer_dir(tmp_path / "tok")


@pytest.fixture
def hf_oracle():
    import transformers

    return lambda path: transformers.AutoTokenizer.from_pretrained(path)


TEXTS = ["The quick brown fox.", "sum of 12345 = 15\n", "  leading spaces and ✓ unicode", "", "naïve café"]


# ---- HFTokenizer -----------------------------------------------------------------------------------

def test_encode_decode_round_trip_and_matches_transformers(tok_dir, hf_oracle):
    tok, ref = load_tokenizer(tok_dir), hf_oracle(tok_dir)
    assert isinstance(tok, HFTokenizer)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert len(tok.encode("The quick brown fox.")) < len("The quick brown fox.")  # merges are used
    assert tok.vocab_size == len(ref)


def test_special_tokens_and_eos(tok_dir, hf_oracle):
    tok, ref = load_tokenizer(tok_dir), hf_oracle(tok_dir)
    im_start, im_end, eot = (tok.token_to_id(s) for s in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert tok.vocab_size - 3 <= min(im_start, im_end, eot)  # added after the trained vocabulary
    assert tok.eos_token_id == im_end == ref.eos_token_id
    assert tok.eos_token_ids == [im_end, eot]  # tokenizer eos first, then generation_config's extras
    assert tok.pad_token_id == eot and tok.bos_token_id is None
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == im_start and ids[-1] == im_end and ids == ref.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_dict_form_eos_and_no_generation_config(tmp_path):
    tok = load_tokenizer(write_tokenizer_dir(tmp_path / "tok", eos_form="dict", generation_eos=False))
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == [tok.eos_token_id]


def test_chat_template(tok_dir, hf_oracle):
    tok, ref = load_tokenizer(tok_dir), hf_oracle(tok_dir)
    assert tok.has_chat_template
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == EXPECTED
    prompt = tok.apply_chat_template(MESSAGES)  # add_generation_prompt defaults to True
    assert prompt == EXPECTED + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(MESSAGES, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tools = [{"name": "add", "description": "add two numbers", "parameters": {"a": "int", "b": "int"}}]
    for kw in [{}, {"add_generation_prompt": False}, {"enable_thinking": False}, {"tools": tools}]:
        assert tok.apply_chat_template(MESSAGES, **kw) == ref.apply_chat_template(
            MESSAGES, tokenize=False, **{"add_generation_prompt": True, **kw})
    with_tools = tok.apply_chat_template(MESSAGES, tools=tools)
    assert json.dumps(tools[0]) in with_tools  # the tojson filter: plain json.dumps, no HTML escaping


def test_chat_template_raise_exception_and_sandbox(tok_dir):
    tok = load_tokenizer(tok_dir)
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unexpected message role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    tok.chat_template = "{{ messages.append(1) }}"  # templates are untrusted: mutation is refused
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(MESSAGES)


def test_chat_template_jinja_file(tmp_path):
    path = write_tokenizer_dir(tmp_path / "tok", template="file")
    assert "chat_template" not in json.loads((path / "tokenizer_config.json").read_text())
    tok = load_tokenizer(path)
    assert tok.has_chat_template
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == EXPECTED
    tok.save(tmp_path / "saved")  # stays a separate file when saved
    assert (tmp_path / "saved" / "chat_template.jinja").read_text() == TEMPLATE
    assert load_tokenizer(tmp_path / "saved").apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)


def test_no_chat_template(tmp_path):
    tok = load_tokenizer(write_tokenizer_dir(tmp_path / "tok", template=None))
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_save_load_round_trip(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    tok.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    for text in TEXTS + ["<|im_start|>x<|im_end|>"]:
        assert again.encode(text) == tok.encode(text)
    assert (again.eos_token_id, again.pad_token_id, again.vocab_size) == (tok.eos_token_id, tok.pad_token_id,
                                                                         tok.vocab_size)
    assert again.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)


def test_missing_files_and_bad_config(tmp_path, tok_dir):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="tokenizer.json not found"):
        load_tokenizer(tmp_path / "empty")
    (tok_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot parse .*tokenizer_config.json"):
        load_tokenizer(tok_dir)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerError, match=r"eos_token '<\|nope\|>'.*not in the vocabulary"):
        load_tokenizer(tok_dir)
    (tok_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="cannot read .*tokenizer.json"):
        load_tokenizer(tok_dir)


# ---- CharTokenizer ---------------------------------------------------------------------------------

def test_char_tokenizer_round_trip():
    tok = CharTokenizer()
    assert tok.vocab_size <= 128 and (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok.eos_token_ids == [1] and not tok.has_chat_template
    text = "".join(chr(c) for c in range(32, 127)) + "\nsum 1 2 3 = 6\n"
    ids = tok.encode(text)
    assert len(ids) == len(text) and max(ids) < tok.vocab_size and min(ids) >= 3
    assert tok.decode(ids) == text
    assert tok.encode("ab", add_special_tokens=True) == [2] + tok.encode("ab")
    ids = tok.encode("hi<eos>")
    assert ids[-1] == 1 and tok.decode(ids) == "hi<eos>" and tok.decode(ids, skip_special_tokens=True) == "hi"


def test_char_tokenizer_unknown_character():
    with pytest.raises(ValueError, match=r"'é' at position 1"):
        CharTokenizer().encode("hé")
    with pytest.raises(TokenizerError, match="no chat template"):
        CharTokenizer().apply_chat_template(MESSAGES)


def test_char_tokenizer_save_load(tmp_path, hf_oracle):
    tok = CharTokenizer()
    tok.save(tmp_path / "char")
    again = load_tokenizer(tmp_path / "char")
    assert (again.vocab_size, again.eos_token_ids, again.pad_token_id, again.bos_token_id) == (
        tok.vocab_size, tok.eos_token_ids, tok.pad_token_id, tok.bos_token_id)
    for text in ["", "a", "Hello, world!\n  x = 1 + 2<eos>", "<bos>~{}|\n\n"]:
        for special in (False, True):
            assert again.encode(text, add_special_tokens=special) == tok.encode(text, add_special_tokens=special)
        ids = tok.encode(text)
        for skip in (False, True):
            assert again.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    ref = hf_oracle(tmp_path / "char")  # transformers reads it too
    assert ref.encode("a b\n", add_special_tokens=False) == tok.encode("a b\n") and ref.eos_token_id == 1


def test_kept_copy_with_string_merges_loads_the_same_tokenizer(tmp_path, monkeypatch):
    """`read_tokenizer_file`: the first load reads tokenizer.json and a child writes the copy with "a b" merges;
    later loads read the copy and encode and decode the same; a changed file gets a new copy, a damaged copy is
    ignored, and merges that hold a space (where the string form would be ambiguous) are never copied."""
    import monorl.model.tokenizer as T

    cache = tmp_path / "cache"
    monkeypatch.setattr(T, "TOKENIZER_CACHE", cache)
    monkeypatch.setattr(T, "KEEP_COPY_MIN_BYTES", 0)
    read: list[str] = []

    class Spy:
        @staticmethod
        def from_file(path: str) -> Tokenizer:
            read.append(path)
            return Tokenizer.from_file(path)

    monkeypatch.setattr(T, "_HFTok", Spy)

    def load(d: Path) -> HFTokenizer:
        tok = HFTokenizer.from_dir(d)
        for p in T._copy_writers:
            p.wait(timeout=60)
        return tok

    d = write_tokenizer_dir(tmp_path / "tok")
    original = load(d)
    assert read == [str(d / "tokenizer.json")]
    (copy,) = cache.iterdir()
    spec = json.loads(copy.read_text(encoding="utf-8"))
    assert spec["model"]["merges"] and all(isinstance(m, str) for m in spec["model"]["merges"])
    again = load(d)
    assert read[-1] == str(copy)
    texts = SENTENCES + ["unseen wörds ✓ <|im_end|> and  spaces\n\n", "ĠĠ Ġ"]
    for text in texts:
        assert again.encode(text) == original.encode(text)
        assert again.decode(original.encode(text)) == original.decode(original.encode(text))
    assert again.vocab_size == original.vocab_size and again.eos_token_ids == original.eos_token_ids

    copy.write_text("{damaged", encoding="utf-8")
    load(d)
    assert read[-2:] == [str(copy), str(d / "tokenizer.json")]  # tried, then the original; the copy rewritten
    assert load(d).encode(texts[0]) == original.encode(texts[0]) and read[-1] == str(copy)

    raw = Tokenizer(models.BPE())  # no pre-tokenizer: merges learn spaces, where "a b" strings would be ambiguous
    raw.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    other = tmp_path / "spaced"
    other.mkdir()
    raw.save(str(other / "tokenizer.json"))
    assert any(" " in "".join(m) for m in json.loads((other / "tokenizer.json").read_text())["model"]["merges"])
    load(other)
    assert len(list(cache.iterdir())) == 1  # no copy for it
    load(other)
    assert read[-1] == str(other / "tokenizer.json")
