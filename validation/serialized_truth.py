"""A case's serialized truth: the same case run under ``CUDA_LAUNCH_BLOCKING=1`` (nothing can
race), saved by its serialized run and compared bit for bit by its asynchronous runs.

A run is ``{"grads": [per step], "losses", "params"}`` (CPU tensors). The two runs are separate
processes, so the truth goes through a file; a serialized run that crashed leaves a ``.crash``
marker instead, so that its asynchronous runs stop waiting for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import comparison  # no torch at import


def save(torch: Any, path: str, run: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(run, tmp)
    os.replace(tmp, path)


def load(torch: Any, path: str, wait_s: float) -> dict[str, Any] | None:
    """The serialized run's record (waiting for it while it is being computed); None: it
    crashed, or never came."""
    deadline = time.time() + wait_s
    while not os.path.exists(path):
        if os.path.exists(path + ".crash") or time.time() > deadline:
            return None
        time.sleep(0.2)
    return dict(torch.load(path, map_location="cpu"))


def mark_crashed(path: str, error: str) -> None:
    """The serialized run of ``path`` crashed: its asynchronous runs have nothing to compare."""
    _write_json(path + ".crash", {"error": error})


def remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _bits(t: Any) -> Any:
    import torch

    t = t.float().contiguous()
    return t.view(torch.int32)


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """The run against its serialized truth with the package's comparison: each step's gradients;
    the last step also carries the losses of every step and the final parameters. Adds
    ``losses_exact`` / ``params_exact`` (bit-identical or not) to its record."""
    result = comparison.compare(_steps(run), _steps(ref))
    out: dict[str, Any] = result.to_dict()
    for name in ("losses", "params"):
        if run.get(name) is not None or ref.get(name) is not None:
            out[f"{name}_exact"] = name not in result.differing
    return out


def _steps(run: dict[str, Any]) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = [{"grads": g} for g in run["grads"]]
    if steps:
        steps[-1].update({name: run[name] for name in ("losses", "params")
                          if run.get(name) is not None})
    return steps


def digest(run: dict[str, Any]) -> str:
    """A hash of the bits of every gradient, loss and parameter (truth runs of two variants of
    the same case can be compared without keeping their tensors)."""
    h = hashlib.sha256()
    for t in [*run["grads"], run["losses"], run["params"]]:
        if t is not None:
            h.update(_bits(t).numpy().tobytes())
    return h.hexdigest()[:16]


def _write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, default=str)
