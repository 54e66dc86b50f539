"""What a run came to: its record, read from its log and its capture (the folder
``mlm_inject`` wrote), compared with its truth (its serialized run, ``comparison``; or a reference
that is not the code under test, ``mlm_verdict``), and its outcome."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import comparison
import mlm_verdict

from .plan import AUDITS

OUTCOMES = ("exact", "float noise", "wrong", "crash", "refused", "unsupported", "ok",
            "ran, no truth", "not run")
ERROR_LINE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?([A-Za-z_.]*(?:Error|Exception|Exit))(?::\s*(.*))?$")
AUDIT_LINE = re.compile(r"^audit: ([A-Z ]+|ordered):")


def last_error(log: str) -> str | None:
    """The last ``SomeError: message`` line of a log (the exception that ended the run)."""
    found = None
    for line in log.splitlines():
        m = ERROR_LINE.match(line)
        if m:
            found = f"{m.group(1)}: {(m.group(2) or '').strip()}"[:600]
    return found


def audit_verdict(log: str) -> str | None:
    for line in reversed(log.splitlines()):
        m = AUDIT_LINE.match(line.strip())
        if m:
            return m.group(1).strip()
    return None


def classify(rc: Any, capture: dict[str, Any] | None, iterations: int, error: str | None,
             comparison_outcome: str | None) -> str:
    """exact | wrong (compared with the serialized run) | float noise (with a reference,
    ``mlm_verdict``) | ok (ran, nothing to compare with) | refused (by the hotfix, before its
    first iteration) | unsupported (refused before its first iteration by a check of the
    release) | crash."""
    stages = (capture or {}).get("stages", [])
    done = (capture or {}).get("iterations", 0)
    if rc == 0 and done == iterations:
        return comparison_outcome or "ok"
    if "training" not in stages and (error or "").startswith("UnsupportedConfiguration"):
        return "refused"  # by the hotfix, before training, naming the workaround
    refused = any(e in (error or "") for e in ("AssertionError", "ValueError",
                                                  "NotImplementedError"))
    if "training" not in stages and refused:
        return "unsupported"
    return "crash"




def case_record(rec: dict[str, Any], log: str, folder: str) -> dict[str, Any]:
    """The record of a run (``rec``: its case, command line, exit status and seconds) from its
    log and the capture in its ``folder``, with its outcome."""
    rc = rec["rc"]
    capture = read_capture(folder)
    rec["capture"] = capture
    rec["error"] = ((capture or {}).get("error") or {}).get("type")
    if rec["error"]:
        rec["error"] += ": " + capture["error"]["message"][:600]
    elif rc != 0 and not (rec["variant"] in AUDITS and "(command exit status 0)" in log):
        rec["error"] = last_error(log) or f"exit status {rc}"
    if rec["variant"] in AUDITS:
        audited(rec, log)
    outcome_cmp = compared_with_truth(rec, os.path.join(folder, "capture.pt"))
    rec["outcome"] = classify(rec.get("command_rc", rc), capture, rec["iterations"],
                              rec["error"], outcome_cmp)
    if (capture or {}).get("capture_errors"):
        rec["outcome"] = "crash"
        rec["error"] = "harness: capture failed: " + capture["capture_errors"][0]
    loaded = (capture or {}).get("hotfix_loaded")
    if loaded is not None and loaded != (rec["variant"] in ("hotfix",) + AUDITS):
        # the run is not what its label says: never report it as a result
        rec["outcome"] = "crash"
        rec["error"] = f"harness: hotfix loaded={loaded} in a {rec['variant']} run"
    if rec["outcome"] == "ok" and rec.get("truth"):
        rec["outcome"] = "ran, no truth"
    if rec["outcome"] not in ("exact", "ok"):
        rec["log_tail"] = log[-5000:]
    rec["log_head_versions"] = [ln for ln in log.splitlines()[:400]
                                if "version" in ln.lower() and ">" in ln][:4]
    return rec


def read_capture(folder: str) -> dict[str, Any] | None:
    """What the capture wrote of the run (None: it wrote nothing)."""
    cap_json = os.path.join(folder, "capture.json")
    capture = None
    if os.path.exists(cap_json):
        with open(cap_json) as f:
            capture = json.load(f)
    return capture


def audited(rec: dict[str, Any], log: str) -> None:
    """An audit run's verdict and the training's own exit status, from its log."""
    # `mfsdp-hotfix audit` exits with its verdict's status when the command succeeded; the
    # training's own exit status is in its last line
    status = re.findall(r"\(command exit status (-?\d+)\)", log)
    rec["command_rc"] = int(status[-1]) if status else None
    rec["audit"] = audit_verdict(log)
    rec["audit_lines"] = [ln for ln in log.splitlines()
                          if "audit" in ln and ("unordered" in ln or ln.startswith("audit:"))][-6:]


def compared_with_truth(rec: dict[str, Any], pt: str) -> str | None:
    """The run's capture (``pt``) against its truth: the comparison's outcome or the verdict
    (None: nothing compared). A truth's capture is kept for the runs compared with it, any other
    removed."""
    if not os.path.exists(pt):
        return None
    outcome_cmp = None
    if rec.get("truth"):
        import torch

        if not os.path.exists(rec["truth"]):
            rec["no_truth"] = ("its reference" if rec.get("judge") else "its serialized run") \
                + " left no capture"
        elif rec.get("judge"):
            # against a reference that is not the code under test: the buffers too where
            # both sides have the same Megatron-FSDP layout (fused against unfused)
            rec["verdict"] = mlm_verdict.judge(torch.load(pt), torch.load(rec["truth"]),
                                               buffers=rec["dp"] == 2)
            outcome_cmp = rec["verdict"]["verdict"]
        else:
            cmp = comparison.compare(torch.load(pt), torch.load(rec["truth"])).to_dict()
            rec["comparison"] = cmp
            outcome_cmp = cmp["outcome"]
    if rec.get("judge") or rec.get("judged"):
        import torch

        rec["reported"] = reported_values(torch.load(pt))
    if rec.get("serialized") or rec.get("judged"):
        rec["capture_file"] = pt  # a truth: kept for the runs compared with it
    else:
        # compared: the buffers of every iteration are half a gigabyte a run, and a whole
        # matrix of them would fill the machine's disk
        os.remove(pt)
    return outcome_cmp


def reported_values(steps: list[dict[str, Any]]) -> dict[str, list[float]]:
    """What Megatron reported each iteration (losses, grad norm), from a capture."""
    names = list(dict.fromkeys(k for step in steps for k in step
                               if k.startswith("loss/") or k == "grad_norm"))
    return {name: [mlm_verdict.reported(step[name]) if name in step else None
                   for step in steps] for name in names}
