"""The README and the docs it sends users to are exactly true: the vocabulary (docs/USAGE.md) is
the API's, the cost table (docs/PERFORMANCE.md) is the benchmark's report, the measured counts are
the records', and the install lines do what they say.

The install test runs the README's own commands: the fresh-machine route (a new virtual
environment with the ``selftest`` extra, then the selftest) and, in that environment once it holds
megatron-fsdp 0.5.1 like a training image, the plain install line, which must change neither torch
nor megatron-fsdp.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import releases
from conftest import REPO, verdict_line

from mfsdp_hotfix import reporting

README = (REPO / "README.md").read_text()
USAGE = (REPO / "docs" / "USAGE.md").read_text()
PERFORMANCE = (REPO / "docs" / "PERFORMANCE.md").read_text()


def section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}.*?$(.*?)(?=^## )", README, re.M | re.S)
    assert match, f"README has no section {title!r}"
    return match.group(1)


def shell_lines(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines()
            if line.split("#")[0].strip()]


def table(first_header: str) -> dict[str, str]:
    rows = re.findall(rf"^\| {re.escape(first_header)} \| meaning \|\n\|---\|---\|\n((?:\|.*\n)+)",
                      USAGE, re.M)
    assert rows, f"docs/USAGE.md has no table headed {first_header!r}"
    out = {}
    for row in rows[0].splitlines():
        word, meaning = (cell.strip() for cell in row.strip("|").split("|", 1))
        out[word.strip("`")] = meaning.replace("`", "")
    return out


def test_the_readme_speaks_the_apis_words() -> None:
    hotfix = table("`hotfix`")
    assert set(hotfix) == set(reporting.HOTFIX_STATES)
    for word, meaning in reporting.HOTFIX_STATES.items():
        assert meaning.replace("`", "") in hotfix[word], word
    assert table("fix state, per copy") == {w: m.replace("`", "")
                                            for w, m in reporting.FIX_STATES.items()}


def freeze(pip: Path) -> dict[str, str]:
    out = subprocess.run([str(pip), "list", "--format=json"], capture_output=True, text=True,
                         check=True).stdout
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out)}


@pytest.mark.slow
def test_install_lines_leave_a_training_environment_alone(tmp_path: Path) -> None:
    fresh = shell_lines(section("Try it"))[0]  # the second line is the same with CPU torch
    venv = tmp_path / "try"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MFSDP_HOTFIX", "VIRTUAL_ENV", "PYTHONPATH"))}
    proc = subprocess.run(fresh.replace("/tmp/mfsdp-try", str(venv)), shell=True, cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert verdict_line(proc.stdout).startswith("selftest: PASS: "), proc.stdout

    # That environment now trains with megatron-fsdp 0.5.1, as a user's image would.
    pip = venv / "bin" / "pip"
    wheel = releases.wheel("megatron-fsdp", "0.5.1")
    subprocess.run([str(pip), "install", "--quiet", "--no-deps", str(wheel)], check=True)
    before = freeze(pip)
    assert before["megatron-fsdp"] == "0.5.1" and before["torch"].startswith("2.13.0")
    install = [line for line in shell_lines(section("Install (training images)"))
               if line.startswith("pip ")]  # pip install ., and the pinned wheel's two lines
    assert install == ["pip install .", "pip wheel --no-deps -w dist .",
                       "pip install dist/mfsdp_hotfix-*.whl"]
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    for line in install:  # the wheel goes to a scratch folder, not into the checkout
        subprocess.run(line.replace("dist", str(tmp_path / "dist")), shell=True, cwd=REPO,
                       env=env, check=True, capture_output=True)
    after = freeze(pip)
    assert {k: after.get(k) for k in ("torch", "megatron-fsdp")} == \
        {k: before[k] for k in ("torch", "megatron-fsdp")}


def test_the_summary_line_the_readme_shows_is_the_real_one(fsdp_release) -> None:
    """'Seeing it live in a real job' quotes the summary line; it must be what a job prints."""
    from conftest import run_python

    quoted = re.search(r"e\.g\. `(mfsdp_hotfix: megatron-fsdp 0\.5\.1 [^`]*)`",
                       " ".join(section("Use it").split()))
    assert quoted, "the README no longer quotes a summary line"
    proc = run_python("import mfsdp_hotfix, megatron_fsdp.megatron_fsdp\n"
                      "print(mfsdp_hotfix.summary())", fsdp_release("0.5.1"))
    assert proc.stdout.strip() == quoted.group(1), proc.stderr[-2000:]
    assert "fsdp_double_buffer=True" in section("Who needs it")


def test_evidence_quotes_the_measured_te_matrix() -> None:
    """The fusion-off numbers users act on ('Who needs it' points to them) are the committed
    real-TE records, recounted here."""
    assert "does not protect you" in section("Who needs it")
    text = " ".join(section("Evidence").split())
    rows = json.loads((REPO / "docs" / "validation" / "te-summary.json").read_text())
    later = [r for r in rows if r["release"] != "fsdp-0.4.0" and not r["fuse"]
             and r["variant"] == "shipped" and r["delay_ms"] == 20]
    per_release = {r["release"] for r in later}
    assert f"{len(later) // len(per_release)} fusion-off cases per release and delay" in text
    assert f"{len(per_release)} releases × {len(later) // len(per_release)};" in text
    wrong = [r["rel_l2"] for r in later if r["outcome"] == "wrong"]
    assert f"wrong gradients in {len(wrong)} of {len(later)} fusion-off cases" in text
    assert f"{min(wrong):.2f}–{max(wrong):.2f}" in text
    oldest = [r for r in rows if r["release"] == "fsdp-0.4.0" and not r["fuse"]
              and r["variant"] == "shipped" and not r["delay_wgrad"]]
    exact = sum(r["outcome"] == "exact" for r in oldest)
    assert f"({exact} of {len(oldest)} cases exact," in text
    hotfix = [r for r in rows if not r["fuse"] and r["variant"] == "hotfix"]
    runnable = [r for r in hotfix if not (r["release"] == "fsdp-0.4.0" and r["delay_wgrad"])]
    assert all(r["outcome"] == "exact" for r in runnable)
    assert f"hotfix all {len(runnable)} fusion-off cases" in text


def test_the_cost_table_is_the_benchmark_report() -> None:
    """docs/PERFORMANCE.md, where 'Who needs it' sends users for the cost of the safe choices."""
    assert "docs/PERFORMANCE.md" in section("Who needs it")
    proc = subprocess.run([sys.executable, "benchmarks/safe_choices", "--report",
                           "docs/validation/bench-safe-choices-h200.json"], cwd=REPO,
                          capture_output=True, text=True, check=True)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(rows) > 5 and all(line in PERFORMANCE for line in rows)


def test_the_readme_stays_short() -> None:
    """The depth lives in docs/: the README is the short path (install, check, prove, audit)."""
    assert len(README.splitlines()) <= 220


def test_the_docs_speak_of_the_project_alone() -> None:
    """Facts about what ran and what did not, never about how the work was organised (which
    machine was lent, which session ran it, what device time was kept)."""
    words = re.compile(r"\blent\b|\bthis session\b|\bdevice time\b", re.I)
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        found = words.findall(path.read_text())
        assert not found, (path.name, found)


def test_the_readme_sections_named_elsewhere_exist() -> None:
    """The docs and the package's messages send users to README sections by title (README,
    "Try it"; the README's "…"): each title is one of the README's headings."""
    headings = re.findall(r"^#{2,3} (.+)$", README, re.M)
    named = re.compile(r"README(?:'s)?,? [\"']([^\"']+)[\"']")
    paths = [*sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "mfsdp_hotfix").rglob("*.py"))]
    for path in paths:
        for title in named.findall(path.read_text()):
            assert any(heading.startswith(title) for heading in headings), (path.name, title)


def examples(text: str) -> list[list[str]]:
    """The README's examples of output: its blocks indented by four spaces, each a list of
    lines without that indent."""
    blocks = re.findall(r"(?:^ {4}.+\n)+", text, re.M)
    return [[line[4:] for line in block.splitlines()] for block in blocks]


def test_the_first_screen_is_what_status_prints(fsdp_release) -> None:
    """The first screen's example is the first lines ``status`` prints for megatron-fsdp 0.6.1
    with the hotfix loaded in every new process (here its sitecustomize bootstrap)."""
    from conftest import run_python

    from mfsdp_hotfix import bootstrap

    first_screen = README.split("\n## ", 1)[0]
    assert len(first_screen.splitlines()) <= 32, "the first screen is about 30 lines"
    assert {"pip install .", "mfsdp-hotfix status", "mfsdp-hotfix selftest"} <= set(
        shell_lines(first_screen))
    (shown,) = examples(first_screen)
    proc = run_python("", bootstrap.SITECUSTOMIZE_DIR, fsdp_release("0.6.1"),
                      args=("-m", "mfsdp_hotfix", "status"))
    assert proc.stdout.splitlines()[:len(shown)] == shown, proc.stdout
    assert proc.stdout.splitlines()[len(shown)].startswith("- megatron-fsdp 0.6.1"), proc.stdout


def test_the_audit_example_is_what_the_audit_prints(tmp_path: Path) -> None:
    """'Check your own job' shows the audit's verdict of an ordered job: the first lines the
    command prints for rank files that say so."""
    from conftest import run_python

    (shown,) = examples(README.split("### Check your own job", 1)[1].split("\n## ", 1)[0])
    rank_file = ("import json, os; json.dump({'rank': 0, 'world_size': 1, 'final': True, "
                 "'audit': 'on', 'copies': [{'package': 'megatron_fsdp', 'version': '0.6.1', "
                 "'era': 'C', 'fixes': [], 'reuses': 36, 'unordered': 0, 'unseen': 0, "
                 "'crashed': False}]}, open(os.environ['MFSDP_HOTFIX_AUDIT'] + '.rank0.json', "
                 "'w'))")
    proc = run_python("", args=("-m", "mfsdp_hotfix", "audit", "--out", str(tmp_path / "run1"),
                                "--", sys.executable, "-c", rank_file))
    assert proc.returncode == 0 and proc.stdout.splitlines()[:len(shown)] == shown, proc.stdout
