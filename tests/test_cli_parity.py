"""``mfsdp-hotfix parity`` end to end on CPU, through the command itself, with a stand-in for
Megatron-LM's ``pretrain_gpt.py`` (``tests/parity/standin``: Megatron-LM's training loop needs a
GPU; the stand-in takes the same flags, writes where Megatron-LM writes and prints its
``training_log`` lines). The GPU proof with the real Megatron-LM is docs/PARITY.md's table.

Covered: the verdicts and their exit statuses; every bad input (no --, no --out, an unknown
script, an --out that cannot be used, a run that crashes, hangs or prints no iteration); the
data-loss guard (the user's checkpoint and data folders byte-identical after parity); and every
way out (SIGINT, SIGTERM, a closed pipe) ending every process of the runs."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_python
from parity.live import alive

from mfsdp_hotfix.commands import exits

STANDIN = REPO / "tests" / "parity" / "standin" / "pretrain_gpt.py"
MEGATRON_FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                 "--ckpt-format", "fsdp_dtensor", "--num-layers", "4", "--seed", "11",
                 "--train-iters", "100000", "--log-interval", "100"]


def parity(tmp_path: Path, *options: str, command: list[str] | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    job = [sys.executable, str(STANDIN), *MEGATRON_FSDP] if command is None else command
    return run_python("", args=("-m", "mfsdp_hotfix", "parity", "--out", str(tmp_path / "out"),
                                *options, "--", *job), env=env, timeout=120)


def test_with_the_hotfix_the_job_matches_its_reference(tmp_path: Path) -> None:
    proc = parity(tmp_path)
    assert proc.returncode == exits.PARITY_MATCH, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    assert "MATCH" in first and len(first) <= 120, first
    assert "parity: candidate: iteration 3/3 (" in proc.stderr
    assert "every run: added --deterministic-mode" in proc.stderr
    for run in ("candidate", "reference"):
        log = (tmp_path / "out" / run / "output.log").read_text()
        assert log.count("] iteration ") == 3, run
        assert (tmp_path / "out" / run / "command.txt").exists()
    reference = (tmp_path / "out" / "reference" / "command.txt").read_text()
    assert "MFSDP_HOTFIX=0" in reference and "--use-megatron-fsdp" not in reference


def test_as_shipped_the_third_run_shows_the_mismatch(tmp_path: Path) -> None:
    proc = parity(tmp_path, "--with-shipped", "--json")
    data = json.loads(proc.stdout)
    assert proc.returncode == exits.PARITY_MATCH and data["verdict"] == "MATCH"
    assert data["shipped"]["verdict"] == "MISMATCH", data["shipped"]


@pytest.mark.parametrize("mode, words", [
    ("crash", "crashed (exit status 1)"),
    ("silent", "printed no iteration line"),
])
def test_a_run_that_crashes_or_prints_nothing_cannot_be_compared(tmp_path: Path, mode: str,
                                                                 words: str) -> None:
    proc = parity(tmp_path, env={"PARITY_STANDIN": mode})
    assert proc.returncode == exits.PARITY_CANNOT_COMPARE, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].startswith("parity: CANNOT COMPARE") or \
        "CANNOT COMPARE" in proc.stdout.splitlines()[0]
    assert words in proc.stdout
    if mode == "crash":
        assert "torch.OutOfMemoryError: CUDA out of memory." in proc.stdout  # its last lines



def pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_a_hang_is_ended_at_the_timeout_with_every_process(tmp_path: Path) -> None:
    record = tmp_path / "pids"
    proc = parity(tmp_path, "--timeout", "2",
                  env={"PARITY_STANDIN": "hang", "PARITY_STANDIN_PIDS": str(record)})
    assert proc.returncode == exits.PARITY_CANNOT_COMPARE, proc.stdout + proc.stderr
    assert "hung: no end within" in proc.stdout and "last iteration 1" in proc.stdout
    assert "candidate: HUNG" in proc.stderr
    assert len(pids(record)) == 6 and not any(alive(pid) for pid in pids(record))


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_users_checkpoint_and_data_folders_are_left_byte_identical(tmp_path: Path) -> None:
    """The stand-in writes into --save, --tensorboard-dir and (without --data-cache-path) next
    to the data, as Megatron-LM does: passed through, each would change."""
    save, data, board = tmp_path / "ckpt", tmp_path / "data", tmp_path / "tb"
    for folder in (save, data, board):
        folder.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("7")
    (data / "corpus_text_document.bin").write_bytes(b"\x00" * 64)
    before = {folder: digest(folder) for folder in (save, data, board)}
    job = [sys.executable, str(STANDIN), *MEGATRON_FSDP, "--ckpt-format", "torch_dist",
           "--save", str(save), "--tensorboard-dir", str(board),
           "--data-path", str(data / "corpus_text_document")]
    proc = parity(tmp_path, command=job)
    assert proc.returncode == exits.PARITY_MATCH, proc.stdout + proc.stderr
    assert {folder: digest(folder) for folder in (save, data, board)} == before
    assert (tmp_path / "out" / "data-cache" / "GPTDataset_indices.npy").exists()
    assert (tmp_path / "out" / "candidate" / "tensorboard" / "events.out.tfevents").exists()
    passed = subprocess.run([*job, "--train-iters", "2"], capture_output=True, text=True)
    assert passed.returncode == 0 and digest(save) != before[save] and digest(data) != before[data]


@pytest.mark.parametrize("options, command, words", [
    ([], ["--out", "X", sys.executable, "pretrain_gpt.py"], "put -- before the launch command"),
    ([], ["--", sys.executable, "pretrain_gpt.py"], "required: --out"),
    (["--out", "X"], ["--"], "parity needs a command"),
    (["--out", "X"], ["--", "bash", "train.sh"], "is a shell script"),
    (["--out", "X"], ["--", "torchrun", "train.py"], "not a Megatron-LM training script"),
    (["--out", "/proc/parity-check"], ["--", sys.executable, str(STANDIN)], "cannot create"),
    (["--out", "X", "--shrink", "8"], ["--", sys.executable, str(STANDIN), "--num-layers", "4"],
     "--shrink 8 cannot be applied"),
    (["--out", "X", "--iters", "0"], ["--", sys.executable, str(STANDIN)], "must be 1 or more"),
])
def test_bad_input_is_a_usage_error_and_runs_nothing(tmp_path: Path, options: list[str],
                                                     command: list[str], words: str) -> None:
    proc = run_python("", args=("-m", "mfsdp_hotfix", "parity", *options, *command))
    assert proc.returncode == exits.USAGE_ERROR, proc.stderr
    assert words in proc.stderr, proc.stderr
    assert not proc.stdout and not (Path.cwd() / "X").exists()


def test_an_out_folder_of_an_earlier_check_or_inside_the_checkpoint_is_refused(
        tmp_path: Path) -> None:
    assert parity(tmp_path).returncode == exits.PARITY_MATCH
    proc = parity(tmp_path)
    assert proc.returncode == exits.USAGE_ERROR and "earlier check" in proc.stderr
    assert parity(tmp_path, "--overwrite").returncode == exits.PARITY_MATCH
    job = [sys.executable, str(STANDIN), "--save", str(tmp_path)]
    proc = parity(tmp_path, command=job)
    assert proc.returncode == exits.USAGE_ERROR and "lies in the job's --save folder" in proc.stderr


def test_dry_run_prints_the_runs_and_runs_nothing(tmp_path: Path) -> None:
    proc = parity(tmp_path, "--dry-run", "--with-shipped")
    assert proc.returncode == 0 and not (tmp_path / "out").exists()
    assert "parity: reference: added --no-gradient-accumulation-fusion" not in proc.stdout
    assert "reference: dropped --use-megatron-fsdp" in proc.stdout
    assert proc.stdout.count(str(STANDIN)) == 3


def start(tmp_path: Path, *redirect: str) -> tuple[subprocess.Popen[str], Path]:
    record = tmp_path / "pids"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
    env.update(PYTHONPATH=str(REPO), PARITY_STANDIN="hang", PARITY_STANDIN_PIDS=str(record))
    child = subprocess.Popen(
        [sys.executable, "-m", "mfsdp_hotfix", "parity", "--out", str(tmp_path / "out"), "--",
         sys.executable, str(STANDIN), *MEGATRON_FSDP],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT if redirect else subprocess.PIPE,
        text=True, env=env)
    return child, record


def wait_for_iteration(child: subprocess.Popen[str]) -> None:
    stream = child.stdout if child.stderr is None else child.stderr
    assert stream is not None
    for line in stream:
        if "candidate: iteration 1/3" in line:
            return
    raise AssertionError("no progress line")


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_every_process_of_the_runs(tmp_path: Path, sig: int, status: int) -> None:
    child, record = start(tmp_path)
    wait_for_iteration(child)
    child.send_signal(sig)
    _, err = child.communicate(timeout=60)
    assert child.returncode == status and "every run's processes were ended" in err
    assert len(pids(record)) == 3 and not any(alive(pid) for pid in pids(record))


def test_a_closed_pipe_ends_every_process_of_the_runs(tmp_path: Path) -> None:
    """``parity ... 2>&1 | head -3``: the reader leaves while a run hangs, printing nothing;
    parity sees the pipe closed within its next poll and ends it all."""
    child, record = start(tmp_path, "2>&1")
    wait_for_iteration(child)
    assert child.stdout is not None
    child.stdout.close()
    began = time.monotonic()
    while child.poll() is None and time.monotonic() < began + 120:
        time.sleep(0.2)
    assert child.returncode == exits.BROKEN_PIPE and time.monotonic() - began < 30
    assert len(pids(record)) == 3 and not any(alive(pid) for pid in pids(record))


def test_through_torchrun_each_run_is_one_launch_of_the_users_command(tmp_path: Path) -> None:
    """Two ranks under torchrun (python -m torch.distributed.run), as a user launches them; the
    last rank prints, as Megatron-LM's does."""
    pytest.importorskip("torch")
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(STANDIN), *MEGATRON_FSDP]
    proc = parity(tmp_path, command=job)
    assert proc.returncode == exits.PARITY_MATCH, proc.stdout + proc.stderr
    assert "torch.distributed.run --standalone --nproc-per-node 2" in (
        tmp_path / "out" / "reference" / "command.txt").read_text()


def test_the_exit_statuses_are_distinct_and_each_verdict_has_one() -> None:
    from mfsdp_hotfix.commands.parity import VERDICT_STATUS
    from mfsdp_hotfix.parity.comparison import Verdict

    assert set(VERDICT_STATUS) == {verdict.value for verdict in Verdict}
    assert len({*VERDICT_STATUS.values(), exits.USAGE_ERROR, exits.CANNOT_START}) == 5


def test_usage_tabulates_every_verdict() -> None:
    usage = (REPO / "docs" / "USAGE.md").read_text()
    table = usage.split("| verdict | meaning |", 1)[1].split("\n\n", 1)[0]
    from mfsdp_hotfix.parity.comparison import Verdict
    assert [row.split("`")[1] for row in table.splitlines()[2:]] == [v.value for v in Verdict]


def test_compare_two_logs_reads_the_precision_from_the_logs(tmp_path: Path) -> None:
    logs = []
    for name, norm in (("reference", "2.100"), ("candidate", "2.134")):
        text = "  bf16 ............................................ True\n" + "".join(
            f" [2026-12-07 03:00:00.000000] iteration {n:8d}/       2 | lm loss: 9.132906E+00 | "
            f"grad norm: {norm} | number of skipped iterations:   0 | number of nan "
            "iterations:   0 |\n" for n in (1, 2))
        (tmp_path / name).write_text(text)
        logs.append(str(tmp_path / name))
    proc = run_python("", args=("-m", "mfsdp_hotfix", "parity", "--compare", *logs))
    assert proc.returncode == exits.PARITY_MISMATCH, proc.stdout + proc.stderr
    assert proc.stdout.startswith("MISMATCH at iteration 1: grad norm 1.6 % off")
    (tmp_path / "plain").write_text((tmp_path / "reference").read_text().split("\n", 1)[1])
    proc = run_python("", args=("-m", "mfsdp_hotfix", "parity", "--compare", logs[0],
                                str(tmp_path / "plain")))
    assert proc.returncode == exits.PARITY_CANNOT_COMPARE and "give --precision" in proc.stdout
    proc = run_python("", args=("-m", "mfsdp_hotfix", "parity", "--compare", logs[0],
                                str(tmp_path / "plain"), "--precision", "bf16"))
    assert proc.returncode == exits.PARITY_MATCH, proc.stdout


def test_the_docs_state_the_defaults_the_code_has() -> None:
    from mfsdp_hotfix.commands.parity import DEFAULT_ITERS, DEFAULT_TIMEOUT

    text = " ".join((REPO / "docs" / "PARITY.md").read_text().split())
    assert f"(default `{DEFAULT_TIMEOUT:.0f}`)" in text
    assert f"(default `--iters {DEFAULT_ITERS}`" in text


def test_shrink_runs_both_sides_with_fewer_layers_and_says_so(tmp_path: Path) -> None:
    proc = parity(tmp_path, "--shrink", "2")
    assert proc.returncode == exits.PARITY_MATCH, proc.stdout + proc.stderr
    assert "layers: 2 on every run (--shrink), not the job's own" in proc.stdout
    for run in ("candidate", "reference"):
        assert "--num-layers 2" in (tmp_path / "out" / run / "command.txt").read_text()


def test_an_out_below_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    proc = run_python("", args=("-m", "mfsdp_hotfix", "parity", "--out",
                                str(tmp_path / "file" / "x"), "--", sys.executable, str(STANDIN)))
    assert proc.returncode == exits.USAGE_ERROR and "is a file, so the folder" in proc.stderr


def test_a_launcher_that_cannot_start_is_said(tmp_path: Path) -> None:
    proc = parity(tmp_path, command=[str(tmp_path / "no-torchrun"), str(STANDIN)])
    assert proc.returncode == exits.CANNOT_START, proc.stderr
    assert "cannot start" in proc.stderr and str(tmp_path / "out") in proc.stderr
