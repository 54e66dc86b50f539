"""Megatron-LM's own Megatron-FSDP unit tests from the checkout, through ``torchrun
--nproc-per-node 1 -m pytest``, as shipped and with the hotfix: collected first where they will
run, then each test file in its own process; each test's end read from what the pytest plugin
``mfsdp_val_unit_probe`` wrote."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import sys
import time
from typing import Any

import workdir
from mlm_probe import mfsdp_val_unit_probe

from .launch import REPO, VALIDATION, Paths, free_port, run_process, te_paths, torchrun
from .outcome import last_error
from .plan import UNIT_TESTS

PROBE = os.path.join(VALIDATION, "mlm_probe")  # the unit tests' pytest plugin


def unit_test_command(c: dict[str, Any], paths: Paths, *pytest_args: str
                      ) -> tuple[list[str], dict[str, str]]:
    """The unit tests' command line (through ``mfsdp_hotfix run`` for the hotfix) and
    environment; collecting them and running them differ only in ``pytest_args`` (the last
    ones: what to run, the release's folder unless given)."""
    if not any(not a.startswith("-") for a in pytest_args):
        pytest_args += (UNIT_TESTS[c["release"]],)
    argv = torchrun() + ["--nproc-per-node", "1", "--master-port", str(free_port()), "-m",
                         "pytest", "-p", "no:cacheprovider", "-p", "mfsdp_val_unit_probe",
                         *pytest_args]
    if c["variant"] == "hotfix":
        argv = [sys.executable, "-m", "mfsdp_hotfix", "run", "--"] + argv
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_MAX_CONNECTIONS",
                                                             "MFSDP_HOTFIX")}
    env["PYTHONPATH"] = os.pathsep.join([paths.src[c["release"]], paths.rel[c["release"]],
                                         REPO, PROBE] + te_paths(c, env))
    env["PYTHONUNBUFFERED"] = "1"
    return argv, env


COLLECTED_LINE = re.compile(r"^(tests/\S+\.py::\S+)$")
PYTEST_E_LINE = re.compile(r"^E\s+(\w+(?:Error|Exception)\b.*)$")


def collect_unit_tests(c: dict[str, Any], paths: Paths, timeout: float) -> dict[str, Any]:
    """``pytest --collect-only`` in the very environment the tests will run in: seconds, where a
    module the environment lacks (a file of the checkout left behind, a package the machine does
    not have) would otherwise cost a whole run that tests nothing. Returns the test ids, the
    probe's word on the hotfix, and the errors: where pytest could not import a module, and a
    run whose hotfix is loaded where it must not be, or not where it must."""
    argv, env = unit_test_command(c, paths, "--collect-only", "-q")
    rc, log = run_process(argv, env, paths.src[c["release"]], timeout)
    ids = [m.group(1) for m in map(COLLECTED_LINE.match, log.splitlines()) if m]
    errors = list(dict.fromkeys(m.group(1).strip()[:300]
                                for m in map(PYTEST_E_LINE.match, log.splitlines()) if m))
    if rc != 0 and not errors:
        errors = [last_error(log) or f"exit status {rc}"]
    probe = unit_probe(log)
    if not errors and (probe or {}).get("loaded") != (c["variant"] == "hotfix"):
        errors = [f"harness: the hotfix loaded={(probe or {}).get('loaded')} in the "
                  f"{c['variant']} unit tests' process"]
    return {"ids": ids, "errors": errors, "hotfix": probe}


def unit_probe(log: str) -> dict[str, Any] | None:
    """The last line ``mfsdp_val_unit_probe`` printed (None: the plugin never ran)."""
    found = None
    for line in log.splitlines():
        if line.startswith(mfsdp_val_unit_probe.MARK):
            found = json.loads(line[len(mfsdp_val_unit_probe.MARK):])
    return found


def run_unit_tests(c: dict[str, Any], paths: Paths, timeout: float,
                   collected: list[str]) -> dict[str, Any]:
    """Megatron-LM's Megatron-FSDP unit tests on one GPU, as shipped or with the hotfix: each
    test file in its own ``torchrun`` (a fresh process, as when a user runs one file), the files
    side by side, each with its own temporary folder. Each test's end is read from pytest's
    reports as they come (``unit_test_ends``), so a file cut by the time budget keeps the tests
    it finished (and the run says it was cut)."""
    files = list(dict.fromkeys(test.split("::")[0] for test in collected))
    folder = os.path.join(workdir.run_dir(), "cases", c["id"].replace("|", "_"))

    def one_file(path: str) -> dict[str, Any]:
        argv, env = unit_test_command(c, paths, "-v", path)
        mine = os.path.join(folder, os.path.basename(path))
        env.update(TMPDIR=os.path.join(mine, "tmp"),
                   MFSDP_VAL_UNIT_ENDS=os.path.join(mine, "ends.jsonl"))
        os.makedirs(env["TMPDIR"])
        t0 = time.time()
        rc, log = run_process(argv, env, paths.src[c["release"]], timeout)
        with open(os.path.join(mine, "output.txt"), "w") as f:
            f.write(log)
        return dict(file=path, argv=argv, rc=rc, proc_s=round(time.time() - t0, 1),
                    tests=unit_test_ends(env["MFSDP_VAL_UNIT_ENDS"]), hotfix=unit_probe(log),
                    log=log)

    with cf.ThreadPoolExecutor(len(files)) as ex:
        runs = list(ex.map(one_file, files))
    tests = {t: end for r in runs for t, end in r["tests"].items()}
    cut = [r["file"] for r in runs if r["rc"] == "timeout"]
    rec = dict(c, tests=tests, collected=len(collected), cut=bool(cut),
               hotfix=next((r["hotfix"] for r in runs if r["hotfix"]), None),
               files={r["file"]: {k: r[k] for k in ("argv", "rc", "proc_s")} | {
                   "tests": len(r["tests"])} for r in runs})
    # a file cut by the limit keeps what it finished; the table lists the tests it did not end
    rec["outcome"] = "ok" if tests else "not run" if cut else "crash"
    if cut:
        rec["error"] = f"cut after {timeout:.0f} s, {len(tests)} tests ended: {', '.join(cut)}"
    elif not tests:
        rec["error"] = "; ".join(dict.fromkeys(last_error(r["log"]) or f"exit status {r['rc']}"
                                               for r in runs))
    # pytest's own exits: 0 all passed, 1 some failed; else, or nothing ended, the end is told
    rec["log_tail"] = "".join(r["log"][-2500:] for r in runs
                              if r["rc"] not in (0, 1) or not r["tests"])
    return rec



def unit_test_ends(path: str) -> dict[str, str]:
    """test id -> passed | failed: message | error: message | skipped: reason | xfail | xpass,
    from the lines ``mfsdp_val_unit_probe`` wrote (a test reported twice, e.g. passed then
    errored in teardown, keeps the worse)."""
    out: dict[str, str] = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break  # the line a killed run was writing
            end = json.loads(line)
            if out.get(end["id"], "").split(":")[0] not in ("failed", "error"):
                out[end["id"]] = end["end"]
    return out
