"""mkdocs hook: the reference pages (docs/gen_reference.py) are generated from the code at every build, never
written to docs/, so they cannot drift from the config dataclasses and the verb table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

_spec = importlib.util.spec_from_file_location("gen_reference", Path(__file__).with_name("gen_reference.py"))
assert _spec is not None and _spec.loader is not None
gen_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_reference)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for path, render in gen_reference.PAGES.items():
        files.append(File.generated(config, path, content=render()))
    return files
