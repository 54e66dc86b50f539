"""One run, with real processes on CPU: its output kept and followed, its timeout, and its whole
tree ended (a launcher's children in sessions of their own included) on every way out of
``launch.run``: a normal end, a timeout, an exception. (SIGINT, SIGTERM and a closed stdout, which
end the whole command, are tested through the command: tests/test_cli_parity.py; the signals'
mechanism, ``processes.supervised``, in tests/test_processes.py.)"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from parity.live import alive

from mfsdp_hotfix import processes
from mfsdp_hotfix.parity import launch

# A launcher: starts a "rank" in a session of its own (as torchrun does) that sleeps, writes
# both pids, prints Megatron-format iteration lines, then does what argv[1] says.
LAUNCHER = r"""
import os, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                        start_new_session=True)
open(sys.argv[2], "w").write(f"{os.getpid()} {rank.pid}")
for n in (1, 2):
    print(f" [2026-12-07 03:00:00.000000] iteration {n:8d}/       2 | lm loss: 1.0E+00 |",
          flush=True)
if sys.argv[1] == "hang":
    time.sleep(600)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""



def pids_of(path: Path) -> list[int]:
    for _ in range(100):
        if path.exists() and path.read_text():
            return [int(p) for p in path.read_text().split()]
        time.sleep(0.05)
    raise AssertionError("the launcher wrote no pids")


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank left behind holds the output open: the run ends GRACE_SECONDS after its
    launcher (shortened here)."""
    monkeypatch.setattr(launch, "GRACE_SECONDS", 1.0)


def start(tmp_path: Path, how: str, timeout: float = 60.0,
          say: object = None) -> tuple[launch.Outcome, list[int], list[str]]:
    said: list[str] = []
    with processes.supervised() as children:
        outcome = launch.run(children, [sys.executable, "-c", LAUNCHER, how,
                                        str(tmp_path / "pids")],
                             dict(os.environ), str(tmp_path / "output.log"), timeout,
                             say or said.append, "candidate", 2)  # type: ignore[arg-type]
        # ended by launch.run itself, before the block ends
        pids = pids_of(tmp_path / "pids")
        assert not any(alive(pid) for pid in pids), "the rank left behind must be ended"
    return outcome, pids, said


def test_a_normal_end_follows_the_iterations_and_leaves_no_process(tmp_path: Path) -> None:
    outcome, pids, said = start(tmp_path, "0")
    assert outcome.status == 0 and not outcome.timed_out and outcome.last_iteration == 2
    assert said[0].startswith("candidate: iteration 1/2 (") and said[1].startswith(
        "candidate: iteration 2/2 (")
    assert (tmp_path / "output.log").read_text().count("iteration") == 2
    assert not any(alive(pid) for pid in pids), "the rank left behind must be ended"


def test_a_crash_keeps_its_status_and_last_lines(tmp_path: Path) -> None:
    outcome, pids, _ = start(tmp_path, "3")
    assert outcome.status == 3 and outcome.tail[-1].startswith(" [2026") and len(outcome.tail) == 2
    assert not any(alive(pid) for pid in pids)


def test_a_hang_is_ended_at_the_timeout(tmp_path: Path) -> None:
    began = time.monotonic()
    outcome, pids, said = start(tmp_path, "hang", timeout=3.0)
    assert outcome.timed_out and outcome.status is None and outcome.last_iteration == 2
    assert time.monotonic() - began < 3.0 + launch.GRACE_SECONDS + 5
    assert not any(alive(pid) for pid in pids)


def test_an_exception_while_running_ends_the_tree(tmp_path: Path) -> None:
    def closed(line: str) -> None:
        raise BrokenPipeError(line)

    with pytest.raises(BrokenPipeError):
        start(tmp_path, "hang", say=closed)
    assert not any(alive(pid) for pid in pids_of(tmp_path / "pids"))
