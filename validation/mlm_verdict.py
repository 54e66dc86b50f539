"""A run of Megatron-LM's loop judged against a reference that is not the code under test.

A run compared with its own serialized run can only find races: a deterministic defect is in
the serialized run too. So ``validation/megatron_lm`` also judges a Megatron-FSDP run by a
different computation of the same training:

* against ``DistributedDataParallel`` + the distributed optimizer (same model, seed and data, no
  Megatron-FSDP), by what Megatron reports every iteration: the losses and the grad norm;
* against the same Megatron-FSDP run with the wgrad computed apart (fused wgrad accumulation
  off), by the reported values and by the reduced gradient itself (every gradient buffer after
  the iteration, same layout on both sides).

The two sides order their floating-point sums differently, so bit identity is not expected.
The verdict is ``exact`` (every compared value has the same bits), ``float noise`` (every
relative difference at most ``FLOAT_NOISE``) or ``wrong`` (one above it, or a value that is not
finite, or the runs do not line up).

``FLOAT_NOISE`` is the fp32 noise floor of ``mfsdp_hotfix/parity/floors.py``, where it is
derived: the same fact judges ``mfsdp-hotfix parity``'s fp32 runs. That file is read by its
path: the judge imports nothing of the package it judges (importing the package arms the fixes).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any


def _floors() -> ModuleType:
    """``mfsdp_hotfix/parity/floors.py`` beside ``validation/``, loaded by path."""
    name = "mfsdp_parity_floors"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "mfsdp_hotfix", "parity", "floors.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


FLOAT_NOISE: float = _floors().FLOAT_NOISE
VERDICTS = ("exact", "float noise", "wrong")


def reported(value: Any) -> float:
    """A captured loss or grad norm as one number (a 0-d tensor, a float)."""
    if hasattr(value, "reshape"):
        flat = value.reshape(-1)
        if flat.numel() != 1:
            raise ValueError(f"a reported value of {flat.numel()} elements")
        return float(flat[0])
    return float(value)


def relative(got: float, want: float) -> float:
    """|got - want| / |want|; inf where either is not finite or only the reference is 0."""
    if not (math.isfinite(got) and math.isfinite(want)):
        return math.inf
    if got == want:
        return 0.0
    return abs(got - want) / abs(want) if want else math.inf


def judge(run: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]],
          buffers: bool = False) -> dict[str, Any]:
    """The verdict of ``run`` against ``reference`` (captures: one mapping per iteration, names
    ``loss/<name>``, ``grad_norm`` and, with ``buffers``, ``grad/<chunk>.<group>``), with the
    values per iteration that it rests on."""
    why: list[str] = []
    if len(run) != len(reference) or not reference:
        why.append(f"the run has {len(run)} iterations, its reference {len(reference)}")
    iterations: list[dict[str, Any]] = []
    worst, worst_what, first_off = 0.0, None, None
    bits_equal = True
    for i, (got, want) in enumerate(zip(run, reference, strict=False)):
        it: dict[str, Any] = {}
        rel: dict[str, float] = {}
        names = sorted(k for k in want if k.startswith("loss/")) + ["grad_norm"]
        for name in names:
            if name not in got or name not in want:
                why.append(f"iteration {i + 1}: {name} missing from the "
                           + ("run" if name not in got else "reference"))
                rel[name] = math.inf
                continue
            g, w = reported(got[name]), reported(want[name])
            it[name] = [g, w]
            rel[name] = relative(g, w)
            bits_equal &= g == w or (math.isnan(g) and math.isnan(w))
        if buffers:
            l2, same = _buffers_rel_l2(got, want)
            it["grad_rel_l2"] = l2
            rel["grad"] = math.inf if l2 is None else l2
            bits_equal &= same
            if l2 is None:
                why.append(f"iteration {i + 1}: the gradient buffers do not line up or are not "
                           "finite")
        it["rel"] = rel
        iterations.append(it)
        for name, r in rel.items():
            if r > worst or (r == worst and worst_what is None and r > 0):
                worst, worst_what = r, name
            if r > FLOAT_NOISE and first_off is None:
                first_off = i + 1
    if first_off is not None:
        why.append(f"{worst_what} differs by {worst:.3g} (relative) from iteration {first_off}")
    verdict = "wrong" if why else "exact" if bits_equal else "float noise"
    return {"verdict": verdict, "max_rel": worst, "worst": worst_what, "first_off": first_off,
            "threshold": FLOAT_NOISE, "iterations": iterations, "why": why}


def _buffers_rel_l2(got: Mapping[str, Any], want: Mapping[str, Any]) -> tuple[float | None, bool]:
    """(relative L2 difference over every ``grad/`` buffer, all bit-identical); None where the
    names or shapes differ, none is there, or a value is not finite."""
    import torch

    names = sorted(k for k in want if k.startswith("grad/"))
    if not names or names != sorted(k for k in got if k.startswith("grad/")):
        return None, False
    diff_sq = ref_sq = 0.0
    same = True
    for name in names:
        g, w = got[name].detach().double().reshape(-1), want[name].detach().double().reshape(-1)
        if g.shape != w.shape or not (torch.isfinite(g).all() and torch.isfinite(w).all()):
            return None, False
        same &= bool(torch.equal(got[name], want[name]))
        diff_sq += float((g - w).square().sum())
        ref_sq += float(w.square().sum())
    if diff_sq == 0:
        return 0.0, same
    return (math.sqrt(diff_sq / ref_sq) if ref_sq else math.inf), same
