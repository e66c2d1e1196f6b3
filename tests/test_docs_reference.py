"""The documentation's reference pages (docs/gen_reference.py, built by mkdocs at every CI run) cover the code they
are generated from: every config key with its default and description, every preset's changes, every verb."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from monorl.cli import VERBS
from monorl.config import RunConfig
from monorl.config_docs import config_fields, key_doc
from monorl.presets import PRESETS

GEN = Path(__file__).resolve().parent.parent / "docs" / "gen_reference.py"


@pytest.fixture(scope="module")
def gen():
    if not GEN.exists():
        pytest.skip("docs/ not in this checkout")
    spec = importlib.util.spec_from_file_location("gen_reference", GEN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_config_page_has_every_key_with_its_description(gen):
    page = gen.config_page()
    keys_part = page.split("## Presets")[0]
    rows = {line.split("|")[1].strip(" `"): line for line in keys_part.splitlines() if line.startswith("| `")}
    for key, tp, _, _ in config_fields(RunConfig):
        if dataclasses.is_dataclass(tp):
            assert f"## `{key}`" in page, key
            continue
        assert key in rows, key
        doc = key_doc(RunConfig, key)
        assert doc.replace("|", "\\|") in rows[key], key
    assert rows["rollout.group_size"].startswith("| `rollout.group_size` | int | `8` |")  # type and default
    for name in PRESETS:
        assert f"### `{name}`" in page
    # the tiny preset's own settings are listed as it sets them
    tiny = page.split("### `tiny`")[1].split("### ")[0]
    assert "| `steps` | `30` |" in tiny and "| `model.shape` | `\"tiny\"` |" in tiny


def test_type_text_reads_as_help_does(gen):
    from typing import Literal

    assert gen.type_text(int | None) == "int \\| null"
    assert gen.type_text(Literal["a", "b"]) == "`a` \\| `b`"
    assert gen.type_text(list[str]) == "list[str]"


def test_cli_page_has_every_verb_and_its_options(gen):
    page = gen.cli_page()
    for name, verb in VERBS.items():
        assert f"| `{name}` |" in page and verb.example in page
    assert "`--gpu_memory_gb`" in page and "`--tolerance`" in page


ROOT = GEN.parent.parent


def _doc(name: str) -> str:
    path = ROOT / name
    if not path.exists():
        pytest.skip(f"{name} not in this checkout")
    return path.read_text(encoding="utf-8")


def test_readme_preset_list_has_every_preset():
    import re

    readme = _doc("README.md")
    listed = readme.split("monorl presets", 1)[1].split("\nmonorl ", 1)[0]  # the line and its continuation
    assert not [name for name in PRESETS if not re.search(rf"\b{name}\b", listed)]


def test_default_run_wall_time_is_stated_once_and_cpu_threads_are_documented():
    """The default run's wall time lives in the benchmarks' CPU table; the pages that describe the run link to it
    instead of quoting their own (they disagreed: 35.6 s, 51-58 s, ~2 minutes); where CPU runs are documented, the
    thread-count slowdown and OMP_NUM_THREADS are too."""
    import re

    assert "| 2026-12-06 |" in _doc("docs/benchmarks.md").split("## CPU: the quick start", 1)[1]
    for name in ("README.md", "docs/quickstart.md", "docs/index.md"):
        text = _doc(name)
        assert "benchmarks.md#cpu-the-quick-start" in text, name
        assert not re.search(r"\d s wall|~\d+ minutes|\d+-\d+ s\b", text), name
    for name in ("README.md", "docs/quickstart.md"):
        assert "OMP_NUM_THREADS=1 monorl train" in _doc(name), name
