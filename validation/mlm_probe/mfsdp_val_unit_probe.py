"""A pytest plugin (``-p mfsdp_val_unit_probe``) for Megatron-LM's unit tests.

* Once the tests are collected (their modules, and so Megatron-FSDP, imported), it prints whether
  the hotfix is loaded in the process that runs them and what it applied. A run "with the hotfix"
  that did not load it would compare the release with itself, and one "as shipped" that did would
  hide a defect of ours; ``validation/megatron_lm/unit_tests.py`` refuses both.
* Each test's end goes, as it comes, as one JSON line to the file ``MFSDP_VAL_UNIT_ENDS`` names:
  read from pytest's reports, not its terminal, which Megatron-LM's own options (``-s``) mix
  with the tests' prints; a run cut short keeps the ends it reached.
"""

import json
import os
import sys

MARK = "MFSDP_VAL_UNIT_PROBE "


def pytest_collection_finish(session):
    hotfix = sys.modules.get("mfsdp_hotfix")
    found = {"loaded": hotfix is not None}
    if hotfix is not None:
        try:
            status = hotfix.status()
            found.update(state=status["hotfix"], verdict=status["verdict"]["line"][:300])
        except Exception as exc:  # the probe reports; it never fails a test run
            found["error"] = f"{type(exc).__name__}: {exc}"[:300]
    print("\n" + MARK + json.dumps(found), flush=True)


def pytest_runtest_logreport(report):
    """passed | failed: message | skipped: reason | xfail | xpass, or error: message (setup or
    teardown failed); a test's setup, call and teardown each report, the reader keeps the
    worst."""
    path = os.environ.get("MFSDP_VAL_UNIT_ENDS")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    if hasattr(report, "wasxfail"):
        end = "xfail" if report.outcome == "skipped" else "xpass"
    elif report.outcome == "skipped":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        end = "skipped: " + str(reason).removeprefix("Skipped: ")[:200]
    elif report.outcome == "failed":
        crash = getattr(report.longrepr, "reprcrash", None)
        end = ("error" if report.when != "call" else "failed") + (
            f": {crash.message.splitlines()[0][:300]}" if crash and crash.message else "")
    else:
        end = report.outcome
    with open(path, "a") as f:
        f.write(json.dumps({"id": report.nodeid, "end": end}) + "\n")
