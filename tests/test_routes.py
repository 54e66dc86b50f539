"""The routes users type, as they type them, in an environment installed as users install it
(``installed.py``: a fresh venv, the release from its index, this package with ``pip install .``).

The commands come from the README and docs/USAGE.md: ``README_COMMANDS`` is every command their
code blocks and inline code show, and ``ROUTES`` names the test that runs each one; a command
added to (or dropped from) them without its route here fails
``test_every_readme_command_has_a_route``.
A route test takes its command from the README text (``readme``) and changes only what cannot
run here, each change spelled out (``--nproc-per-node 8 train.py`` becomes two ranks of a small
real job, ``/shared/audit/run1`` a scratch folder).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REFUSES_HSDP, REFUSES_TE_GRAPHS, REPO, verdict_line
from installed import Installed  # its session fixture `installed` comes from conftest

pytestmark = pytest.mark.slow

README = (REPO / "README.md").read_text()
USAGE = (REPO / "docs" / "USAGE.md").read_text()
# Sections whose commands are for people working on this repository, not for its users.
NOT_USER_ROUTES = ("How it is built, and tested",)


def _user_text() -> str:
    parts = re.split(r"^(## .*)$", README, flags=re.M)
    keep = [parts[0]]
    for title, body in zip(parts[1::2], parts[2::2], strict=True):
        if title[3:].strip() not in NOT_USER_ROUTES:
            keep.append(body)
    return "\n".join(keep + [USAGE])


def _normalise(command: str) -> str:
    """One line, no comment, no optional ``[--...]`` parts (the default form)."""
    command = command.split(" #")[0] if not command.startswith("#") else ""
    command = re.sub(r"\s*\[--[^\[\]]*\]", "", command)
    return " ".join(command.split())


COMMAND = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(?:mfsdp-hotfix\b|python3? -m (?:mfsdp_hotfix|venv)\b"
                     r"|pip (?:install|wheel)\b)|^[A-Z_]+=\$\(mfsdp-hotfix|^\. \S+/bin/activate$")


def readme_commands() -> set[str]:
    """Every command the README shows users: lines of its ``bash`` blocks, and inline code that
    is a command (``mfsdp-hotfix ...``, ``python -m mfsdp_hotfix ...``, ``pip install ...``,
    ``VAR=$(mfsdp-hotfix ...)``)."""
    text = _user_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    found = {_normalise(line) for block in blocks for line in block.splitlines()}
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found |= {_normalise(span) for span in re.findall(r"`([^`]+)`", prose)}
    return {command for command in found if COMMAND.search(command)}


README_COMMANDS = readme_commands()


def readme(command: str, **changes: str) -> str:
    """``command`` as the README shows it, with each ``old=new`` change applied (``old`` must be
    in it): a README edit that changes the command fails here instead of going untested."""
    assert command in README_COMMANDS, f"the README no longer shows {command!r}"
    for old, new in changes.items():
        assert old in command, (old, command)
        command = command.replace(old, new)
    return command


# README command -> the test here that runs it.
ROUTES = {
    "python3 -m venv /tmp/mfsdp-try && /tmp/mfsdp-try/bin/pip install '.[selftest]' && "
    "/tmp/mfsdp-try/bin/mfsdp-hotfix selftest": "test_readme.py::test_install_lines_leave_a_"
                                                 "training_environment_alone",
    "python3 -m venv /tmp/mfsdp-try && /tmp/mfsdp-try/bin/pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cpu && /tmp/mfsdp-try/bin/pip install '.[selftest]' && "
    "/tmp/mfsdp-try/bin/mfsdp-hotfix selftest": "test_the_try_it_route_names_the_torch_it_installs",
    "pip install .": "installed.py (the fixture) and test_the_install_is_a_wheel_not_the_checkout",
    ". /tmp/mfsdp-try/bin/activate": "test_activate",
    "pip wheel --no-deps -w dist .": "test_a_pinned_wheel",
    "pip install dist/mfsdp_hotfix-*.whl": "test_a_pinned_wheel",
    "mfsdp-hotfix status": "test_status",
    "mfsdp-hotfix status --path DIR": "test_status_path",
    "mfsdp-hotfix help": "test_version_and_help",
    "mfsdp-hotfix --version": "test_version_and_help",
    "mfsdp-hotfix audit --out /tmp/mfsdp-example/run1 -- torchrun --nproc-per-node 2 "
    "examples/train_fsdp.py": "test_the_example_job_through_the_audit",
    "mfsdp-hotfix": "test_no_command_or_an_unknown_one",
    "python -m mfsdp_hotfix status": "test_status",
    "mfsdp-hotfix selftest": "test_selftest",
    "mfsdp-hotfix selftest --audit": "test_selftest_audit",
    "mfsdp-hotfix selftest --gpu": "test_selftest_gpu_without_a_gpu",
    "mfsdp-hotfix audit --out /shared/audit/run1 -- torchrun --nproc-per-node 8 train.py":
        "test_audit",
    "mfsdp-hotfix audit --out PATH -- COMMAND...": "test_audit",
    "mfsdp-hotfix parity --out /shared/parity/run1 -- torchrun --nproc-per-node 8 pretrain_gpt.py "
    "ARGS": "test_parity",
    "mfsdp-hotfix parity --out DIR -- LAUNCH COMMAND...": "test_parity",
    "mfsdp-hotfix run -- torchrun --nproc-per-node 8 train.py": "test_run",
    "mfsdp-hotfix run -- COMMAND...": "test_run",
    "mfsdp-hotfix run": "test_run",
    "mfsdp-hotfix bootstrap-path": "test_bootstrap_path",
    "PYTHONPATH=$(mfsdp-hotfix bootstrap-path):$PYTHONPATH": "test_bootstrap_path",
}

JOB = Path(__file__).resolve().parent / "routes_job.py"
# README's launcher line -> two ranks of the small real job (this machine's CPU).
TWO_RANKS = {"torchrun --nproc-per-node 8 train.py":
             "torchrun --standalone --nproc-per-node 2 job.py store"}


def test_every_readme_command_has_a_route() -> None:
    assert README_COMMANDS == set(ROUTES), (
        f"README commands without a route test: {sorted(README_COMMANDS - set(ROUTES))}; "
        f"route tests of commands the README no longer shows: "
        f"{sorted(set(ROUTES) - README_COMMANDS)}")
    assert "mfsdp-hotfix status [--json] [--check]" in " ".join(README.split())  # parsed as one


def _job(installed: Installed) -> None:
    shutil.copy(JOB, installed.work / "job.py")
    (installed.work / "store").unlink(missing_ok=True)


def _job_line(out: str) -> dict:
    (line,) = [x for x in out.splitlines() if x.startswith("JOB ")]
    return json.loads(line[4:])


def test_the_install_is_a_wheel_not_the_checkout(installed: Installed) -> None:
    print(f"\ninstalled environment built in {installed.setup_s:.1f}s")
    proc = installed.sh("pip show -f mfsdp-hotfix; python -c 'import mfsdp_hotfix.cli as c; "
                        "print(c.__file__)'")
    assert proc.returncode == 0, proc.stderr
    assert "Editable project location" not in proc.stdout
    assert re.search(r"^\s*mfsdp_hotfix\.pth$", proc.stdout, re.M), proc.stdout
    assert "/site-packages/mfsdp_hotfix/cli.py" in proc.stdout.splitlines()[-1]
    versions = installed.sh("pip list --format=json")
    got = {d["name"].lower(): d["version"] for d in json.loads(versions.stdout)}
    assert got["megatron-fsdp"] == "0.5.1" and got["torch"].startswith("2.13.0"), got


def test_status(installed: Installed) -> None:
    plain = installed.sh(readme("mfsdp-hotfix status"))
    assert plain.returncode == 0 and plain.stderr == "", plain.stderr
    lines = plain.stdout.splitlines()
    assert lines[:4] == ["affected: megatron-fsdp 0.5.1 (era B) — protected: the hotfix is armed",
                         "  applies getter-guard, ordered-drain, missed-post-backward, "
                         "zero1-accumulate, reduce-once, single-rank-reduce, inert-warm-up, "
                         "root-forward-hooks, auto-sync-stop",
                         f"  {REFUSES_HSDP}", f"  {REFUSES_TE_GRAPHS}"], lines
    assert lines[4].startswith("- megatron-fsdp 0.5.1 (era B): getter-guard, ordered-drain, "
                               "missed-post-backward, zero1-accumulate, reduce-once, "
                               "single-rank-reduce, inert-warm-up, root-forward-hooks, "
                               "auto-sync-stop would apply; at "), lines
    assert re.fullmatch(r"mfsdp-hotfix \S+, in a new Python process of this environment: the "
                        r"hotfix is armed at interpreter start by \S+/site-packages/"
                        r"mfsdp_hotfix\.pth", lines[5]), lines
    verbose = installed.sh("mfsdp-hotfix status --verbose")
    assert verbose.stdout.splitlines()[0] == lines[0]
    assert "    getter-guard: would apply (" in verbose.stdout
    module = installed.sh(readme("python -m mfsdp_hotfix status"))
    assert (module.returncode, module.stdout, module.stderr) == (0, plain.stdout, "")
    check = installed.sh("mfsdp-hotfix status --check >/dev/null && mfsdp-hotfix status --json")
    assert check.returncode == 0 and json.loads(check.stdout)["unfixed"] == []
    assert json.loads(check.stdout)["verdict"]["line"] == lines[0]


def test_status_path(installed: Installed) -> None:
    """``status --path DIR`` on the installed environment's site-packages folder: the verdict
    for the release installed there, read from disk without importing it."""
    site = installed.sh("python -c \"import sysconfig; print(sysconfig.get_paths()['purelib'])\"")
    folder = site.stdout.strip()
    proc = installed.sh(readme("mfsdp-hotfix status --path DIR", DIR=folder))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:4] == ["affected: megatron-fsdp 0.5.1 (era B) — repaired where the hotfix is "
                         "loaded", "  applies getter-guard, ordered-drain, missed-post-backward, "
                         "zero1-accumulate, reduce-once, single-rank-reduce, inert-warm-up, "
                         "root-forward-hooks, auto-sync-stop", f"  {REFUSES_HSDP}",
                         f"  {REFUSES_TE_GRAPHS}"], lines
    assert lines[4].startswith("- megatron-fsdp 0.5.1 (era B): "), lines
    assert f"for the folder {folder}, read from disk (nothing imported)" in proc.stdout


def test_switched_off(installed: Installed) -> None:
    """``MFSDP_HOTFIX=0``: status says off and --check fails, leaving unfixed only what 0.5.1
    needs; a job's process patches nothing, and says which copy it imported."""
    check = installed.sh("MFSDP_HOTFIX=0 mfsdp-hotfix status --check --verbose")
    assert check.returncode == 1 and check.stdout.startswith(
        "affected: megatron-fsdp 0.5.1 (era B) — NOT protected: MFSDP_HOTFIX=0; use "
        "fsdp_double_buffer=False\n  why: MFSDP_HOTFIX=0\n  why: te-partial-cuda-graphs is not "
        "repaired by the hotfix (it hits TransformerEngine's per-layer CUDA graphs "
        "(cuda_graph_impl='transformer_engine' or external_cuda_graph))\n"
        "  instead: use fsdp_double_buffer=False\n"
        "  instead: for zero1-fused-wgrad-overwrite use "), check.stdout[-2000:]
    assert ": the hotfix is off: MFSDP_HOTFIX=0 switches every fix off" in check.stdout
    assert "    missed-post-backward: off" in check.stdout, check.stdout[-2000:]
    unfixed = check.stdout.split("\nLeft unfixed:\n", 1)[1].splitlines()
    # and the defect nothing refuses with the hotfix off
    assert unfixed.pop().split(": ", 1)[1].startswith("release defect te-partial-cuda-graphs not "
                                                      "repaired"), unfixed
    assert [line.rsplit(": ", 1)[1] for line in unfixed] == [
        "getter-guard off (MFSDP_HOTFIX=0)", "ordered-drain off (MFSDP_HOTFIX=0)",
        "missed-post-backward off (MFSDP_HOTFIX=0)", "zero1-accumulate off (MFSDP_HOTFIX=0)",
        "reduce-once off (MFSDP_HOTFIX=0)",
        "single-rank-reduce off (MFSDP_HOTFIX=0)", "inert-warm-up off (MFSDP_HOTFIX=0)",
        "root-forward-hooks off (MFSDP_HOTFIX=0)", "auto-sync-stop off (MFSDP_HOTFIX=0)"], unfixed
    proc = installed.sh("MFSDP_HOTFIX=0 python -c 'import megatron_fsdp, mfsdp_hotfix; "
                        "print(mfsdp_hotfix.summary()); "
                        "print(mfsdp_hotfix.status()[\"copies\"][0][\"imported\"])\n"
                        "import json; s = mfsdp_hotfix.status(); print(json.dumps("
                        "[s[\"hotfix\"], s[\"loaded_via\"], s[\"copies\"][0][\"fixes\"]"
                        "[\"getter-guard\"][\"state\"]]))'")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary, imported, states = proc.stdout.splitlines()
    assert summary == "mfsdp_hotfix: megatron-fsdp 0.5.1 era B: nothing applied (MFSDP_HOTFIX=0)"
    assert imported == "True" and json.loads(states) == ["off", "pth", "off"]


def test_a_misspelt_switch(installed: Installed) -> None:
    """``MFSDP_HOTFX=0`` (a letter missing) leaves the hotfix armed: every process says so on
    stderr, once, and status still answers protected on stdout."""
    warning = ("mfsdp_hotfix: warning: MFSDP_HOTFX is not a variable mfsdp_hotfix reads (did "
               "you mean MFSDP_HOTFIX?); it is ignored\n")
    check = installed.sh("MFSDP_HOTFX=0 mfsdp-hotfix status --check")
    assert (check.returncode, check.stderr) == (0, warning), check.stderr
    assert check.stdout.startswith("affected: megatron-fsdp 0.5.1 (era B) — protected: ")
    plain = installed.sh("MFSDP_HOTFX=0 python -c pass")
    assert (plain.returncode, plain.stderr) == (0, warning), plain.stderr


def test_activate(installed: Installed) -> None:
    """After 'Try it', the README's activation line puts that environment's ``mfsdp-hotfix`` and
    ``torchrun`` first (here the installed environment in place of /tmp/mfsdp-try)."""
    line = readme(". /tmp/mfsdp-try/bin/activate", **{"/tmp/mfsdp-try": str(installed.root)})
    proc = installed.sh(f"{line} && command -v mfsdp-hotfix torchrun",
                        env={"PATH": "/usr/bin:/bin", "VIRTUAL_ENV": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(installed.root / "bin" / name)
                                   for name in ("mfsdp-hotfix", "torchrun")]


def test_a_pinned_wheel(installed: Installed) -> None:
    """The README's two lines that pin a version: the wheel built from the source tree, then
    that file installed, with its dependencies (here into a fresh environment, with the pip
    options of installed.py)."""
    build = installed.sh(readme("pip wheel --no-deps -w dist .", **{" .": f" {REPO}"}))
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (installed.work / "dist").glob("mfsdp_hotfix-*.whl")
    options = os.environ.get("MFSDP_TEST_ROUTES_PIP", "")
    proc = installed.sh("python -m venv fresh && fresh/bin/" + readme(
        "pip install dist/mfsdp_hotfix-*.whl", **{"pip install": f"pip install -q {options}"})
        + " && fresh/bin/mfsdp-hotfix --version && ls fresh/lib/python*/site-packages",
        timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    version = wheel.name.split("-")[1]
    assert proc.stdout.splitlines()[0] == f"mfsdp-hotfix {version}", proc.stdout
    assert "mfsdp_hotfix.pth" in proc.stdout.split()


@pytest.mark.parametrize("bootstrap, loaded_via, state", [
    ("", "pth", "applied"),  # the installed .pth: nothing to add to the script
    ("MFSDP_HOTFIX_BOOTSTRAP=0 ", None, None),  # opted out: the process has no hotfix
])
def test_pth_route(installed: Installed, bootstrap: str, loaded_via: str | None,
                   state: str | None) -> None:
    """A plain ``python`` that imports Megatron-FSDP (and never mfsdp_hotfix) is repaired."""
    proc = installed.sh(
        bootstrap + "python -c 'import sys, json, megatron_fsdp.megatron_fsdp\n"
        "m = sys.modules.get(\"mfsdp_hotfix\")\n"
        "s = m.status() if m else None\n"
        "print(json.dumps(s and [s[\"loaded_via\"], s[\"hotfix\"], "
        "s[\"copies\"][0][\"fixes\"][\"getter-guard\"][\"state\"]]))'")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got == (None if loaded_via is None else [loaded_via, "active", state])


def test_explicit_import(installed: Installed) -> None:
    """``import mfsdp_hotfix`` works where the .pth is off (any import order)."""
    proc = installed.sh("MFSDP_HOTFIX_BOOTSTRAP=0 python -c 'import megatron_fsdp.megatron_fsdp\n"
                        "import mfsdp_hotfix\nprint(mfsdp_hotfix.summary())\n"
                        "s = mfsdp_hotfix.status(); print(s[\"loaded_via\"], s[\"hotfix\"])'")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "import active", proc.stdout


def test_selftest(installed: Installed) -> None:
    proc = installed.sh(readme("mfsdp-hotfix selftest"))
    last = verdict_line(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last == ("selftest: PASS: with the hotfix, megatron-fsdp 0.5.1 gradients equal plain "
                    "PyTorch; without it: UNORDERED"), last
    assert "\n  without it: UNORDERED, at one rank WRONG GRADS\n" in proc.stdout
    assert "and at one rank gradients equal plain PyTorch too" in proc.stdout
    assert f"megatron-fsdp 0.5.1 (standalone) at {installed.root}" in proc.stdout


def test_selftest_audit(installed: Installed) -> None:
    """With no other flag (the default ``--flavour auto``) this once counted 0 reuses and failed."""
    proc = installed.sh(readme("mfsdp-hotfix selftest --audit"))
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    audit = [line for line in lines if line.startswith("audit, ")]
    assert len(audit) == 4 and all(line.endswith("audit on: agrees") for line in audit), audit
    assert re.match(r"audit, without hotfix: [1-9]\d* unordered of [1-9]\d* gradient-slot reuses",
                    audit[0])
    assert verdict_line(proc.stdout).startswith("selftest: PASS: ") and lines[-1] == (
        "  the audit's counts equal the stand-in's"), lines[-1]


def test_selftest_gpu_without_a_gpu(installed: Installed) -> None:
    proc = installed.sh(readme("mfsdp-hotfix selftest --gpu"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert verdict_line(proc.stdout).startswith("selftest: CANNOT RUN: "), proc.stdout
    assert "\n  the GPU selftest cannot run here: " in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("switch, verdict, exit_status",
                         [("", "ordered", 0), ("MFSDP_HOTFIX=0 ", "UNORDERED", 3)])
def test_audit(installed: Installed, tmp_path: Path, switch: str,
               verdict: str, exit_status: int) -> None:
    """The README's audit line on a small real job (with MFSDP_HOTFIX=0: the diagnosis of the
    release as shipped)."""
    _job(installed)
    out = tmp_path / "audit" / "run1"
    proc = installed.sh(switch + readme(
        "mfsdp-hotfix audit --out /shared/audit/run1 -- torchrun --nproc-per-node 8 train.py",
        **{"/shared/audit/run1": str(out)}, **TWO_RANKS))
    text = proc.stdout + proc.stderr
    assert proc.returncode == exit_status, text[-4000:]
    assert verdict_line(proc.stdout).startswith(f"audit: {verdict}: "), text[-4000:]
    assert verdict_line(proc.stdout).endswith("(command exit status 0)") or (
        "\n  command exit status 0\n" in proc.stdout), text[-4000:]
    assert sorted(p.name for p in out.parent.iterdir()) == ["run1.rank0.json", "run1.rank1.json"]
    job = _job_line(proc.stdout)
    assert job["loaded_via"] == "sitecustomize" and not job["crashed"], job
    assert job["max_abs_grad_error"] == 0.0, job


def test_the_example_job_through_the_audit(installed: Installed) -> None:
    """examples/train_fsdp.py as docs/AUDIT.md runs it (``--standalone`` added: a free port,
    whatever else runs here): the audit creates the folder and says so, rank 0's job line
    reaches stderr although its verdict, ordered, is INFO; run again, it keeps the first run's
    rank files unless --overwrite is given."""
    shutil.copy(REPO / "examples" / "train_fsdp.py", installed.work / "train_fsdp.py")
    example = installed.work / "mfsdp-example"
    shutil.rmtree(example, ignore_errors=True)
    changes = {"torchrun --nproc": "torchrun --standalone --nproc",
               "examples/train_fsdp.py": "train_fsdp.py", "/tmp/mfsdp-example": str(example)}
    command = readme("mfsdp-hotfix audit --out /tmp/mfsdp-example/run1 -- torchrun "
                     "--nproc-per-node 2 examples/train_fsdp.py", **changes)
    proc = installed.sh(command)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stderr.startswith(f"mfsdp-hotfix audit: created the folder {example} for the "
                                  "rank files"), proc.stderr
    # docs/AUDIT.md (where the README sends users) names the warnings of Megatron-FSDP on CPU
    # that are expected there
    assert "using device cpu instead of the current device cuda:0" in proc.stderr
    assert ("`Megatron-FSDP is using device cpu instead of the current device cuda:0`"
            in " ".join((REPO / "docs" / "AUDIT.md").read_text().split()))
    assert re.search(r"^mfsdp_hotfix audit, 2 ranks: ordered: 0 unordered of [1-9]\d* "
                     r"gradient-slot reuses", proc.stderr, re.M), proc.stderr[-3000:]
    assert ("mfsdp_hotfix: megatron-fsdp 0.5.1 era B: getter-guard, ordered-drain, "
            "missed-post-backward, zero1-accumulate, reduce-once, single-rank-reduce"
            ) in proc.stdout
    assert verdict_line(proc.stdout).startswith("audit: ordered: ")
    files = sorted(example.iterdir())
    written = [f.read_bytes() for f in files]
    again = installed.sh(command)
    assert again.returncode == 2 and again.stdout == "", again.stdout
    assert "add --overwrite to delete them first; nothing was run" in again.stderr
    assert [f.read_bytes() for f in sorted(example.iterdir())] == written


def test_audit_around_the_selftest_says_why_it_has_no_data(installed: Installed,
                                                          tmp_path: Path) -> None:
    """``mfsdp-hotfix audit --out P -- mfsdp-hotfix selftest``: the selftest says that it does
    not pass the audit on (here ``selftest --gpu`` without a GPU, which says it at once)."""
    proc = installed.sh(f"mfsdp-hotfix audit --out {tmp_path / 'p'} -- mfsdp-hotfix selftest "
                        "--gpu", env={"CUDA_VISIBLE_DEVICES": ""})
    lines = proc.stdout.splitlines()
    assert proc.returncode == 2 and lines[0].startswith(
        "selftest: note: MFSDP_HOTFIX_AUDIT is set (as 'mfsdp-hotfix audit' sets it), but the "
        "selftest does not pass it to its workers"), proc.stdout
    assert verdict_line(proc.stdout).startswith("audit: NO DATA: ")
    assert "selftest --audit" in proc.stdout
    assert "selftest: CANNOT RUN: " in proc.stdout


def test_version_and_help(installed: Installed) -> None:
    version = installed.sh("mfsdp-hotfix --version; pip show mfsdp-hotfix")
    assert version.returncode == 0, version.stderr
    assert re.search(r"^Version: (\S+)$", version.stdout, re.M).group(1) == (
        version.stdout.splitlines()[0].removeprefix("mfsdp-hotfix "))
    for topic in ("", " audit"):
        helped = installed.sh(f"mfsdp-hotfix help{topic}")
        assert helped.returncode == 0 and helped.stderr == "", helped.stderr
        assert helped.stdout == installed.sh(f"mfsdp-hotfix{topic} --help").stdout


def test_run(installed: Installed) -> None:
    """``mfsdp-hotfix run``: the job's processes load the hotfix through the sitecustomize it
    puts on PYTHONPATH (it arms after the .pth, so loaded_via says which route ran last)."""
    _job(installed)
    proc = installed.sh(readme("mfsdp-hotfix run -- torchrun --nproc-per-node 8 train.py",
                               **TWO_RANKS))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    job = _job_line(proc.stdout)
    assert job["loaded_via"] == "sitecustomize" and job["hotfix"] == "active", job
    assert job["fixes"]["megatron_fsdp getter-guard"] == "applied", job
    assert job["summary"].startswith("mfsdp_hotfix: megatron-fsdp 0.5.1 era B: getter-guard, "
                                     "ordered-drain"), job


def test_parity(installed: Installed, tmp_path: Path) -> None:
    """The README's parity line, torchrun and two ranks, on the stand-in for Megatron-LM's
    pretrain_gpt.py (its training loop needs a GPU): MATCH, the runs' output kept in --out."""
    standin = REPO / "tests" / "parity" / "standin" / "pretrain_gpt.py"
    assert "mfsdp-hotfix parity --out DIR -- LAUNCH COMMAND..." in README_COMMANDS
    proc = installed.sh(readme(
        "mfsdp-hotfix parity --out /shared/parity/run1 -- torchrun --nproc-per-node 8 "
        "pretrain_gpt.py ARGS", **{"/shared/parity/run1": str(tmp_path / "run1"),
                                   "torchrun --nproc": "torchrun --standalone --nproc",
                                   "8 pretrain_gpt.py ARGS": f"2 {standin} --use-megatron-fsdp "
                                                             "--num-layers 2"}))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.startswith("MATCH: "), proc.stdout
    assert (tmp_path / "run1" / "reference" / "output.log").read_text().count("] iteration ") == 3


def test_bootstrap_path(installed: Installed) -> None:
    """For job scripts: the folder, and the README's PYTHONPATH line, with the .pth off so that
    only that line can load the hotfix."""
    folder = installed.sh(readme("mfsdp-hotfix bootstrap-path"))
    assert folder.returncode == 0 and folder.stderr == ""
    assert (Path(folder.stdout.strip()) / "sitecustomize.py").is_file(), folder.stdout
    assert Path(folder.stdout.strip()).is_relative_to(installed.root)
    line = readme("PYTHONPATH=$(mfsdp-hotfix bootstrap-path):$PYTHONPATH")
    proc = installed.sh(f"export {line}; MFSDP_HOTFIX_BOOTSTRAP=0 python -c 'import "
                        "megatron_fsdp.megatron_fsdp, mfsdp_hotfix; s = mfsdp_hotfix.status(); "
                        "print(s[\"loaded_via\"], s[\"hotfix\"])'")
    assert (proc.returncode, proc.stdout.strip()) == (0, "sitecustomize active"), proc.stderr


@pytest.mark.parametrize("command, loaded_via", [
    ("python -S", "not loaded"),  # no site: no .pth, no sitecustomize
    ("python -I", "pth"),  # ignores PYTHONPATH, still runs site-packages' .pth
    ("mfsdp-hotfix run -- python -E", "pth"),  # -E: run's PYTHONPATH is ignored, the .pth is not
    ("MFSDP_HOTFIX_BOOTSTRAP=0 mfsdp-hotfix run -- python", "sitecustomize"),
    ("MFSDP_HOTFIX_BOOTSTRAP=0 mfsdp-hotfix run -- python -E", "not loaded"),
])
def test_interpreter_flags(installed: Installed, command: str, loaded_via: str) -> None:
    """The README's word on ``-S``, ``-I`` and ``-E`` against each automatic route."""
    proc = installed.sh(command + " -c 'import sys; m = sys.modules.get(\"mfsdp_hotfix\"); "
                        "print(m.trigger.loaded_via if m else \"not loaded\")'")
    assert (proc.returncode, proc.stdout.strip()) == (0, loaded_via), proc.stderr
    assert "`python -S` disables every automatic route" in USAGE


# ---- bad input and odd uses, from the same user's view


def test_no_command_or_an_unknown_one(installed: Installed) -> None:
    for command, words in ((readme("mfsdp-hotfix"), "bootstrap-path  print the folder"),
                           ("mfsdp-hotfix frobnicate", "invalid choice: 'frobnicate'"),
                           ("mfsdp-hotfix run", "run needs a command"),
                           ("mfsdp-hotfix audit -- true", "required: --out"),
                           ("mfsdp-hotfix status --jsn", "unrecognized arguments: --jsn")):
        proc = installed.sh(command)
        assert proc.returncode == 2 and proc.stdout == "", (command, proc.stdout)
        assert proc.stderr.startswith("usage: mfsdp-hotfix") and words in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_command_that_does_not_exist(installed: Installed) -> None:
    for verb in ("run --", "audit --out a/run1 --"):
        proc = installed.sh(f"mfsdp-hotfix {verb} no-such-command-here")
        assert proc.returncode == 127, proc.stderr
        assert "cannot start 'no-such-command-here'" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("out, words", [
    ("job.py", "is an existing file"),  # a file where the rank files' prefix goes
    ("job.py/run1", "job.py is a file, so the folder"),
    ("scratch", "is a folder"),
    ("new/", "is a folder"),
    ("/proc/x", "cannot create a file in /proc"),  # as root, os.access says yes to it
])
def test_audit_out_that_cannot_hold_rank_files(installed: Installed, out: str,
                                               words: str) -> None:
    _job(installed)
    (installed.work / "scratch").mkdir(exist_ok=True)
    proc = installed.sh(f"mfsdp-hotfix audit --out {out} -- touch ran")
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.startswith(f"mfsdp-hotfix audit: --out {out}: ") and words in proc.stderr
    assert proc.stderr.rstrip().endswith("nothing was run"), proc.stderr
    assert not (installed.work / "ran").exists()


def test_a_closed_pipe_is_quiet(installed: Installed) -> None:
    """``mfsdp-hotfix status | head -1``: no traceback; a reader already gone (the read end is
    closed before it starts, so that the first write fails whatever the timing) ends ``status``
    quietly with its own exit status (here 0), and another command with the shell's SIGPIPE
    status, 141 (docs/CLI.md)."""
    head = installed.sh("mfsdp-hotfix status | head -1")
    assert head.returncode == 0 and head.stderr == "", head.stderr
    assert head.stdout.startswith("affected: ") and head.stdout.count("\n") == 1  # the answer
    for command in ("mfsdp-hotfix status", "mfsdp-hotfix status --json",
                    "python -m mfsdp_hotfix status", "mfsdp-hotfix --help"):
        read, write = os.pipe()
        os.close(read)
        try:
            gone = subprocess.run(["bash", "-c", command], stdout=write, stderr=subprocess.PIPE,
                                  env=installed.env, cwd=installed.work, text=True, timeout=120)
        finally:
            os.close(write)
        expected = 141 if "--help" in command else 0
        assert (gone.returncode, gone.stderr) == (expected, ""), (command, gone.stderr)


@pytest.mark.parametrize("command", ["", "status", "selftest", "run", "audit", "bootstrap-path",
                                     "help"])
def test_help_is_plain(installed: Installed, command: str) -> None:
    """Plain text at 80 columns: no markup, every argument explained, no traceback."""
    proc = installed.sh(f"mfsdp-hotfix {command} --help", env={"COLUMNS": "80"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    text = proc.stdout
    assert "`" not in text and "\\|" not in text and "``" not in text, text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert text.startswith(f"usage: mfsdp-hotfix {command}".rstrip())
    description = text.split("\n\n")[1]
    assert not description.startswith(("options:", "positional")), f"no description: {text}"
    for block in text.split("\n\n"):  # every argument line has its help beside or below it
        lines = block.splitlines()
        if lines[0] in ("positional arguments:", "options:"):
            lines = lines[1:]
        elif not lines[0].startswith("  -"):
            continue
        for i, line in enumerate(lines):
            if re.match(r"  \S", line) and not re.search(r"\S {2,}\S", line):
                below = lines[i + 1] if i + 1 < len(lines) else ""
                assert below.startswith("    ") and below.strip(), f"{line!r} unexplained: {text}"


def test_the_try_it_route_names_the_torch_it_installs() -> None:
    """The 'Try it' text names the torch pin of the ``selftest`` extra, and its CPU line is the
    tested line (test_readme.py runs it) with one step first: that pin from PyTorch's CPU index.
    The CPU index itself is not reached here (no network in CI)."""
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["selftest"]
    (pin,) = [r for r in extra if r.startswith("torch")]
    text = README.split("## Try it", 1)[1].split("\n## ", 1)[0]
    assert f"`{pin}` on Linux is the CUDA build" in " ".join(text.split()), text
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    tested, cpu = (block.strip() for block in blocks)
    venv = "python3 -m venv /tmp/mfsdp-try && "
    assert cpu == tested.replace(venv, f"{venv}/tmp/mfsdp-try/bin/pip install {pin} --index-url "
                                       "https://download.pytorch.org/whl/cpu && ")
    assert readme(cpu) == cpu
