"""`monorl.ops.gated_delta.rule_path`: which gated delta rule runs (fla's kernels or monorl's references) for a
device's capability, Triton version, whether a gradient is needed, and what is installed -- the choice alone, on
its inputs (fla's maths is checked against the references on the GPU, tests/test_qwen3_5_gpu.py)."""

from __future__ import annotations

import pytest

from monorl.ops.gated_delta import rule_path, version_tuple

HOPPER, AMPERE, BLACKWELL = (9, 0), (8, 0), (10, 0)


def path(capability=HOPPER, grad=True, enabled=True, installed=True, triton="3.6.0", tilelang=False) -> str:
    return rule_path(capability, grad, enabled, installed, triton, tilelang)[0]


@pytest.mark.parametrize("triton", ["3.4.0", "3.6.0", "3.7.0"])
def test_hopper_training_under_the_bad_tritons_runs_the_reference(triton):
    assert path(triton=triton) == "reference"
    assert "#640" in rule_path(HOPPER, True, True, True, triton, False)[1]


def test_hopper_without_a_gradient_runs_fla_whatever_the_triton():
    assert path(grad=False, triton="3.6.0") == "fla"


@pytest.mark.parametrize("triton", ["3.3.1", "3.7.1", "3.7.1+git1234abcd", "3.8.0"])
def test_hopper_training_outside_the_bad_tritons_runs_fla(triton):
    assert path(triton=triton) == "fla"


@pytest.mark.parametrize("capability", [AMPERE, BLACKWELL])
def test_other_gpus_train_with_fla(capability):
    assert path(capability=capability) == "fla"


def test_a_usable_tilelang_backend_lets_fla_train_on_hopper():
    assert path(tilelang=True) == "fla"


def test_off_cuda_disabled_or_not_installed_runs_the_reference():
    assert path(capability=None, grad=False) == "reference"
    assert path(enabled=False, grad=False) == "reference"
    assert path(installed=False, grad=False) == "reference"


def test_version_tuple():
    assert version_tuple("3.6.0") == (3, 6, 0)
    assert version_tuple("3.7.1+gitabc123") == (3, 7, 1)
    assert version_tuple("3.10.0rc1") == (3, 10, 0)
