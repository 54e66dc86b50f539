"""validation/parity_fixture_logs.py on CPU: the command line it runs (Megatron's own DDP, a
small GPT, 2 iterations, a line per iteration) and the cut of a run's output into a fixture the
reader's tests take."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from training_lines import megatron_line

from mfsdp_hotfix.parity.log_lines import read_log

sys.path.insert(0, str(REPO / "validation"))
import parity_fixture_logs  # noqa: E402


def test_the_runs_are_megatrons_own_ddp_for_two_iterations() -> None:
    argv = parity_fixture_logs.pretrain_args(parity_fixture_logs.CASE)
    assert "--use-megatron-fsdp" not in argv
    assert argv[argv.index("--train-iters") + 1] == "2"
    assert argv[argv.index("--log-interval") + 1] == "1"
    assert argv[argv.index("--transformer-impl") + 1] == "local"


def test_cut_keeps_the_iteration_lines_and_the_capture(tmp_path: Path) -> None:
    out, fixtures = tmp_path / "out", tmp_path / "fixtures"
    (out / "main").mkdir(parents=True)
    fixtures.mkdir()
    lines = ["setup ...", "before", megatron_line(1, {"lm loss": 9.1}, 2.24), "between",
             megatron_line(2, {"lm loss": 9.0}, 2.336), "after", "teardown"]
    (out / "main.log").write_text("\n".join(lines) + "\n")
    (out / "main" / "training_log-rank0.jsonl").write_text(
        json.dumps({"kind": "iteration", "iteration": 1, "grad_norm": 2.2396607}) + "\n")
    (out / "core-0.14.0.log").write_text("Traceback ...\n")
    (out / "runs.json").write_text(json.dumps({
        "main": {"rc": 0, "ref": "HEAD", "commit": "c0ffee"},
        "core-0.14.0": {"rc": 1, "ref": "core_v0.14.0", "commit": "beef"}}))
    done = subprocess.run([sys.executable, str(REPO / "validation/parity_fixture_logs.py"), "cut",
                           str(out), str(fixtures)], capture_output=True, text=True, check=True)
    assert "core-0.14.0: no excerpt (exit 1, 0 iteration lines)" in done.stdout
    assert (fixtures / "main-ddp.log").read_text().splitlines() == lines[1:6]
    run = read_log((fixtures / "main-ddp.log").read_text(), str(fixtures / "main-ddp.capture"))
    assert [it.grad_norm for it in run.iterations] == [2.2396607, 2.336]
    assert not (fixtures / "core-0.14.0-ddp.log").exists()
