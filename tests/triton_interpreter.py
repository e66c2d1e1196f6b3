"""Running Triton kernels on CPU tensors under Triton's interpreter, for the kernel tests that do
(tests/test_sinks_triton.py, tests/test_gated_delta_decode.py). The interpreter has to be switched on before triton
is imported, so each such file runs itself again in a subprocess with TRITON_INTERPRET=1 (`run_this_file_interpreted`),
where its `cases` run; without triton (CPU CI) everything skips. fp32 only: the interpreter computes bf16 wrongly."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# a test that runs only in the interpreted subprocess
cases = pytest.mark.skipif(not INTERPRETED, reason="runs in its file's interpreted subprocess")
# the test that starts that subprocess (skipped in the subprocess itself)
outer = pytest.mark.skipif(INTERPRETED, reason="the interpreted subprocess itself")


def run_this_file_interpreted(file: str) -> None:
    """Run the test file `file` under the interpreter, single-threaded, and fail with its output unless it passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", file, "-q", "-p", "no:cacheprovider"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-2000:]


def interpreter_patches(monkeypatch: pytest.MonkeyPatch, *kernel_modules: ModuleType) -> Iterator[None]:
    """An autouse fixture's body: in the interpreted subprocess, each of `kernel_modules` launches with the Hopper
    values (its `chip_for` reads a CUDA device) and numpy >= 2.4's refusal of int() on a size-1 array (the
    interpreter's loop bounds are such arrays) is worked around; nothing elsewhere."""
    if not INTERPRETED:
        yield
        return
    from triton.runtime import interpreter as interp

    patch = interp._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interp, "_patch_lang_tensor", patched)
    from monorl.ops.tunables import HOPPER
    for module in kernel_modules:
        monkeypatch.setattr(module, "chip_for", lambda t: HOPPER)
    yield
