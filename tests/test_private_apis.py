"""The private torch / Triton APIs monorl's start-up machinery relies on (`rl/startup.py`, `ops/precompile.py`,
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
    from monorl.ops import _DISABLE_ATTR, _DisableDynamoLazily, custom_op

    @custom_op("monorl_test::private_api_probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    fns = getattr(probe, "_backend_fns", None)
    assert isinstance(fns, dict) and fns, "torch.library.CustomOpDef._backend_fns is gone"
    inner = [getattr(f, "__wrapped__", None) for f in fns.values()]
    assert all(i is not None for i in inner), "the backend wrappers no longer expose __wrapped__"
    assert all(isinstance(getattr(i, _DISABLE_ATTR), _DisableDynamoLazily) for i in inner)
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
    """`ops/precompile.py`: Triton's cache key function (an lru_cache it replaces with the child's result) and the
    JITFunction class whose per-device caches it fills."""
    pytest.importorskip("triton")
    from triton.runtime import cache
    from triton.runtime.jit import JITFunction

    assert hasattr(cache.triton_key, "cache_info"), "triton.runtime.cache.triton_key is no longer an lru_cache"
    assert "device_caches" in inspect.getsource(JITFunction), "JITFunction.device_caches is gone"
