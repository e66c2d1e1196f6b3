"""What each config key means, read from the config dataclasses themselves: the comment beside a field (or the
comment lines just above it) is its one-line description, a section's class docstring describes the section.
`monorl VERB --help` and `monorl config` show these, so a new key documents itself by its comment."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from typing import Any


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: one-line description} from the comments in `cls`'s source: a comment after the field (with
    comment-only lines below it indented past the field or padded, `#   more`: its continuation), else the
    comment-only lines directly above it at the field's indentation."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (built in a REPL, frozen): no descriptions
        return {}
    comments: dict[int, tuple[int, str, bool]] = {}  # line -> (column, text, padded)
    code_lines: set[int] = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            # (column of '#', text, whether the text is padded: '#   more' continues the comment above)
            comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip(), tok.string.startswith("#  "))
        elif tok.type not in skip:
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    body = ast.parse(src).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        col, end = node.col_offset, node.end_lineno or node.lineno
        parts = [comments[n][1] for n in range(node.lineno, end + 1) if n in comments]
        if parts:  # continuation lines of the trailing comment: comment-only, indented past the field or padded
            n = end + 1
            while n in comments and n not in code_lines and (comments[n][0] > col or comments[n][2]):
                parts.append(comments[n][1])
                n += 1
        else:
            n, above = node.lineno - 1, []
            while n in comments and n not in code_lines and comments[n][0] == col and not comments[n][2]:
                above.insert(0, comments[n][1])
                n -= 1
            parts = above
        if text := " ".join(p for p in parts if p):
            docs[node.target.id] = text
    return docs


def section_doc(cls: type) -> str:
    """The first paragraph of a section class's own docstring, on one line ('' for dataclass's generated one)."""
    doc = cls.__doc__ or ""
    if not doc or doc.startswith(f"{cls.__name__}("):  # @dataclass writes the signature when there is no docstring
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def cli_type(tp: Any) -> bool:
    """Whether values of type `tp` can be written on a command line / in a YAML file (scalars, Literal, None,
    lists / tuples / dicts of them, dataclass sections). Others (a torch.dtype) stay programmatic-only."""
    if tp in (str, int, float, bool, type(None), typing.Any, dict, list, tuple):
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return True
    if origin in (typing.Union, types.UnionType, tuple, list, dict):
        return all(cli_type(a) for a in typing.get_args(tp) if a is not Ellipsis)
    return dataclasses.is_dataclass(tp)


def config_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, type, str]]:
    """(dotted key, type, owning class, field name) of every key of the config tree under `cls`, sections
    included, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        yield prefix + f.name, tp, cls, f.name
        if dataclasses.is_dataclass(tp):
            yield from config_fields(tp, f"{prefix}{f.name}.")


@functools.cache
def _key_docs(cls: type) -> dict[str, str]:
    """{dotted key: description} of every key under `cls`, from one walk of the config tree (the parser asks for
    ~100 keys at every start: one walk each took 0.24 s)."""
    return {k: (section_doc(tp) if dataclasses.is_dataclass(tp) else "") or field_docs(owner).get(name, "")
            for k, tp, owner, name in config_fields(cls)}


def key_doc(cls: type, key: str) -> str:
    """The description of a dotted key under `cls` (a section: its docstring, else the comment on its field)."""
    docs = _key_docs(cls)
    if key not in docs:
        raise KeyError(key)
    return docs[key]
