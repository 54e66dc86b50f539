"""Schedule faults for the one-GPU harness: delays on the reduce-scatter, all-gather and compute
streams, drawn per case from a seed and consulted by wrappers installed once per process.

Why: a stream-ordering fix is trusted only when no schedule breaks it. A delay is
``torch.cuda._sleep(cycles)`` enqueued on the stream that is current at the fault point:

* ``rs``: right before ``torch.distributed.reduce_scatter_tensor`` (Megatron-FSDP issues it on its
  reduce-scatter stream, inside a coalescing manager that launches on the same stream), so the
  reduce-scatter and everything queued after it on that stream finish later;
* ``ag``: right before ``torch.distributed.all_gather_into_tensor`` (the parameter all-gather, on
  the all-gather stream or the current stream; every release calls it by attribute at call time);
* ``compute``: in a unit's forward or backward (:class:`ComputePoint`, an identity autograd
  function the models put at each unit's input), on the compute stream.

The wrappers are installed once per process, outermost (after the NCCL-semantics shim), and ask
the module-level :data:`SCHEDULE` for a delay at every call; a case sets its own schedule with
:func:`set_schedule` (``None``: no faults, the wrappers only count). Each fault point draws from
its own ``random.Random`` seeded from (seed, stream), so the n-th call of a stream gets the same
delay whenever the same case runs again: a failing seed is reproducible from its number alone.
This module does not touch ``validation/fakepg_shims.py``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

STREAMS = ("rs", "ag", "compute")


@dataclass
class StreamFaults:
    """Delays for one fault point: each call is delayed with probability ``p`` by a time drawn
    uniformly from ``[min_ms, max_ms]`` (``fixed_ms`` > 0: every call, exactly that long)."""

    p: float = 0.0
    min_ms: float = 0.0
    max_ms: float = 0.0
    fixed_ms: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"p": self.p, "min_ms": self.min_ms, "max_ms": self.max_ms,
                "fixed_ms": self.fixed_ms}


@dataclass
class Schedule:
    """The faults of one case. ``units``/``phases`` restrict compute faults to some units and to
    'fwd'/'bwd'; ``budget_ms`` caps the total delay of the case (the GPU is shared)."""

    seed: int
    rs: StreamFaults = field(default_factory=StreamFaults)
    ag: StreamFaults = field(default_factory=StreamFaults)
    compute: StreamFaults = field(default_factory=StreamFaults)
    compute_units: tuple[int, ...] = ()
    compute_phases: tuple[str, ...] = ("fwd", "bwd")
    budget_ms: float = 1e9
    cycles_per_ms: float = 0.0
    # what happened (read back into the case record)
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STREAMS, 0))
    delayed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STREAMS, 0))
    delayed_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STREAMS, 0.0))
    _rng: dict[str, random.Random] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, name in enumerate(STREAMS):
            self._rng[name] = random.Random(self.seed * 7919 + 104729 * (i + 1))

    @classmethod
    def from_dict(cls, d: dict[str, Any], cycles_per_ms: float) -> Schedule:
        return cls(seed=int(d.get("seed", 0)), rs=StreamFaults(**d.get("rs", {})),
                   ag=StreamFaults(**d.get("ag", {})), compute=StreamFaults(**d.get("compute", {})),
                   compute_units=tuple(d.get("compute_units", ())),
                   compute_phases=tuple(d.get("compute_phases", ("fwd", "bwd"))),
                   budget_ms=float(d.get("budget_ms", 1e9)), cycles_per_ms=cycles_per_ms)

    def draw(self, stream: str) -> float:
        """The delay in ms for the next call of ``stream`` (drawn even when over budget, so the
        sequence of draws does not depend on earlier delays)."""
        faults: StreamFaults = getattr(self, stream)
        rng = self._rng[stream]
        self.calls[stream] += 1
        hit, u = rng.random(), rng.random()
        if faults.fixed_ms > 0:
            ms = faults.fixed_ms
        elif hit < faults.p:
            ms = faults.min_ms + (faults.max_ms - faults.min_ms) * u
        else:
            ms = 0.0
        if ms <= 0 or sum(self.delayed_ms.values()) + ms > self.budget_ms:
            return 0.0
        self.delayed[stream] += 1
        self.delayed_ms[stream] += ms
        return ms

    def report(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "delayed": dict(self.delayed),
                "delayed_ms": {k: round(v, 3) for k, v in self.delayed_ms.items()}}


SCHEDULE: Schedule | None = None
COUNTS = dict.fromkeys(STREAMS, 0)  # calls seen since install, whatever the schedule
_installed = False


def set_schedule(schedule: Schedule | None) -> None:
    global SCHEDULE
    SCHEDULE = schedule


def _sleep(stream: str) -> None:
    COUNTS[stream] += 1
    sched = SCHEDULE
    if sched is None:
        return
    ms = sched.draw(stream)
    if ms > 0 and sched.cycles_per_ms > 0:
        import torch

        torch.cuda._sleep(int(ms * sched.cycles_per_ms))


def install() -> None:
    """Wrap the collectives (idempotent). Call after the NCCL-semantics shim and before Megatron
    is imported (every release calls both collectives by attribute, so later would work too)."""
    global _installed
    if _installed:
        return
    import torch.distributed as dist

    for name, stream in (("reduce_scatter_tensor", "rs"), ("all_gather_into_tensor", "ag")):
        orig = getattr(dist, name)

        def collective(*args: Any, _orig: Any = orig, _stream: str = stream, **kwargs: Any) -> Any:
            _sleep(_stream)
            return _orig(*args, **kwargs)

        collective.__wrapped__ = orig  # type: ignore[attr-defined]
        setattr(dist, name, collective)
    _installed = True


def compute_point_class(torch: Any) -> Any:
    """An identity autograd function a unit applies to its input: a compute-stream fault point
    in the unit's forward and (when the unit's backward reaches its input) in its backward."""

    class ComputePoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, unit: int) -> Any:
            ctx.unit = unit
            _compute_fault(unit, "fwd")
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            _compute_fault(ctx.unit, "bwd")
            return g, None

    return ComputePoint


def _compute_fault(unit: int, phase: str) -> None:
    sched = SCHEDULE
    if sched is None:
        COUNTS["compute"] += 1
        return
    if unit in sched.compute_units and phase in sched.compute_phases:
        _sleep("compute")
    else:
        COUNTS["compute"] += 1
