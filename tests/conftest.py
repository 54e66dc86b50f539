"""Shared fixtures: the repository on sys.path, and subprocess helpers for the permutation tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from installed import installed  # noqa: E402, F401  (session fixture: this package as installed)

# The signal tests send SIGINT as a terminal's Ctrl-C would. A pytest started as a background job
# of a non-interactive shell inherits SIGINT ignored, and every child it starts would too; a
# Python handler is not inherited, so the children start with the default, as under a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The detail line of ``status``'s verdict for a copy whose ZeRO-1 and no_shard reduce twice without
# overlap: no fix makes HSDP right there (neither the release nor reduce-once).
REFUSES_HSDP = ("refused at model construction, if you build: HSDP with ZeRO-1 (optim) and "
                "overlap_grad_reduce=False, HSDP with no_shard and overlap_grad_reduce=False (no "
                "fix makes it right): use overlap_grad_reduce=True (the default)")
# Every copy carries te-partial-cuda-graphs: status lists its refusal on a line of its own.
TE_GRAPHS = ("TransformerEngine's per-layer CUDA graphs (cuda_graph_impl='transformer_engine' or "
             "external_cuda_graph)")
REFUSES_TE_GRAPHS = (f"refused at model construction, if you build: {TE_GRAPHS} (no fix makes it "
                     "right): use cuda_graph_impl='none' (no CUDA graphs) or "
                     "cuda_graph_impl='full_iteration' (full-iteration CUDA graphs, the kind "
                     "upstream supports with Megatron-FSDP)")


def verdict_line(text: str) -> str:
    """The verdict of ``audit`` or ``selftest``: the last line of ``text`` that is not indented
    (the verdict's details below it are; docs/CLI.md, "Verdicts")."""
    return [line for line in text.splitlines() if line and not line.startswith(" ")][-1]


def run_python(code: str, *path: Path | str, env: dict[str, str] | None = None,
               python: str = sys.executable, repo: bool = True, args: tuple[str, ...] = (),
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (or, when ``args`` are given, ``python *args``) in a fresh interpreter with
    ``path`` first on PYTHONPATH, then the repository unless ``repo`` is False."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(p) for p in path] + ([str(REPO)] if repo
                                                                        else []))
    full_env["PYTHONWARNINGS"] = "ignore"
    full_env.update(env or {})
    command = [python, *args] if args else [python, "-c", code]
    return subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout)


@pytest.fixture(scope="session")
def fsdp_release():
    """``fsdp_release("0.5.1")`` → folder holding that megatron-fsdp release, for PYTHONPATH."""
    import releases

    return lambda version: releases.unpacked("megatron-fsdp", version)


def launch_ranks(spec_fields: dict[str, object], rank_env: list[dict[str, str]], tmp: Path,
                 python: str = sys.executable, path: tuple[Path, ...] = (),
                 grace: float = 10.0) -> list[dict | None]:
    """Run the selftest worker as two gloo ranks, each with its own extra environment.

    A rank that is still running ``grace`` seconds after its peer exited is killed (it is stuck
    in a collective its peer left). Returns each rank's JSON report, or None.
    """
    import json
    import time

    from mfsdp_hotfix.selftest.spec import CaseSpec

    spec = CaseSpec(**spec_fields).to_json()  # type: ignore[arg-type]
    procs = []
    for rank, extra in enumerate(rank_env):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
        env.update({"PYTHONPATH": os.pathsep.join([str(p) for p in path] + [str(REPO)]),
                    "PYTHONWARNINGS": "ignore", "GLOO_SOCKET_IFNAME": "lo",
                    "OMP_NUM_THREADS": "1", **extra})
        procs.append(subprocess.Popen(
            [python, "-m", "mfsdp_hotfix.selftest.worker", spec, str(rank), str(len(rank_env)),
             str(tmp / "store"), str(tmp)], env=env, stdout=subprocess.DEVNULL,
            stderr=open(tmp / f"rank{rank}.log", "wb")))
    first_exit = None
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if first_exit is None and any(p.poll() is not None for p in procs):
            first_exit = time.monotonic()
        if first_exit is not None and time.monotonic() - first_exit > grace:
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    reports = []
    for rank in range(len(rank_env)):
        out = tmp / f"rank{rank}.json"
        reports.append(json.loads(out.read_text()) if out.exists() else None)
    return reports


class FixStates(dict[str, str]):
    """Fix id -> state, as ``status`` lists a copy's fixes, compared with an expectation that
    names the fixes a test is about: every fix the expectation leaves out must be "not needed"
    on that copy (a fix added since is not needed there, or the test must say what it does)."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, dict):
            return NotImplemented
        return dict(self) == {**{fix: "not needed" for fix in self if fix not in other}, **other}

    __hash__ = None  # type: ignore[assignment]
