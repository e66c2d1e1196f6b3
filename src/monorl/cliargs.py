"""The run config on the command line: a jsonargparse parser built from the config dataclasses (every key as
`--a.b value`, its type, Literal choices, default and one-line description), defaults from `--preset NAME` (or
a resumed run's config), `--config FILE` (YAML or JSON) under the keys given on the command line, and parse
errors condensed to the one line `monorl: error: ...` prints."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser, Namespace, set_loader

from monorl.config import RunConfig, config_from_dict
from monorl.config_docs import cli_type, config_fields, key_doc
from monorl.fsutil import json_safe
from monorl.presets import preset

DEFAULT_PRESET = "tiny"


def _load_value(text: str) -> Any:
    """Command-line values and config files are YAML; `none` (any case) is null too, as it always was here."""
    value = yaml.safe_load(text)
    return None if isinstance(value, str) and value.lower() == "none" else value


set_loader("monorl", _load_value, exceptions=(yaml.YAMLError,))

CONFIG_KEYS = {k: tp for k, tp, _, _ in config_fields(RunConfig)}
# keys a command line or file cannot express (a torch.dtype): programmatic only, left at the base config's value
SKIPPED_KEYS = {k for k, tp in CONFIG_KEYS.items() if not cli_type(tp)}


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `--flag value` / `--flag=value` in argv (the last one), before the parser runs."""
    found = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(f"{flag}="):
            found = a.split("=", 1)[1]
    return found


def base_config(argv: list[str]) -> RunConfig:
    """The preset a command line starts from: `--preset NAME`, else the `preset` key of its (last) `--config`
    file, else tiny. Unknown names raise ValueError listing the presets."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset")
    pre.add_argument("--config", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    name = known.preset
    if name is None and known.config:
        try:
            data = yaml.safe_load(Path(known.config[-1]).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            data = None  # the parser reports an unreadable file
        if isinstance(data, dict) and isinstance(data.get("preset"), str):
            name = data["preset"]
    return preset(name or DEFAULT_PRESET)


def _defaults(cfg: RunConfig) -> dict[str, Any]:
    """{dotted key: value} of every command-line key of `cfg` (sections expanded, dict-valued keys whole)."""
    out: dict[str, Any] = {}
    for key, tp in CONFIG_KEYS.items():
        if key in SKIPPED_KEYS or dataclasses.is_dataclass(tp):
            continue
        v: Any = cfg
        for part in key.split("."):
            v = getattr(v, part)
        out[key] = list(v) if isinstance(v, tuple) else v
    return out


class ConfigParser(ArgumentParser):
    """jsonargparse's parser, with a section printed verbatim after the generated help (the task's arguments,
    which the config holds as one dict-valued key)."""

    help_appendix = ""

    def format_help(self) -> str:
        return super().format_help() + (f"\n{self.help_appendix}" if self.help_appendix else "")


def config_parser(prog: str, description: str, defaults: RunConfig,
                  add_args: Callable[[ArgumentParser], None] | None = None) -> ConfigParser:
    """A parser of every config key (defaults from `defaults`) plus `--config FILE` and a verb's own arguments."""
    # allow_abbrev off: a misspelt key that happens to be a prefix of one is an error, not that key
    p = ConfigParser(prog=prog, description=description, usage=f"{prog} [options]", exit_on_error=False,
                     allow_abbrev=False, parser_mode="monorl")
    if add_args is not None:
        add_args(p)
    p.add_argument("--config", action=ActionConfigFile,
                   help="a YAML or JSON config file (`monorl config --out FILE` writes one); the keys given after it "
                        "override it, the preset (its `preset` key, or --preset) fills in the keys it leaves out")
    p.add_class_arguments(RunConfig, None, skip=set(SKIPPED_KEYS))
    p.set_defaults(_defaults(defaults))
    for action in p._actions:  # descriptions from the config's own comments
        if action.dest in CONFIG_KEYS:
            section = dataclasses.is_dataclass(CONFIG_KEYS[action.dest])  # `--trainer FILE`: works, clutters help
            action.help = argparse.SUPPRESS if section else key_doc(RunConfig, action.dest) or None
    for key, group in p.groups.items():
        if key in CONFIG_KEYS:
            group.title, group.description = key, key_doc(RunConfig, key) or None
        elif group.title and "RunConfig" in group.title:  # the top-level keys ("<class '...RunConfig'>")
            group.title, group.description = "run", None
    _drop_leftovers(p)
    return p


def _drop_leftovers(p: ArgumentParser) -> None:
    """jsonargparse's own options this CLI does not offer (--print_config: `monorl config` prints configs; a
    class-typed key's --KEY.help), and programmatic-only keys that `skip=` does not reach inside sections."""
    for action in list(p._actions):
        if not (action.dest == "print_config" or action.dest in SKIPPED_KEYS
                or any(o.endswith(".help") for o in action.option_strings)):
            continue
        p._remove_action(action)
        for option in action.option_strings:
            p._option_string_actions.pop(option, None)
        for group in p._action_groups:
            if action in group._group_actions:
                group._group_actions.remove(action)


def _is_list(tp: Any) -> bool:
    return tp in (list, tuple) or typing.get_origin(tp) in (list, tuple)


LIST_KEYS = {k for k, tp in CONFIG_KEYS.items() if _is_list(tp)}


def _lists_as_yaml(argv: list[str]) -> list[str]:
    """`--key a,b` for a list-valued key means the list [a,b]; YAML wants brackets."""
    out, i = list(argv), 0
    while i < len(out):
        key, eq, value = out[i].partition("=")
        if key.startswith("--") and key[2:] in LIST_KEYS:
            j = i if eq else i + 1
            raw = value if eq else (out[j] if j < len(out) else None)
            if raw is not None and not raw.lstrip().startswith("["):
                raw = f"[{raw}]" if raw.strip() else "[]"
                out[j] = f"{key}={raw}" if eq else raw
            i = j
        i += 1
    return out


_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _negatives_joined(argv: list[str]) -> list[str]:
    """`--trainer.lr -1e-3` -> `--trainer.lr=-1e-3`: argparse takes a value like -1e-3 for an option (only plain
    -3 and -0.5 pass as numbers), and would report the key as missing its value."""
    out: list[str] = []
    for a in argv:
        if out and _NEGATIVE_NUMBER.match(a) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def parse_config(p: ArgumentParser, argv: list[str], base: RunConfig) -> tuple[RunConfig, Namespace]:
    """(the config: `base` + the file + the command line, validated; the verb's own arguments). A `task.name`
    other than the base's drops the base's task args (they belong to the other task) before `task.args.*` apply."""
    argv = _lists_as_yaml(_negatives_joined(argv))
    try:
        ns = p.parse_args(argv)
        if ns.task.name != base.task.name and base.task.args:
            p.set_defaults({"task.args": {}})
            ns = p.parse_args(argv)
    except ArgumentError as e:
        msg = condense_error(str(e))
        if (files := _config_files(argv)) and re.search(r"(does not accept option|is not accepted)", str(e)):
            msg = f"{files[-1]}: {msg}"  # a key only a config file can have given
        raise ValueError(msg) from None
    data = ns.as_dict()
    if isinstance(args := (data.get("task") or {}).get("args"), dict):
        args.update(_quoted_task_args(argv, args))
    _check_sections(data, _config_files(argv))
    merged = _merge(base.to_dict(), {k: v for k, v in data.items() if k in CONFIG_KEYS})
    cfg = config_from_dict(merged)  # runs every section's checks
    check_finite(cfg)
    verb_args = Namespace({k: v for k, v in data.items() if k not in CONFIG_KEYS and k != "config"})
    return cfg, verb_args


def _quoted_task_args(argv: list[str], parsed: dict[str, Any]) -> dict[str, str]:
    """The `--task.args.NAME VALUE` words whose VALUE is a quoted YAML string ('"a\\nb"' -> a, newline, b): the
    parser keeps a value that loads to a string as typed, quotes and escapes included (a judge template arrived
    as '"Question: ...\\n..."'); quoting is also the way to pass text YAML would read as a mapping ('Score: {x}')."""
    out: dict[str, str] = {}
    for i, word in enumerate(argv):
        key, eq, value = word.partition("=")
        if not key.startswith("--task.args.") or (not eq and i + 1 >= len(argv)):
            continue
        name, raw = key.removeprefix("--task.args."), value if eq else argv[i + 1]
        if len(raw) < 2 or raw[0] not in "\"'" or raw[-1] != raw[0] or parsed.get(name) != raw:
            continue
        try:
            text = yaml.safe_load(raw)
        except yaml.YAMLError:
            continue
        if isinstance(text, str):
            out[name] = text
    return out


def run_config(preset_name: str = DEFAULT_PRESET, overrides: Mapping[str, str] | Sequence[str] = ()) -> RunConfig:
    """The config `monorl train --preset NAME --a.b value ...` runs: preset `preset_name` + `overrides`, given as
    {dotted key: value string} ({"trainer.lr": "1e-6"}) or as command-line words (["--trainer.lr", "1e-6"]), read by
    the CLI's own parser. Unknown keys and bad values raise ValueError with the CLI's one-line message."""
    if isinstance(overrides, str):
        raise TypeError(f"run_config: overrides are a dict or a list of words, got the string {overrides!r}")
    if isinstance(overrides, Mapping):
        overrides = [word for k, v in overrides.items() for word in (f"--{k}", str(v))]
    argv = ["--preset", preset_name, *overrides]
    base = base_config(argv)
    cfg, _ = parse_config(config_parser("monorl", "", base), argv, base)
    return cfg


def section_error(key: str) -> str:
    """A section given a value of its own (`--rollout 5`, or `rollout: 5` in a config file)."""
    return f"--{key} is a section: set one of its keys (--{key}.<name> value), or give it a config file"


def _check_sections(data: dict[str, Any], files: list[str], prefix: str = "") -> None:
    """Every section of the parsed config a mapping: the parser takes `rollout: 5` from a file as the section's value
    (the command line's `--rollout 5` it refuses), which would fail later as an AttributeError."""
    for k, v in data.items():
        if not dataclasses.is_dataclass(CONFIG_KEYS.get(prefix + k)):
            continue
        if not isinstance(v, dict):
            where = f"{files[-1]}: " if files else ""
            raise ValueError(f"{where}{section_error(prefix + k)}; got {v!r}")
        _check_sections(v, files, f"{prefix}{k}.")


def _merge(base: dict[str, Any], new: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`new` over `base`, section by section (a dict-valued key such as task.args is replaced whole)."""
    out = dict(base)
    for k, v in new.items():
        section = dataclasses.is_dataclass(CONFIG_KEYS.get(prefix + k)) and isinstance(v, dict)
        out[k] = _merge(base.get(k) or {}, v, f"{prefix}{k}.") if section else v
    return out


def check_finite(cfg: Any, prefix: str = "") -> None:
    """nan / inf pass every `x > 0` check and poison a run silently: no float key may hold one."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            check_finite(v, f"{prefix}{f.name}.")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"bad value {v} for --{prefix}{f.name}: expected a finite number")


# ---- one-line errors -------------------------------------------------------------------------------------------

def _type_words(text: str) -> str:
    """jsonargparse's type text -> words: "<class 'float'>" -> float, NoneType -> null."""
    text = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text)
    return text.replace("NoneType", "null").replace("typing.", "")


def _unknown_key(token: str) -> str:
    key = token.removeprefix("--").split("=", 1)[0]
    parts = key.split(".")
    known = [k for k in CONFIG_KEYS if k not in SKIPPED_KEYS]
    section = ""
    for i in range(len(parts) - 1, 0, -1):  # the deepest existing section the key names
        if dataclasses.is_dataclass(CONFIG_KEYS.get(".".join(parts[:i]))):
            section = ".".join(parts[:i])
            break
    there = sorted(k.rsplit(".", 1)[-1] for k in known
                   if k.rsplit(".", 1)[0] == section if "." in k) if section else \
        sorted(k for k in known if "." not in k)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean --{close[0]}?)" if close else ""
    return (f"unknown config key --{key}: {section or 'the run config'} has no {parts[-1]!r}{hint}; "
            f"valid keys there: {', '.join(there)} (monorl VERB --help lists them all)")


def _config_files(argv: list[str]) -> list[str]:
    """The --config files of a command line, in order."""
    return [a.split("=", 1)[1] if "=" in a else argv[i + 1] for i, a in enumerate(argv)
            if (a == "--config" and i + 1 < len(argv)) or a.startswith("--config=")]


def condense_error(msg: str) -> str:
    """One line from a jsonargparse error (which may span several), in this CLI's words."""
    if m := re.match(r"unrecognized arguments: (\S+)", msg):
        return _unknown_key(m.group(1))
    if m := re.search(r"Group '([\w.]+)' does not accept option '(\w+)'", msg):  # a config file's typo
        return _unknown_key(f"--{m.group(1)}.{m.group(2)}")
    if m := re.match(r"Option '(\w+)' is not accepted", msg):  # the same at the top level
        return _unknown_key(f"--{m.group(1)}")
    if m := re.match(r"argument (\S+): expected one argument", msg):
        return f"missing value for {m.group(1)}"
    if m := re.match(r'Parser key "([^"]+)":', msg):
        key = m.group(1)
        value = re.search(r"(?:Got|Given) value: (.*)", msg)
        shown = repr(value.group(1).strip()) if value else "?"
        if lit := re.search(r"Expected a (?:typing\.)?Literal\[(.*?)\]", msg):
            choices = ", ".join(c.strip(" '\"") for c in lit.group(1).split(","))
            if re.search(r"Subtypes: \[.*bool", msg):  # bool | Literal[...]: true and false are values too
                choices = f"true, false, {choices}"
            return f"--{key}: {key} must be one of {choices}, got {shown}"
        if "Unable to load config" in msg:
            return section_error(key)
        if value and value.group(1).strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
            return f"bad value {shown} for --{key}: expected a finite number"
        if sub := re.search(r"Subtypes: \[(.*?)\]", msg):
            expected = " or ".join(_type_words(t.strip()) for t in sub.group(1).split(", "))
        elif exp := re.search(r"Expected a (.*?)\. Got value", msg):
            expected = _type_words(exp.group(1))
        else:
            return f"--{key}: " + " ".join(msg.split(":", 1)[1].split())
        return f"bad value {shown} for --{key}: expected {expected}"
    return " ".join(msg.split())


# ---- config files ----------------------------------------------------------------------------------------------

def config_file_text(cfg: RunConfig, fmt: str = "yaml") -> str:
    """`cfg` as a config file `--config` reads back to the same config: JSON, or YAML with each key's description
    as a comment."""
    data = json_safe(cfg.to_dict())
    for key in SKIPPED_KEYS:  # not expressible in a file; the parser would refuse them
        *sections, last = key.split(".")
        node = data
        for s in sections:
            node = node[s]
        node.pop(last, None)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    lines = [f"# monorl run config: monorl train --config FILE (keys given after it override it); preset "
             f"{cfg.preset!r} fills in any key left out"]

    def emit(d: dict[str, Any], prefix: str, pad: str) -> None:
        for k, v in d.items():
            key = prefix + k
            doc = key_doc(RunConfig, key)
            comment = f"  # {doc}" if doc else ""
            if dataclasses.is_dataclass(CONFIG_KEYS.get(key)):
                lines.append(f"{pad}{k}:{comment}")
                emit(v, f"{key}.", pad + "  ")
            else:
                text = yaml.safe_dump(v, default_flow_style=True, width=1 << 30, sort_keys=False).strip()
                lines.append(f"{pad}{k}: {text.removesuffix('...').strip()}{comment}")

    emit(data, "", "")
    return "\n".join(lines) + "\n"
