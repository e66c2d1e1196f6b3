"""A run that compiles nothing and runs on one process never imports torch._dynamo, sympy or DTensor (together
~2-3 s of a warm run's startup on the GPU machines, #18), and what it uses in their place computes what torch's
own does: monorl's AdamW is torch's AdamW bit for bit, and a custom op called after Dynamo's import is disabled
for Dynamo as torch would have done."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.train.optim import AdamW

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch._dynamo", "sympy", "torch.distributed.tensor", "torch.distributed.fsdp")
# what a plain text run on CPU has no use for (#62): images (PIL), an LLM judge or a reward model, fla's and
# Triton's kernels, math_verify, HF datasets and transformers, and the other verbs' own modules
OPTIONAL = ("PIL", "monorl.tasks.judge", "monorl.tasks.reward_model", "monorl.model.sequence_classifier", "fla",
            "triton", "math_verify", "datasets", "transformers", "openai_harmony", "monorl.eval.run", "monorl.parity")


def _python(code: str, tmp_path: Path) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_run_that_compiles_nothing_never_imports_dynamo_sympy_or_dtensor(tmp_path):
    """The whole tiny loop (warm start, validation, a GRPO step, the final checkpoint with AdamW's state) in a
    fresh process: none of the heavy modules is imported, nor any optional piece a text run does not use, and the
    run finished."""
    run_dir = tmp_path / "run"
    got = _python(f"""
import json, sys
import monorl.cli as cli
rc = cli.main(["train", "--preset", "tiny", "--steps", "1", "--warm_start.steps", "2", "--validation.num_prompts", "2",
               "--run_dir", {str(run_dir)!r}])
json.dump({{"rc": rc, "imported": [m for m in {HEAVY + OPTIONAL!r} if m in sys.modules]}}, open(sys.argv[1], "w"))
""", tmp_path)
    assert got == {"rc": 0, "imported": []}
    assert (run_dir / "checkpoints" / "final").is_dir()


def test_a_custom_op_is_disabled_for_dynamo_once_dynamo_is_imported(tmp_path):
    """Before Dynamo's import a monorl op's implementation is called as it is; after it, the first call builds and
    caches torch's own `torch._dynamo.disable` wrapper, and a compiled function calling the op still computes it."""
    got = _python("""
import json, sys
import torch
from monorl.model.rope import rope_cos_sin
inner = rope_cos_sin._backend_fns[None].__wrapped__
pos = torch.arange(5)
before = rope_cos_sin(pos, 8, 1e4, torch.float32)
lazy = type(getattr(inner, "__dynamo_disable")).__name__
import torch._dynamo
after = rope_cos_sin(pos, 8, 1e4, torch.float32)
real = getattr(getattr(inner, "__dynamo_disable"), "_torchdynamo_disable", False)
compiled = torch.compile(lambda p: rope_cos_sin(p, 8, 1e4, torch.float32), backend="eager", fullgraph=True)(pos)
json.dump({"lazy": lazy, "real": real, "same": all(torch.equal(a, b) for a, b in zip(before, after)),
           "compiled": all(torch.equal(a, b) for a, b in zip(before, compiled))}, open(sys.argv[1], "w"))
""", tmp_path)
    assert got == {"lazy": "DisableDynamoLazily", "real": True, "same": True, "compiled": True}


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_is_torchs_adamw_bit_for_bit(fused):
    """Three steps with weight decay and changing gradients, then a state dict loaded across: parameters, moments
    and state dicts equal torch.optim.AdamW's exactly, for-each and fused."""
    models = [build_model(model_shape("tiny"), seed=3) for _ in range(2)]
    kw = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "fused": fused or None}
    opts = [AdamW(models[0].parameters(), **kw), torch.optim.AdamW(models[1].parameters(), **kw)]
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=gen) for p in models[0].parameters()] for _ in range(3)]

    def step(g: list[torch.Tensor]) -> None:
        for model, opt in zip(models, opts, strict=True):
            for p, gp in zip(model.parameters(), g, strict=True):
                p.grad = gp.clone()
            opt.step()
            opt.zero_grad()
            assert all(p.grad is None for p in model.parameters())

    for g in grads[:2]:
        step(g)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    sd = [o.state_dict() for o in opts]
    assert sd[0]["param_groups"] == sd[1]["param_groups"]
    for i, st in sd[1]["state"].items():
        assert st.keys() == sd[0]["state"][i].keys()
        assert all(torch.equal(v, sd[0]["state"][i][k]) for k, v in st.items())
    # torch's state dict into ours (a checkpoint of an earlier monorl), a copy: loaded, its tensors are used as they are
    opts[0].load_state_dict(copy.deepcopy(sd[1]))
    step(grads[2])
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_update_kernels_are_recorded_for_a_later_runs_preload():
    """`launch_update_kernels` under the ATen recorder lists the update's ops (the norm, fused AdamW, the zeroing),
    which a later run's preload thread launches ahead (step 1 would load their modules otherwise), and touches no
    other parameter."""
    from monorl.speedups.preload import AtenRecorder
    from monorl.train.optim import launch_update_kernels

    rec = AtenRecorder(cuda_only=False)
    with rec:
        launch_update_kernels(torch.device("cpu"), on_device=True)
    ops = {o["op"] for o in rec.ops}
    assert {"aten::_foreach_norm.Scalar", "aten::_fused_adamw_.default", "aten::_foreach_zero_.default"} <= ops
