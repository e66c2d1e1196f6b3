"""Tokenizers: HF `tokenizer.json` checkpoints (through the `tokenizers` library) and a tiny built-in
character tokenizer for the embedded default model. Chat templates render with a sandboxed jinja2
environment set up the way HF transformers sets it up, so Hub templates render the same text.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, processors
from tokenizers import Tokenizer as _HFTok

from monorl.fsutil import read_json

if TYPE_CHECKING:
    from monorl.model.config import ModelConfig

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded, or a request it cannot serve."""


# ---- chat templates --------------------------------------------------------------------------------

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes; HF templates expect plain json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@cache
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per template string; the environment matches HF's (sandboxed, trim/lstrip blocks)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


# ---- the interface ---------------------------------------------------------------------------------

class Tokenizer:
    """What the rest of monorl needs from a tokenizer. Subclasses set the attributes below and
    implement encode / decode / save."""

    vocab_size: int
    eos_token_id: int | None
    eos_token_ids: list[int]  # every id that ends a generation (eos + generation_config extras)
    pad_token_id: int | None
    bos_token_id: int | None
    chat_template: str | None = None
    special_tokens: dict[str, str]  # e.g. {"eos_token": "<|im_end|>"}: what templates see
    # whether a prompt without a chat template starts with the BOS token (`Task.render`): tokenizer_config.json's
    # add_bos_token (a GGUF's tokenizer.ggml.add_bos_token), as HF's tokenizer adds it to plain text; a chat
    # template writes its own
    add_bos_token: bool = False

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> None:
        raise NotImplementedError

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kw: Any) -> str:
        """Render a conversation to text. Extra keywords (tools, enable_thinking, ...) reach the template."""
        if not self.chat_template:
            raise TokenizerError(f"{type(self).__name__} has no chat template; encode the prompt text directly")
        variables = {**self.special_tokens, "tools": None, "documents": None, **kw}
        return compile_chat_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def eos_ids(tokenizer: Any, model_config: ModelConfig | None = None) -> tuple[int, ...]:
    """The token ids that end a generation (the generator's default stop ids): the tokenizer's `eos_token_ids`,
    else its `eos_token_id`, else the model config's `eos_token_id` (an id or a list), else none."""
    ids = list(getattr(tokenizer, "eos_token_ids", None) or [])
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = [tokenizer.eos_token_id]
    if not ids and model_config is not None and model_config.eos_token_id is not None:
        e = model_config.eos_token_id
        ids = list(e) if isinstance(e, list | tuple) else [e]
    return tuple(int(t) for t in ids)


# ---- HF tokenizer.json -----------------------------------------------------------------------------

def _token_content(value: Any) -> str | None:
    """Special tokens appear as "<s>" or as {"content": "<s>", ...} (AddedToken dict form)."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    # Older configs store several named templates: [{"name": "default", "template": ...}, ...]
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value


# ---- tokenizer.json, read through a kept copy the `tokenizers` library parses faster ----------------------------
# The released Qwen3 tokenizer.json (18.7 MB) writes its 151,387 BPE merges as pairs; the library reads the same
# merges written as "a b" strings ~1/3 faster (from_file 0.88 -> 0.60 s on an H100 machine's host, 0.52 -> 0.31 s
# on the dev box; benchmarks/probe_startup_costs.py), and a run reads it before anything else can start. So a
# child process writes that form once (where it is exact: no merge part holds a space) into TOKENIZER_CACHE, keyed
# by the file's path, size and mtime and the library's version, and later loads read the copy.
TOKENIZER_CACHE = Path.home() / ".cache" / "monorl" / "tokenizers"
KEEP_COPY_MIN_BYTES = 1 << 20  # smaller files load in milliseconds either way
# The child that writes a kept copy: the tokenizer's JSON from the file `src` ("-": on stdin), its merges as "a b"
# strings where no part holds a space; otherwise written as it is only if `always` (a built tokenizer, whose copy
# saves the build), else not at all. Written to a temporary file and moved into place.
_COPY_WRITER = """import json, os, sys
src, dst, always = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
spec = json.loads(sys.stdin.buffer.read() if src == "-" else open(src, "rb").read())
model = spec.get("model") or {}
merges = model.get("merges") or []
faster = model.get("type") == "BPE" and merges and all(
    isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1] for m in merges)
if not faster and not always:
    sys.exit(0)
if faster:
    model["merges"] = [" ".join(m) for m in merges]
os.makedirs(os.path.dirname(dst), exist_ok=True)
tmp = f"{dst}.{os.getpid()}.tmp"
with open(tmp, "w", encoding="utf-8") as f:
    json.dump(spec, f, ensure_ascii=False)
os.replace(tmp, dst)
"""
_copy_writers: list[subprocess.Popen] = []  # kept referenced while they run (tests wait on them)


def kept_copy_path(file: Path, kind: str = "") -> Path | None:
    """Where the kept copy of `file`'s tokenizer goes (`TOKENIZER_CACHE`): keyed by its path, size and mtime, the
    library's version and `kind` (what is kept: "" a tokenizer.json's faster form; else a tokenizer built from the
    file, e.g. a GGUF's). None for a missing file, or a tokenizer.json too small to gain from a copy."""
    try:
        st = file.stat()
    except OSError:
        return None
    if not kind and st.st_size < KEEP_COPY_MIN_BYTES:
        return None
    key = f"{file.resolve()}|{st.st_size}|{st.st_mtime_ns}|{tokenizers.__version__}"
    key = f"{kind}|{key}" if kind else key
    return TOKENIZER_CACHE / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def write_kept_copy(dst: Path, src: Path | None = None, text: str | None = None) -> None:
    """A child process writes the kept copy `dst` (`_COPY_WRITER`) of the tokenizer.json `src`, or of the built
    tokenizer's JSON `text` (handed over on its stdin; written even where its merges stay pairs)."""
    with contextlib.suppress(OSError):
        args = [sys.executable, "-c", _COPY_WRITER, "-" if src is None else str(src), str(dst), "0" if text is None
                else "1"]
        child = subprocess.Popen(args, stdin=None if text is None else subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        _copy_writers.append(child)
        if text is not None:
            child.stdin.write(text.encode())
            child.stdin.close()


def read_tokenizer_file(file: Path) -> _HFTok:
    """`Tokenizer.from_file`, from the kept copy when there is one (see above); otherwise from `file`, and a child
    process writes the copy for the next load. A copy that does not load is ignored."""
    copy = kept_copy_path(file)
    if copy is not None and copy.is_file():
        try:
            return _HFTok.from_file(str(copy))
        except Exception:  # damaged: read the original (and write the copy again)
            pass
    tok = _HFTok.from_file(str(file))
    if copy is not None:
        write_kept_copy(copy, src=file)
    return tok


class HFTokenizer(Tokenizer):
    """A tokenizer from an HF checkpoint directory: tokenizer.json + tokenizer_config.json (+ optional
    chat_template.jinja, special_tokens_map.json, generation_config.json)."""

    def __init__(self, tok: _HFTok, config: dict[str, Any], chat_template: str | None = None,
                 template_file: str | None = None, generation_eos: list[int] | None = None) -> None:
        self._tok, self._config, self._template_file = tok, config, template_file
        self.chat_template = chat_template if chat_template is not None else _pick_template(config.get("chat_template"))
        self._add_config_tokens(tok, config.get("added_tokens_decoder") or {})
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens = {}
        ids: dict[str, int | None] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            content = _token_content(config.get(key))
            ids[key] = None
            if content is not None:
                tid = tok.token_to_id(content)
                if tid is None:
                    raise TokenizerError(f"{key} {content!r} from {TOKENIZER_CONFIG_FILE} is not in the vocabulary")
                self.special_tokens[key] = content
                ids[key] = tid
        self.bos_token_id, self.eos_token_id, self.pad_token_id = ids["bos_token"], ids["eos_token"], ids["pad_token"]
        self.add_bos_token = bool(config.get("add_bos_token")) and self.bos_token_id is not None
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids = list(dict.fromkeys(eos + list(generation_eos or [])))
        if self.eos_token_id is None and self.eos_token_ids:
            self.eos_token_id = self.eos_token_ids[0]
        # a vocabulary without byte fallback or an unknown token drops characters it lacks, silently: such a
        # tokenizer (the saved CharTokenizer) checks each encoding covers its text, and raises as CharTokenizer does
        probe = "\u00fc\u20ac"
        self._may_drop = len(tok.encode(probe, add_special_tokens=False).ids) == 0

    @staticmethod
    def _add_config_tokens(tok: _HFTok, decoder: dict[str, Any]) -> None:
        """Tokens listed only in tokenizer_config's added_tokens_decoder (HF adds them too)."""
        for tid, spec in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            content = _token_content(spec)
            if content is None or tok.token_to_id(content) is not None:
                continue
            special = bool(spec.get("special", True)) if isinstance(spec, dict) else True
            tok.add_tokens([AddedToken(content, special=special, normalized=False)])
            if tok.token_to_id(content) != int(tid):
                raise TokenizerError(f"added token {content!r} should have id {tid} but would get "
                                     f"{tok.token_to_id(content)}; tokenizer.json and tokenizer_config.json disagree")

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> HFTokenizer:
        p = Path(path)
        if not p.is_dir():
            raise TokenizerError(f"tokenizer directory {p} does not exist")
        if not (p / TOKENIZER_FILE).is_file():
            raise TokenizerError(f"{TOKENIZER_FILE} not found in {p} (monorl reads fast-tokenizer files only)")
        try:
            tok = read_tokenizer_file(p / TOKENIZER_FILE)
        except Exception as e:
            raise TokenizerError(f"cannot read {p / TOKENIZER_FILE}: {e}") from None
        config = read_json(p / TOKENIZER_CONFIG_FILE, TokenizerError) if (p / TOKENIZER_CONFIG_FILE).is_file() else {}
        if (p / SPECIAL_TOKENS_MAP_FILE).is_file():  # legacy file; tokenizer_config.json wins
            config = {**read_json(p / SPECIAL_TOKENS_MAP_FILE, TokenizerError), **config}
        template = None
        if (p / CHAT_TEMPLATE_FILE).is_file():  # newer checkpoints keep the template beside the config
            template = (p / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        gen_eos: list[int] = []
        if (p / GENERATION_CONFIG_FILE).is_file():
            eos = read_json(p / GENERATION_CONFIG_FILE, TokenizerError).get("eos_token_id")
            gen_eos = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(tok, config, chat_template=template, template_file=CHAT_TEMPLATE_FILE if template else None,
                   generation_eos=gen_eos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        if self._may_drop and "".join(self._tok.decode(enc.ids).split()) != "".join(text.split()):
            at = next((i for i, c in enumerate(text)
                       if not c.isspace() and not self._tok.encode(c, add_special_tokens=False).ids), None)
            if at is not None:
                raise ValueError(f"the tokenizer cannot encode {text[at]!r} at position {at}: it is not in its "
                                 "vocabulary")
        return enc.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def save(self, path: str | os.PathLike) -> None:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(p / TOKENIZER_FILE))
        config = dict(self._config)
        if self._template_file:
            (p / self._template_file).write_text(self.chat_template or "", encoding="utf-8")
            config.pop("chat_template", None)
        elif self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (p / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")


# ---- the built-in character tokenizer ---------------------------------------------------------------

class CharTokenizer(Tokenizer):
    """One token per character, no files: `<pad>`=0, `<eos>`=1, `<bos>`=2, then printable ASCII 32..126,
    then '\\n' (99 ids; fits the "tiny" shape's 128-row vocabulary); with `vision`, Qwen-VL's image tokens after
    them (`VISION_TOKENS`: 99, 100, 101, the "tiny-vl" shape's ids). Special-token strings in the text encode to
    their ids (as HF tokenizers do). Any other character raises ValueError. No chat template."""

    SPECIALS = ("<pad>", "<eos>", "<bos>")
    CHARS = tuple(chr(c) for c in range(32, 127)) + ("\n",)
    VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")

    def __init__(self, vision: bool = False) -> None:
        self.pad_token_id, self.eos_token_id, self.bos_token_id = 0, 1, 2
        self.eos_token_ids = [1]
        self.special_tokens = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>"}
        self._specials = self.SPECIALS + (self.VISION_TOKENS if vision else ())
        self._id_to_str = list(self.SPECIALS) + list(self.CHARS) + list(self._specials[len(self.SPECIALS):])
        self._char_to_id = {c: i + len(self.SPECIALS) for i, c in enumerate(self.CHARS)}
        self._special_ids = {s: self._id_to_str.index(s) for s in self._specials}
        self.vocab_size = len(self._id_to_str)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        i = 0
        while i < len(text):
            if text[i] == "<" and (special := next((s for s in self._specials if text.startswith(s, i)), None)):
                ids.append(self._special_ids[special])
                i += len(special)
                continue
            tid = self._char_to_id.get(text[i])
            if tid is None:
                raise ValueError(f"CharTokenizer cannot encode {text[i]!r} at position {i}: it knows printable "
                                 "ASCII and '\\n' only")
            ids.append(tid)
            i += 1
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # ids past the tokenizer (a model's vocab is often padded beyond it) decode to nothing, as in HF
        n, v = len(self.SPECIALS), len(self._id_to_str)
        plain = n + len(self.CHARS)  # ids from here on are the vision tokens: special too
        return "".join(self._id_to_str[int(i)] for i in ids
                       if int(i) < v and not (skip_special_tokens and not n <= int(i) < plain))

    def to_hf(self) -> _HFTok:
        """The same tokenizer as a `tokenizers.Tokenizer` (a merge-free BPE: each character one token).
        Difference: it drops unknown characters instead of raising."""
        tok = _HFTok(models.BPE(vocab={s: i for i, s in enumerate(self._id_to_str)}, merges=[]))
        tok.decoder = decoders.Fuse()  # concatenate tokens (the default decoder joins with spaces)
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in self._specials])
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
        return tok

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json + tokenizer_config.json: HF `AutoTokenizer` and `load_tokenizer` read it back."""
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        self.to_hf().save(str(p / TOKENIZER_FILE))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens,
            "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                                              "single_word": False, "special": True}
                                     for s, i in self._special_ids.items()},
            "model_max_length": 1024,
            "clean_up_tokenization_spaces": False,
        }
        (p / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
