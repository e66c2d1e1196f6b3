"""The private torch / Triton APIs monorl relies on, all reached through `monorl.speedups` (`speedups/precompile.py`,
`ops/__init__.py`'s lazy Dynamo disable, `train/optim.py`'s unwrapped AdamW, `compile.py`'s caches) still exist in
the installed versions: an upgrade that removes or reshapes one fails here, by name, not as a slow or broken run.
Turning the machinery off (`--compile.startup_speedups false`) is the fallback while it is mended."""

from __future__ import annotations

import inspect

import pytest
import torch


def test_custom_op_backend_wrappers_carry_the_dynamo_disable_cache():
    """`ops.custom_op` pre-sets what `torch._disable_dynamo` caches on a custom op's backend function, reached
    through `op._backend_fns[...]` and its `__wrapped__`."""
    from monorl.ops import custom_op
    from monorl.speedups.private_apis import DISABLE_ATTR, DisableDynamoLazily

    @custom_op("monorl_test::private_api_probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    fns = getattr(probe, "_backend_fns", None)
    assert isinstance(fns, dict) and fns, "torch.library.CustomOpDef._backend_fns is gone"
    inner = [getattr(f, "__wrapped__", None) for f in fns.values()]
    assert all(i is not None for i in inner), "the backend wrappers no longer expose __wrapped__"
    assert all(isinstance(getattr(i, DISABLE_ATTR), DisableDynamoLazily) for i in inner)
    assert torch.equal(probe(torch.ones(2)), torch.ones(2))
    assert callable(torch._disable_dynamo)


def test_adamw_methods_unwrap_to_torchs_own():
    """`train/optim.py` calls AdamW's methods past their Dynamo wrappers (`inspect.unwrap`)."""
    for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict", "step"):
        fn = getattr(torch.optim.AdamW, name)
        assert callable(inspect.unwrap(fn)), name
    from monorl.train.optim import AdamW

    p = torch.nn.Parameter(torch.ones(3))
    ours, theirs = AdamW([p], lr=0.1), torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    assert ours.state_dict().keys() == theirs.state_dict().keys()


def test_compile_cache_and_counter_modules():
    """`compile.py` sets Inductor's FX graph cache and Dynamo's recompile limit and reads Dynamo's counters."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import compilation_time_metrics, counters

    assert hasattr(inductor_config, "fx_graph_cache") and hasattr(dynamo_config, "recompile_limit")
    assert isinstance(counters, dict) and isinstance(compilation_time_metrics, dict)
    assert callable(torch._dynamo.maybe_mark_dynamic)


def test_triton_cache_key_and_jit_function():
    """`speedups/precompile.py`: Triton's cache key function (an lru_cache it replaces with the child's result) and the
    JITFunction class whose per-device caches it fills."""
    pytest.importorskip("triton")
    from triton.runtime import cache
    from triton.runtime.jit import JITFunction

    assert hasattr(cache.triton_key, "cache_info"), "triton.runtime.cache.triton_key is no longer an lru_cache"
    assert "device_caches" in inspect.getsource(JITFunction), "JITFunction.device_caches is gone"


def _private_uses(path) -> list[str]:
    """The private torch / Triton APIs a source file reaches: an import of a module with a `_private` part
    (`torch._dynamo`, `torch.utils._pytree`) or of `triton.runtime` / `triton.compiler`, and an attribute of
    `torch` whose name starts with one underscore (`torch._grouped_mm`; not `torch.__version__`)."""
    import ast

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] in ("torch", "triton") and (
            any(p.startswith("_") and not p.startswith("__") for p in parts[1:])
            or parts[:2] in (["triton", "runtime"], ["triton", "compiler"]))

    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and private(node.module):
            out.append(node.module)
        elif isinstance(node, ast.Attribute):
            chain, cur = [node.attr], node.value
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and private(".".join([cur.id, *reversed(chain)])):
                out.append(".".join([cur.id, *reversed(chain)]))
    return out


def test_private_apis_are_used_inside_monorl_speedups_only():
    """Every private torch / Triton API is reached through `monorl.speedups` (its `private_apis`, `precompile`,
    `preload`), so the probes above cover them all and an upgrade breaks one package, not eleven files."""
    from pathlib import Path

    import monorl

    src = Path(monorl.__file__).parent
    outside = {str(p.relative_to(src)): uses for p in sorted(src.rglob("*.py"))
               if p.relative_to(src).parts[0] != "speedups" and (uses := _private_uses(p))}
    assert outside == {}, f"private APIs used outside monorl/speedups/: {outside}"


def test_private_ops_monorl_calls_exist():
    """`speedups.private_apis`' ops: `_grouped_mm` (MoE experts), `_foreach_copy_` (FSDP gathers for weight sync),
    flash attention's ATen forward / backward (GQA without expanded copies; the invariant backward)."""
    assert callable(getattr(torch, "_grouped_mm", None)), "torch._grouped_mm is gone"
    assert callable(getattr(torch, "_foreach_copy_", None)), "torch._foreach_copy_ is gone"
    for op in ("_flash_attention_forward", "_flash_attention_backward"):
        assert hasattr(torch.ops.aten, op), f"torch.ops.aten.{op} is gone"
    from monorl.speedups.private_apis import foreach_copy_

    dst = [torch.zeros(2), torch.zeros(3, dtype=torch.float64)]
    foreach_copy_(dst, [torch.ones(2), torch.full((3,), 2.0)])
    assert dst[0].tolist() == [1.0, 1.0] and dst[1].tolist() == [2.0, 2.0, 2.0]
