"""Turns on the GPU for the runs of ``selftest --gpu``: all prepare at once, the GPU work that
matters is done one turn at a time.

Why: most of a run's wall time is its start (the interpreter, torch, CUDA's context,
TransformerEngine, the release and the hotfix imported, the model built and sharded); its
training, 4 steps, is a second or two. Four runs one after another took 57-59 s on one H100.
Started together, they prepare at the same time, and what the proof rests on still happens with
the GPU to itself: the race shows when a delayed reduce-scatter is still running as the next
unit's backward reuses its slot, and kernels of another process on the same GPU (time-sliced
between CUDA contexts) would change that timing, as they would change the calibration of the
delay. So the driver hands the GPU to one turn at a time: the two serialized runs together
(``CUDA_LAUNCH_BLOCKING=1``: no two kernels of a run overlap, so their gradients do not depend on
timing; they shared the GPU before too, and their turn may begin while the others still
prepare), and each asynchronous run alone, once every run is prepared, so that no other process
uses the GPU during it. A turn is the calibration of the delay, the training and the copy of the
gradients to the host; saving and comparing them and the audit's files come after it.

The handshake goes through files in the runs' folder, so that one process and torchrun's ranks
take turns alike: a rank writes ``<run>.ready.rank<R>`` once prepared and waits for
``<run>.turn``; it writes ``<run>.done.rank<R>`` when its GPU work is over. The driver writes
``<run>.ended`` once a run's processes are gone (an asynchronous run waiting for its serialized
run's gradients stops waiting then).
"""

from __future__ import annotations

import time
from pathlib import Path

from mfsdp_hotfix.selftest.gpu_spec import GpuRun

POLL_S = 0.01  # a rank's wait for its turn: a file's existence, checked 100 times a second


def flag(out_dir: str, run: GpuRun, what: str, rank: int | None = None) -> Path:
    """``<run>.<what>[.rank<R>]`` in ``out_dir``: ready, turn, done (per rank) or ended."""
    return Path(out_dir) / (f"{run.key}.{what}" + ("" if rank is None else f".rank{rank}"))


def wait_for(paths: list[Path], limit_s: float) -> bool:
    """Wait until one of ``paths`` exists; False when ``limit_s`` passed first."""
    deadline = time.monotonic() + limit_s
    while not any(path.exists() for path in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def take_turn(out_dir: str, run: GpuRun, rank: int) -> bool:
    """A rank's side: say it is prepared, then wait for the run's turn (False: none came within
    the run's timeout)."""
    flag(out_dir, run, "ready", rank).touch()
    return wait_for([flag(out_dir, run, "turn")], run.timeout_s)


def groups(runs: list[GpuRun]) -> list[list[GpuRun]]:
    """The turns: the serialized runs together, then each asynchronous run alone."""
    together = [run for run in runs if run.serialized]
    return ([together] if together else []) + [[run] for run in runs if not run.serialized]


class Turns:
    """The driver's side: once a turn is over, grants the GPU to the first turn whose runs are
    all prepared (or already ended); an asynchronous run's turn only once every run is."""

    def __init__(self, runs: list[GpuRun], out_dir: str) -> None:
        self.out_dir = out_dir
        self.runs = runs
        self.waiting = groups(runs)
        self.current: list[GpuRun] = []
        self.ended: set[str] = set()

    def end(self, run: GpuRun) -> None:
        """``run``'s processes are gone."""
        if run.key not in self.ended:
            self.ended.add(run.key)
            flag(self.out_dir, run, "ended").touch()

    def _all(self, runs: list[GpuRun], what: str) -> bool:
        return all(run.key in self.ended or all(flag(self.out_dir, run, what, rank).exists()
                                                for rank in range(run.processes))
                   for run in runs)

    def advance(self) -> list[GpuRun]:
        """Grant the next turn if the GPU is free and one is ready; returns its runs (or [])."""
        if self.current and not self._all(self.current, "done"):
            return []
        self.current = []
        everyone = self._all(self.runs, "ready")
        ready = next((group for group in self.waiting if self._all(group, "ready")
                      and (everyone or all(run.serialized for run in group))), None)
        if ready is None:
            return []
        self.waiting.remove(ready)
        self.current = ready
        for run in ready:
            flag(self.out_dir, run, "turn").touch()
        return ready
