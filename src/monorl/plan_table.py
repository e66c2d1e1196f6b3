"""The memory plan's table (`monorl.plan`): its rows (bytes, persistent or transient), the planned peak and whether it
fits a GPU with the CUDA context and allocator slack beside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GiB = 1 << 30


@dataclass
class MemoryRow:
    name: str
    bytes: int
    note: str = ""
    persistent: bool = True


@dataclass
class MemoryPlan:
    rows: list[MemoryRow]
    device_bytes: int | None  # the GPU's memory; None: not known (CPU runs, or `plan` without --gpu_memory_gb)
    micro_batch_tokens: int  # the largest micro-batch the plan sized activations for
    activation_checkpointing: bool
    reserve_bytes: int = 0  # CUDA context, cuBLAS workspaces and allocator slack, outside `peak_bytes`
    advice: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """Persistent rows plus the largest transient one (trainer and generator run one at a time)."""
        transient = [r.bytes for r in self.rows if not r.persistent]
        return sum(r.bytes for r in self.rows if r.persistent) + max(transient, default=0)

    def row(self, name: str) -> MemoryRow:
        return next(r for r in self.rows if r.name == name)

    @property
    def fits(self) -> bool | None:
        if self.device_bytes is None:
            return None
        return self.peak_bytes + self.reserve_bytes <= self.device_bytes

    def table(self) -> str:
        lines = [f"  {'':<28}{'GiB':>8}"]
        for r in self.rows:
            kind = "" if r.persistent else " (transient)"
            lines.append(f"  {r.name:<28}{r.bytes / GiB:8.2f}  {r.note}{kind}".rstrip())
        lines.append(f"  {'peak (planned)':<28}{self.peak_bytes / GiB:8.2f}")
        if self.device_bytes is not None:
            lines.append(f"  {'+ context and slack':<28}{self.reserve_bytes / GiB:8.2f}")
            lines.append(f"  {'GPU memory':<28}{self.device_bytes / GiB:8.2f}  "
                         f"{'fits' if self.fits else 'does not fit'}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"rows": {r.name: r.bytes for r in self.rows}, "peak_bytes": self.peak_bytes,
                "device_bytes": self.device_bytes, "reserve_bytes": self.reserve_bytes, "fits": self.fits,
                "micro_batch_tokens": self.micro_batch_tokens,
                "activation_checkpointing": self.activation_checkpointing, "advice": self.advice}


def reserve_for(device_bytes: int) -> int:
    """Memory outside PyTorch's allocated bytes: the CUDA context and libraries (~0.6 GiB), and slack for
    fragmentation of the caching allocator (3%)."""
    return int(0.75 * GiB + 0.03 * device_bytes)
