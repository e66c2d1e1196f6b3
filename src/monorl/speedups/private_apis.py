"""Every private torch / Triton API monorl calls, one function (or name) each, so that an upgrade that removes or
reshapes one breaks here, where `tests/test_private_apis.py` names it, and nowhere else. Each function says what it
stands for and why monorl needs it rather than the public API."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

try:  # triton only exists on the GPU machines
    import triton  # noqa: F401 -- the probe: triton and the PDL intrinsics monorl's kernels call
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU CI
    HAS_TRITON = False



def dynamo_imported() -> bool:
    """Whether anything imported torch._dynamo: until then nothing runs compiled, and importing it costs ~1 s of a
    run that compiles nothing (#18)."""
    return "torch._dynamo" in sys.modules


DISABLE_ATTR = "__dynamo_disable"  # a string: written as an attribute inside a class, Python would mangle it


class DisableDynamoLazily:
    """What `torch._disable_dynamo` caches on the function it wraps (its `__dynamo_disable`), set ahead so that the
    wrapper's first call does not import torch._dynamo (~1 s on the GPU machines, #18): while nothing has imported
    Dynamo nothing runs compiled, and disabling it would change nothing, so the function is called as it is; once
    something has, the real `torch._dynamo.disable(fn)` is built, cached in this one's place and called, as torch
    would have done from the start."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not dynamo_imported():
            return self.fn(*args, **kwargs)
        disabled = torch._dynamo.disable(self.fn, recursive=True, wrapping=False)
        setattr(self.fn, DISABLE_ATTR, disabled)
        return disabled(*args, **kwargs)


def disable_dynamo_lazily_(op: Any) -> Any:
    """Pre-set on a `torch.library.custom_op`'s backend functions what `torch._disable_dynamo` caches on them
    (`DisableDynamoLazily`), reached through the op's `_backend_fns` and each wrapper's `__wrapped__`."""
    for backend_fn in op._backend_fns.values():  # torch._disable_dynamo's wrappers (one per device type)
        inner = getattr(backend_fn, "__wrapped__", None)
        if inner is not None and not hasattr(inner, DISABLE_ATTR):
            setattr(inner, DISABLE_ATTR, DisableDynamoLazily(inner))
    return op


def enable_compile_caches() -> None:
    """Inductor's FX graph cache on; Dynamo's recompile limit raised to 64: one block's code serves trainer (grad,
    autocast) and generator (prefill, decode) of two model copies, more variants than the default 8, past which
    Dynamo silently runs eager."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)


def maybe_mark_dynamic(t: Tensor, dim: int) -> None:
    """`torch._dynamo.maybe_mark_dynamic` (only called once Dynamo is imported: `dynamo_imported`)."""
    torch._dynamo.maybe_mark_dynamic(t, dim)


def dynamo_counters() -> dict[str, Any]:
    """Dynamo's frame counters (`torch._dynamo.utils.counters`); empty where Dynamo was never imported."""
    if not dynamo_imported():
        return {}
    from torch._dynamo.utils import counters

    return counters


def compilation_time_metrics() -> dict[str, list[float]]:
    """Seconds per Dynamo/AOT/Inductor phase (`torch._dynamo.utils.compilation_time_metrics`); empty where Dynamo
    was never imported."""
    if not dynamo_imported():
        return {}
    from torch._dynamo.utils import compilation_time_metrics as metrics

    return metrics


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """`torch._grouped_mm`: one launch for every expert's rows (sorted by expert, `offs` their ends)."""
    return torch._grouped_mm(a, b, offs=offs)


def foreach_copy_(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """`torch._foreach_copy_`: one launch copying (and casting) each of `src` into `dst`."""
    torch._foreach_copy_(list(dst), list(src))


def unwrapped_methods(cls: type, names: Sequence[str]) -> dict[str, Callable]:
    """`cls`'s methods past their decorators (`inspect.unwrap`): AdamW's, past the wrappers that import Dynamo at
    their first call (`torch._disable_dynamo`, `_use_grad_for_differentiable`)."""
    return {name: inspect.unwrap(getattr(cls, name)) for name in names}


def flash_attention_forward(*args: Any, **kw: Any) -> tuple[Tensor, ...]:
    """`torch.ops.aten._flash_attention_forward`: the flash kernel itself, which takes fewer kv heads than query
    heads (no GQA-expanded copies of k and v), below autograd."""
    return torch.ops.aten._flash_attention_forward(*args, **kw)


def flash_attention_backward(*args: Any, **kw: Any) -> tuple[Tensor, ...]:
    """`torch.ops.aten._flash_attention_backward`: flash's backward from the saved log-sum-exp, below autograd (no
    forward recomputed, a group's key/value gradients summed by the kernel)."""
    return torch.ops.aten._flash_attention_backward(*args, **kw)


def flash_window(window: int) -> dict[str, int]:
    """Both flash ops' keyword arguments for a sliding window of `window` keys (a query at p sees p - window + 1 ..
    p): none for 0 (causal over every key)."""
    return {"window_size_left": window - 1, "window_size_right": 0} if window else {}
