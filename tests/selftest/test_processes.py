"""``kill_tree`` ends a launcher and the ranks ``torchrun`` put in sessions of their own (the real
``torch.distributed.run``, on the CPU)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from mfsdp_hotfix.selftest import processes


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


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
