"""No process and no temporary folder outlives a command, whatever ends it.

``kill_tree`` ends a launcher and the ranks the real ``torchrun`` put in sessions of their own;
``supervised`` ends its children (and the orphans they left) and removes its folders on an
exception and on SIGTERM; and each way a user ends the real ``mfsdp-hotfix selftest`` (CPU, the
real megatron-fsdp 0.6.1) and ``audit`` (a command that starts a process in a session of its
own, as torchrun does) leaves nothing behind: a closed pipe (``| head -1``), Ctrl-C (SIGINT to
the terminal's process group), SIGTERM, and ``timeout``. Every process started is found by a
mark in its environment (``MFSDP_TEST_MARK``, inherited by everything under it); every temporary
folder lands in a ``TMPDIR`` of the test's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO, verdict_line

from mfsdp_hotfix import processes
from mfsdp_hotfix.commands import exits

MARK = "MFSDP_TEST_MARK"


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def marked(mark: str) -> dict[int, str]:
    """Live processes whose environment holds ``MFSDP_TEST_MARK=mark``: pid -> command line."""
    needle = f"{MARK}={mark}".encode()
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and _alive(int(entry)) and int(entry) != os.getpid():
            found[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def left_after(mark: str, settle_s: float = 10.0) -> dict[int, str]:
    """The marked processes still alive ``settle_s`` after the command ended (none: {})."""
    deadline = time.monotonic() + settle_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def wait_for(what: Callable[[], bool], proc: subprocess.Popen[str], limit_s: float = 240
             ) -> None:
    deadline = time.monotonic() + limit_s
    while not what():
        assert proc.poll() is None, f"ended (exit {proc.returncode}) before it was ready"
        assert time.monotonic() < deadline, "not ready in time"
        time.sleep(0.2)


class Command:
    """A command started as a terminal would start a job: in a process group of its own, with
    the mark and a TMPDIR of its own in its environment."""

    def __init__(self, argv: list[str], tmp: Path, shell: bool = False,
                 path: tuple[Path, ...] = ()) -> None:
        self.mark = uuid.uuid4().hex
        self.tmpdir = tmp / "tmp"
        self.tmpdir.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
        env.update({MARK: self.mark, "TMPDIR": str(self.tmpdir), "PYTHONWARNINGS": "ignore",
                    "PYTHONPATH": os.pathsep.join(map(str, (*path, REPO)))})
        self.proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", argv[0]] if shell else argv,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)

    def finish(self, limit_s: float = 120) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=limit_s)
        return self.proc.returncode, out, err

    def kill_leftovers(self) -> None:
        for pid in marked(self.mark):
            processes.kill_tree(pid)


# ---- the mechanism

def test_a_launcher_and_the_rank_torchrun_started_in_its_own_session_are_both_killed(
        tmp_path: Path) -> None:
    pid_file = tmp_path / "rank.pid"
    rank = tmp_path / "rank.py"
    rank.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                    "time.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node", "1", str(rank)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        assert worker in processes.descendants(launcher.pid)
        # the rank is in a session (and group) of its own: killing the launcher's group misses it
        _, _, group, session = Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1] \
            .split()[:4]
        assert group != str(launcher.pid) and session != str(launcher.pid)
        processes.kill_tree(launcher.pid)
        launcher.wait(timeout=60)
        for _ in range(100):
            if not _alive(worker):
                break
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        processes.kill_tree(launcher.pid)


# A child that starts a grandchild in a session of its own (as torchrun starts its ranks), then
# exits at once if told so (the grandchild is then an orphan: no parent leads to it).
SPAWNER = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                     start_new_session=True)
    open(sys.argv[1], "w").close()
    if sys.argv[2] == "sleep":
        time.sleep(300)
""")


@pytest.mark.parametrize("orphan", [False, True])
def test_an_exception_ends_every_child_and_the_orphans_they_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, orphan: bool) -> None:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    ready = tmp_path / "ready"
    with pytest.raises(RuntimeError, match="boom"), processes.supervised() as children:
        folder = children.temp_dir("mfsdp-test-")
        proc = children.start([sys.executable, "-c", SPAWNER, str(ready),
                               "exit" if orphan else "sleep"])
        while not ready.exists():
            time.sleep(0.05)
        if orphan:
            proc.wait()
        assert len(marked(mark)) == 1 + (not orphan)
        raise RuntimeError("boom")
    assert left_after(mark, 5) == {} and not Path(folder).exists()


def test_sigterm_inside_the_block_is_raised_as_stopped_and_the_handler_restored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(processes.Stopped) as stopped, processes.supervised() as children:
        children.start([sys.executable, "-c", "import time; time.sleep(300)"])
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert stopped.value.signum == signal.SIGTERM
    assert left_after(mark, 5) == {} and signal.getsignal(signal.SIGTERM) is before


# ---- the real selftest, ended each way a user ends it

@pytest.fixture
def selftest(fsdp_release, tmp_path: Path):
    started: list[Command] = []

    def start(template: str = "{}") -> Command:
        argv = f"{sys.executable} -m mfsdp_hotfix selftest --path {fsdp_release('0.6.1')}"
        command = Command([template.format(argv)], tmp_path, shell=True)
        started.append(command)
        return command

    yield start
    for command in started:
        command.kill_leftovers()


def workers_running(command: Command) -> bool:
    return sum("mfsdp_hotfix.selftest.worker" in line
               for line in marked(command.mark).values()) >= 2


def assert_nothing_left(command: Command) -> None:
    assert left_after(command.mark) == {}, "processes left running"
    # torch's own compile cache (torchinductor_<user>) is meant to outlive every run: not ours.
    ours = [name for name in os.listdir(command.tmpdir) if not name.startswith("torchinductor_")]
    assert sorted(ours) == [], "temporary folders left"


def test_selftest_into_a_closed_pipe(selftest) -> None:
    """``selftest | head -1``: the next progress line meets a closed pipe."""
    command = selftest("{} | head -1")
    wait_for(lambda: workers_running(command), command.proc)
    status, out, _ = command.finish()
    assert_nothing_left(command)
    assert status == exits.BROKEN_PIPE and out.startswith("selftest: 4 runs on CPU")


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, exits.INTERRUPTED),
                                                (signal.SIGTERM, exits.TERMINATED)])
def test_selftest_stopped_by_a_signal(selftest, signum: int, status: int) -> None:
    """Ctrl-C reaches the terminal's whole process group; ``kill`` the command alone."""
    command = selftest("exec {}")
    wait_for(lambda: workers_running(command), command.proc)
    if signum == signal.SIGINT:
        os.killpg(command.proc.pid, signum)
    else:
        os.kill(command.proc.pid, signum)
    code, out, err = command.finish(limit_s=30)  # not on to the next phase
    assert_nothing_left(command)
    assert code == status, (out, err)
    assert f"mfsdp-hotfix: stopped by {signal.Signals(signum).name}" in err
    assert "selftest: PASS" not in out and "selftest: FAIL" not in out


def test_selftest_under_timeout(selftest) -> None:
    """``timeout N mfsdp-hotfix selftest``: SIGTERM to the command and its process group.

    ``timeout`` learns that its time ran out from SIGALRM; sending it once the workers run makes
    the time run out then, on a fast machine or a slow one.
    """
    command = selftest("exec timeout 600 {}")
    wait_for(lambda: workers_running(command), command.proc)
    os.kill(command.proc.pid, signal.SIGALRM)
    status, _, _ = command.finish(limit_s=30)
    assert_nothing_left(command)
    assert status == 124  # timeout's own status: the time ran out


# ---- the audit of a command whose process starts another in a session of its own

@pytest.fixture
def audited(tmp_path: Path):
    started: list[Command] = []
    (tmp_path / "spawner.py").write_text(SPAWNER)

    def start(template: str = "exec {}") -> Command:
        argv = (f"{sys.executable} -m mfsdp_hotfix audit --out {tmp_path / 'run'} -- "
                f"{sys.executable} {tmp_path / 'spawner.py'} {tmp_path / 'ready'} sleep")
        command = Command([template.format(argv)], tmp_path, shell=True)
        started.append(command)
        return command

    yield start, tmp_path / "ready"
    for command in started:
        command.kill_leftovers()


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, exits.INTERRUPTED),
                                                (signal.SIGTERM, exits.TERMINATED)])
def test_audit_stopped_by_a_signal(audited, signum: int, status: int) -> None:
    start, ready = audited
    command = start()
    wait_for(ready.exists, command.proc)
    if signum == signal.SIGINT:
        os.killpg(command.proc.pid, signum)
    else:
        os.kill(command.proc.pid, signum)
    code, out, err = command.finish(limit_s=60)
    assert_nothing_left(command)
    assert code == status, (out, err)
    assert verdict_line(out).startswith("audit: NO DATA: ")  # what was written so far


def test_audit_under_timeout(audited) -> None:
    start, ready = audited
    command = start("exec timeout 600 {}")
    wait_for(ready.exists, command.proc)
    os.kill(command.proc.pid, signal.SIGALRM)  # timeout's time runs out (see the selftest's)
    status, out, err = command.finish(limit_s=60)
    assert_nothing_left(command)
    assert status == 124, (out, err)


# ---- the GPU route's launcher (its workers replaced by ones that hang: there is no GPU here)

GPU_DRIVER = textwrap.dedent("""
    import sys
    from mfsdp_hotfix.selftest import gpu
    gpu.WORKER = "hanging_worker"
    gpu.run_gpu_selftest(gpu.build_plan(int(sys.argv[1])))
""")


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_gpu_runs_stopped_by_sigterm(tmp_path: Path, gpus: int) -> None:
    """``selftest --gpu`` under SIGTERM: its runs (one process each, or torchrun with ranks in
    sessions of their own) and their folder are gone."""
    (tmp_path / "hanging_worker.py").write_text("import time\ntime.sleep(300)\n")
    command = Command([sys.executable, "-c", GPU_DRIVER, str(gpus)], tmp_path, path=(tmp_path,))
    try:
        workers = 2 * (1 if gpus == 1 else 1 + gpus)  # two runs at least; torchrun and ranks
        wait_for(lambda: sum("hanging_worker" in line
                             for line in marked(command.mark).values()) >= workers, command.proc)
        os.kill(command.proc.pid, signal.SIGTERM)
        status, _, err = command.finish(limit_s=60)
        assert_nothing_left(command)
        assert status == 1 and "Stopped: stopped by SIGTERM" in err, err  # no cli.main here
    finally:
        command.kill_leftovers()
