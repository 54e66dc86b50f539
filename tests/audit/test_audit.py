"""The audit's life cycle: off costs nothing, hostile input costs one warning, errors disable it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import run_python

from mfsdp_hotfix import audit, incidents, installer
from mfsdp_hotfix.settings import Settings


@pytest.fixture(autouse=True)
def fresh_incidents(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(incidents, "_failed", {})


def _audit(path: str) -> Any:
    return audit._Audit(Settings(audit_path=path), installer.applied_fingerprint)


def _trained(path: str, group: Any = None) -> Any:
    state = _audit(path)
    state.steps, state.group = 1, group
    return state


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_unwritable_path_gives_one_warning_and_the_job_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mfsdp_hotfix")
    (tmp_path / "file").write_text("")
    state = _trained(str(tmp_path / "file" / "audit"))
    state.write()
    state.write()
    state.finish()  # the job line is still logged (this process alone: world 1)
    warnings = _warnings(caplog)
    failed = [w for w in warnings if "audit-report failed" in w]
    assert len(failed) == 1 and "Point MFSDP_HOTFIX_AUDIT at a writable path" in failed[0]
    # this process saw no slot reuse at all: that is no all-clear, and a warning
    (line,) = [w for w in warnings if w not in failed]
    assert line.startswith("mfsdp_hotfix audit, 1 rank: NOT CHECKED: 0 unordered of 0 ")


def test_an_unwritable_path_is_told_when_the_audit_is_armed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Probed by creating a file when armed (as root os.access says yes to anything), so the
    warning comes before the job trains, not after it."""
    caplog.set_level(logging.INFO, logger="mfsdp_hotfix")
    (tmp_path / "file").write_text("")
    state = _audit(str(tmp_path / "file" / "audit"))
    state._probe()
    (warning,) = _warnings(caplog)
    assert warning.startswith(f"mfsdp_hotfix: audit-report failed in writing {tmp_path}/file/"
                              "audit.rank<N>.json (OSError: ") and "is not a folder" in warning
    state.steps = 1
    state.write()
    state.finish()
    line = _warnings(caplog)[-1]
    assert len(_warnings(caplog)) == 2 and line.endswith(
        f"no rank file could be written at {tmp_path}/file/audit on ranks 0 (their warning says "
        "why)"), line
    incidents._failed.clear()
    _audit(str(tmp_path / "ok" / "audit"))._probe()  # its folder is made, the probe removed
    assert not incidents.disabled(audit.REPORT) and list((tmp_path / "ok").iterdir()) == []


class _FailingStore:
    def set(self, key: str, value: str) -> None:
        raise RuntimeError("store is gone")


def test_a_failing_store_gives_one_warning_and_the_rank_file_is_written(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = _trained(str(tmp_path / "audit"), group=(_FailingStore(), 1, 4))
    state.finish()
    state.finish()  # idempotent
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "audit-summary failed" in warnings[0]
    written = json.loads((tmp_path / "audit.rank1.json").read_text())
    assert written["final"] is True and written["world_size"] == 4


def test_a_bookkeeping_error_disables_the_audit_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = _trained(str(tmp_path / "audit"))
    state.fail("Event.record", RuntimeError("bug"))
    state.fail("Event.wait", RuntimeError("another"))
    assert not state.observer.active
    assert len(_warnings(caplog)) == 1
    written = json.loads((tmp_path / "audit.rank0.json").read_text())
    assert written["audit"] == "disabled: Event.record: RuntimeError: bug"


def test_a_process_that_never_trained_writes_nothing(tmp_path: Path) -> None:
    state = _audit(str(tmp_path / "audit"))
    state.finish()
    assert list(tmp_path.iterdir()) == []


PROBE = """
import json, sys
import mfsdp_hotfix
import torch
import megatron_fsdp.megatron_fsdp
from megatron_fsdp import param_and_grad_buffer as pgb
from mfsdp_hotfix.patching import fix_of
marks = {name: fix_of(vars(cls).get(name)) for cls, name in (
    (torch.cuda.Event, "record"), (torch.cuda.Stream, "wait_event"),
    (pgb.FixedPoolAllocator, "allocate"))}
marks["synchronize"] = fix_of(torch.cuda.synchronize)
print("PROBE" + json.dumps({"audit_imported": "mfsdp_hotfix.audit" in sys.modules,
                            "marks": marks}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, {"MFSDP_HOTFIX": "0"}])
def test_off_costs_nothing(fsdp_release: Any, env: dict[str, str]) -> None:
    out = run_python(PROBE, fsdp_release("0.5.1"), env=env)
    probe = json.loads(out.stdout.split("PROBE", 1)[1])
    assert probe == {"audit_imported": False, "marks": {
        "record": None, "wait_event": None, "allocate": None, "synchronize": None}}, out.stderr


@pytest.mark.slow
def test_on_even_with_the_hotfix_off(fsdp_release: Any, tmp_path: Path) -> None:
    out = run_python(PROBE, fsdp_release("0.5.1"),
                     env={"MFSDP_HOTFIX": "0", "MFSDP_HOTFIX_AUDIT": str(tmp_path / "a")})
    probe = json.loads(out.stdout.split("PROBE", 1)[1])
    assert probe == {"audit_imported": True, "marks": {
        "record": "audit", "wait_event": "audit", "allocate": "audit",
        "synchronize": "audit"}}, out.stderr


def test_the_rank_file_is_rewritten_after_every_finish_grad_sync(tmp_path: Path) -> None:
    state = _audit(str(tmp_path / "audit"))
    state.group = (None, 0, 1)
    for step in (1, 2, 3):
        state.after_step()
        written = json.loads((tmp_path / "audit.rank0.json").read_text())
        assert (written["finish_grad_sync_calls"], written["final"]) == (step, False)


@pytest.mark.parametrize("setup, want", [
    ("", "LINE\n"),  # logging not configured: INFO would be dropped, so stderr
    ("logging.basicConfig()", "LINE\n"),  # configured at WARNING: INFO filtered, so stderr
    ("logging.basicConfig(level=logging.INFO)", "INFO:mfsdp_hotfix:LINE\n"),  # logged, once
])
def test_the_job_line_reaches_stderr_whatever_the_verdict(setup: str, want: str) -> None:
    """An ``ordered`` job line is INFO; it still reaches a person where logging would drop it."""
    proc = run_python(f"import logging\n{setup}\nfrom mfsdp_hotfix import audit\n"
                      "audit._tell(logging.INFO, 'LINE')")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", want), proc.stderr
