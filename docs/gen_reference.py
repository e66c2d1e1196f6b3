"""The CLI and config reference pages, generated from the code that defines them: the verbs from `monorl.cli.VERBS`,
every config key (type, default, description) from the config dataclasses through `monorl.config_docs` (the same
comments `monorl VERB --help` shows), and what each preset changes from `monorl.presets.PRESETS`. So a new key, verb
or preset is documented by the comment beside it. Run by the mkdocs hook (docs/hooks.py) at build time, or by hand:
`PYTHONPATH=src python docs/gen_reference.py config` prints the config page."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
if str(SRC) not in sys.path:  # document this checkout's code, not an installed copy elsewhere
    sys.path.insert(0, str(SRC))

from monorl.config import RunConfig, config_diff  # noqa: E402
from monorl.config_docs import cli_type, config_fields, key_doc  # noqa: E402
from monorl.presets import PRESETS  # noqa: E402


def type_text(tp: Any) -> str:
    """A config type in the words `--help` uses: `int`, `str | null`, `grpo | dapo | ...`, `list[str]`."""
    if tp is type(None):
        return "null"
    if tp is typing.Any:
        return "any"
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" if isinstance(a, str) else json.dumps(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_text(a) for a in typing.get_args(tp))
    if origin in (list, tuple, dict):
        args = ", ".join("..." if a is Ellipsis else type_text(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp))


def value_text(v: Any) -> str:
    """A default as it is written on the command line or in a YAML file."""
    if dataclasses.is_dataclass(v):
        return ""
    if isinstance(v, tuple):
        v = list(v)
    try:
        text = json.dumps(v)
    except TypeError:  # a torch.dtype and the like: Python only
        text = str(v)
    return f"`{text}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _value(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def config_page() -> str:
    """Every section and key of the run config, with its type, default and description."""
    defaults = RunConfig()
    keys = list(config_fields(RunConfig))
    sections = [("run", "the run itself: seed, steps, device, where it writes", None)]
    sections += [(k, key_doc(RunConfig, k), tp) for k, tp, _, _ in keys if dataclasses.is_dataclass(tp)]
    out = [
        "# Config reference",
        "",
        "Every key of the run config, generated from the config dataclasses (`src/monorl/config.py` and the sections "
        "it imports) when the documentation is built: the description is the comment beside the field, the same "
        "text `monorl VERB --help` prints. Set a key with a dotted flag (`--trainer.lr 1e-6`) or in a config file "
        "(`--config run.yaml`); values are YAML (`true`, `null` or `none`, numbers, `[a, b]` or `a,b` for lists).",
        "",
        "The defaults below are the dataclasses' own; a preset changes some of them (see "
        "[what each preset sets](#presets)), and `monorl config --preset NAME` prints a preset's full config.",
        "",
    ]
    for name, doc, _tp in sections:
        prefix = "" if name == "run" else f"{name}."
        rows = [(k, tp) for k, tp, _, _ in keys
                if not dataclasses.is_dataclass(tp) and (k.rsplit(".", 1)[0] == name if prefix else "." not in k)]
        if not rows:
            continue
        out += [f"## `{name}`" if prefix else "## run (top-level keys)", ""]
        if doc:
            out += [doc[0].upper() + doc[1:] + ("" if doc.endswith(".") else "."), ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for k, tp in rows:
            desc = key_doc(RunConfig, k)
            if not cli_type(tp):
                desc = f"(Python only: not settable from the command line) {desc}"
            out.append(f"| `{k}` | {type_text(tp)} | {_cell(value_text(_value(defaults, k)))} | {_cell(desc)} |")
        out.append("")
    out += presets_section(defaults)
    return "\n".join(out) + "\n"


def presets_section(defaults: RunConfig) -> list[str]:
    """Each preset's docstring and the keys it sets differently from the dataclass defaults."""
    out = ["## Presets", "", "`monorl presets` lists them; `--preset NAME` starts from one (default: `tiny`).", ""]
    base = defaults.to_dict()
    for name, make in PRESETS.items():
        doc = " ".join((make.__doc__ or "").split())
        out += [f"### `{name}`", ""]
        if doc:
            out += [doc, ""]
        diff = [(k, new) for k, _old, new in config_diff(base, make().to_dict(), ignore=())
                if k != "preset" and isinstance(new, str | int | float | bool | list | dict | None)]  # not: absent
        out += ["| key | value |", "|---|---|"]
        out += [f"| `{k}` | {_cell(value_text(v))} |" for k, v in diff]
        out.append("")
    return out


def cli_page() -> str:
    """The verbs: what each does and an example, from `monorl.cli.VERBS` (what `monorl --help` prints)."""
    from monorl.cli import VERBS

    out = [
        "# Command line",
        "",
        "Generated from the verb table in `src/monorl/cli.py` when the documentation is built. `monorl --help` "
        "lists the verbs, `monorl --version` prints the version, `monorl VERB --help` lists the verb's own options "
        "and every config key with its type, default (the preset's, with `--preset NAME`), allowed values and "
        "description ([config reference](config.md)).",
        "",
        "| verb | what | takes the run config |",
        "|---|---|---|",
    ]
    for name, verb in VERBS.items():
        out.append(f"| `{name}` | {_cell(verb.help)} | {'yes' if verb.config else 'no'} |")
    out += ["", "Examples, one per verb:", "", "```bash"]
    out += [verb.example for verb in VERBS.values()]
    out += ["```", ""]
    for name, verb in VERBS.items():
        rows = verb_options(verb)
        if rows:
            out += [f"## `monorl {name}`: its own options", "", verb.help[0].upper() + verb.help[1:] + ".", "",
                    "| option | default | description |", "|---|---|---|", *rows, ""]
    return "\n".join(out) + "\n"


def verb_options(verb: Any) -> list[str]:
    """Table rows of the options a verb adds beside the config keys (`Verb.add_args`), as its parser holds them."""
    import argparse

    from jsonargparse import ArgumentParser

    if verb.add_args is None:
        return []
    p = ArgumentParser(exit_on_error=False)
    verb.add_args(p)
    rows = []
    for action in p._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}` (positional)"
        default = "" if action.default in (None, argparse.SUPPRESS) else value_text(action.default)
        rows.append(f"| {names} | {_cell(default)} | {_cell(action.help or '')} |")
    return rows


PAGES = {"reference/config.md": config_page, "reference/cli.md": cli_page}

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "config"
    sys.stdout.write(PAGES[f"reference/{which}.md"]())
