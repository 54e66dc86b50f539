"""``mfsdp-hotfix audit``: the command runs with the variable and the bootstrap, its exit status
passes through, and the summary's first line says what the rank files say (no megatron needed:
the commands here write or skip the rank files themselves)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import run_python, verdict_line

from mfsdp_hotfix import bootstrap
from mfsdp_hotfix.verdict_text import FIRST_LINE_MAX

WRITE_RANK_FILE = """
import json, os, sys
path = os.environ["MFSDP_HOTFIX_AUDIT"]
assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == sys.argv[1], os.environ["PYTHONPATH"]
copy = {"package": "megatron_fsdp", "version": "0.5.1", "era": "B", "fixes": [],
        "reuses": int(sys.argv[3]), "unordered": int(sys.argv[2]), "unseen": 0,
        "first_unordered": None, "crashed": False}
json.dump({"rank": 0, "world_size": 1, "final": True, "audit": "on", "copies": [copy]},
          open(path + ".rank0.json", "w"))
"""


def _audit(tmp_path: Path, *command: str, overwrite: bool = False) -> tuple[int, list[str]]:
    out = run_python("", args=("-m", "mfsdp_hotfix", "audit", "--out", str(tmp_path / "a"),
                               *(["--overwrite"] if overwrite else []), "--", *command))
    lines = out.stdout.splitlines()
    assert all(len(line) <= FIRST_LINE_MAX for line in lines if not line.startswith(" ")), lines
    assert verdict_line(out.stdout) == lines[0], lines  # the command printed nothing
    return out.returncode, lines


def test_the_verdict_is_the_first_line_and_sets_the_exit_status(tmp_path: Path) -> None:
    status, lines = _audit(tmp_path, sys.executable, "-c", WRITE_RANK_FILE,
                           str(bootstrap.SITECUSTOMIZE_DIR), "24", "36")
    assert status == 3, lines
    assert "  megatron_fsdp 0.5.1 (era B), ranks 0: UNORDERED: 24 unordered of 36 "\
        "gradient-slot reuses" in lines and "    hotfix fixes applied: none" in lines, lines
    assert lines[:2] == ["audit: UNORDERED: a gradient slot was reused before its "
                         "reduce-scatter was done; load the hotfix", "  command exit status 0"]
    assert lines[2].startswith("  a gradient-buffer slot was reused by a stream not ordered")
    status, lines = _audit(tmp_path, sys.executable, "-c", WRITE_RANK_FILE,
                           str(bootstrap.SITECUSTOMIZE_DIR), "0", "36", overwrite=True)
    assert lines[2].endswith("(1 from an earlier run deleted first: --overwrite)"), lines
    assert lines[0] == ("audit: ordered: every gradient-slot reuse was ordered; nothing to do "
                        "(command exit status 0)") and status == 0


def test_nothing_checked_is_not_ordered_and_not_exit_0(tmp_path: Path) -> None:
    status, lines = _audit(tmp_path, sys.executable, "-c", WRITE_RANK_FILE,
                           str(bootstrap.SITECUSTOMIZE_DIR), "0", "0")
    assert status == 4, lines
    assert lines[0] == ("audit: NOT CHECKED: no gradient-slot reuse was seen: nothing checked; see "
                        "why below (command exit status 0)"), lines
    assert lines[1].startswith("  the audit watched the job but saw no gradient-slot reuse"), lines


def test_no_rank_file_is_no_data_and_a_failing_command_keeps_its_status(tmp_path: Path) -> None:
    (tmp_path / "a.rank3.json").write_text(json.dumps({"rank": 3, "copies": []}))
    status, lines = _audit(tmp_path, sys.executable, "-c", "raise SystemExit(3)",
                           overwrite=True)
    assert status == 3  # the command's own failure wins
    assert lines[0].startswith("audit: NO DATA: ") and not (tmp_path / "a.rank3.json").exists()


def test_a_command_is_required(tmp_path: Path) -> None:
    """A usage error of audit's own: its usage, and an example that keeps the required --out."""
    for rest in ([], ["--"]):
        out = run_python("", args=("-m", "mfsdp_hotfix", "audit", "--out", str(tmp_path / "a"),
                                   *rest))
        assert out.returncode == 2 and out.stderr == (
            "usage: mfsdp-hotfix audit --out PATH -- COMMAND [ARGS...]\n"
            "mfsdp-hotfix audit: error: audit needs a command: mfsdp-hotfix audit --out "
            f"{tmp_path / 'a'} -- torchrun ... train.py\n"), out.stderr


def test_an_earlier_run_is_kept_unless_overwrite_is_given(tmp_path: Path) -> None:
    """Rank files already at --out are evidence: the audit refuses before running anything and
    names the flag that deletes them."""
    earlier = tmp_path / "a.rank0.json"
    earlier.write_text("{}")
    out = run_python("", args=("-m", "mfsdp_hotfix", "audit", "--out", str(tmp_path / "a"),
                               "--", "touch", str(tmp_path / "ran")))
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert "rank files of an earlier run are there (a.rank0.json)" in out.stderr, out.stderr
    assert "add --overwrite to delete them first; nothing was run" in out.stderr, out.stderr
    assert earlier.read_text() == "{}" and not (tmp_path / "ran").exists()


def test_a_missing_folder_is_created_and_said_so(tmp_path: Path) -> None:
    out = run_python("", args=("-m", "mfsdp_hotfix", "audit", "--out",
                               str(tmp_path / "new" / "deeper" / "a"), "--", "true"))
    assert (tmp_path / "new" / "deeper").is_dir(), out.stderr
    assert (f"mfsdp-hotfix audit: created the folder {tmp_path / 'new' / 'deeper'} for the "
            "rank files") in out.stderr
    assert verdict_line(out.stdout).startswith("audit: NO DATA: ") and out.returncode == 4


def test_an_out_no_one_can_write_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """Probed by creating a file: as root (training containers) os.access says yes to /proc."""
    out = run_python("", args=("-m", "mfsdp_hotfix", "audit", "--out", "/proc/x", "--", "touch",
                               str(tmp_path / "ran")))
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr == ("mfsdp-hotfix audit: --out /proc/x: cannot create a file in /proc: it "
                          "is on a proc filesystem, which takes no new files; nothing was "
                          "run\n"), out.stderr
    assert not (tmp_path / "ran").exists()


def test_a_command_that_cannot_start_leaves_no_folder_behind(tmp_path: Path) -> None:
    out = run_python("", args=("-m", "mfsdp_hotfix", "audit", "--out",
                               str(tmp_path / "new" / "deeper" / "a"), "--", "no-such-command"))
    assert out.returncode == 127 and out.stderr.startswith(
        "mfsdp-hotfix audit: cannot start 'no-such-command': "), out.stderr
    assert "created the folder" not in out.stderr and list(tmp_path.iterdir()) == []


def test_ranks_that_could_not_write_are_told_so_not_no_data(tmp_path: Path) -> None:
    """The folder became unwritable while the job ran (here: replaced by a file): the verdict
    says the files could not be written, not that the hotfix was not loaded."""
    folder = tmp_path / "out"
    folder.mkdir()
    gone = f"import os; os.rmdir({str(folder)!r}); open({str(folder)!r}, 'w').close()"
    out = run_python("", args=("-m", "mfsdp_hotfix", "audit", "--out", str(folder / "a"), "--",
                               sys.executable, "-c", gone))
    assert out.returncode == 4, out.stdout + out.stderr
    assert out.stdout.splitlines()[:3] == [
        "audit: UNWRITABLE: no rank file could be written; give --out a path every rank can write "
        "(command exit status 0)",
        "  no rank file could be written where the audit was told to write them, so nothing the "
        "ranks counted is here",
        "  to do: give --out (or MFSDP_HOTFIX_AUDIT) a path every rank can write"], out.stdout
    assert f"no rank file {folder}/a.rank<N>.json: {folder} is not a folder" in out.stdout


def test_a_command_that_never_imports_megatron_fsdp_is_told_so(tmp_path: Path) -> None:
    """`audit -- true` ran through `mfsdp-hotfix audit`: the verdict says what happened (no
    process of the command trained with Megatron-FSDP), never to run through the audit."""
    status, lines = _audit(tmp_path, "true")
    assert status == 4 and lines[0] == (
        "audit: NO DATA: no process of the command trained with Megatron-FSDP; check the command "
        "(below) (command exit status 0)"), lines
    text = "\n".join(lines)
    assert "imported Megatron-FSDP (megatron_fsdp, or megatron.core.distributed.fsdp)" in text
    assert "run through `mfsdp-hotfix audit`" not in text


def test_the_fixes_are_listed_in_the_catalogues_order(tmp_path: Path) -> None:
    """A rank file lists the fixes as they were applied; the summary, like status, in the
    catalogue's order."""
    from mfsdp_hotfix.fix_catalogue import FIXES

    order = [fix.id for fix in FIXES]
    shuffled = WRITE_RANK_FILE.replace('"fixes": []', f'"fixes": {order[::-1]!r}')
    _, lines = _audit(tmp_path, sys.executable, "-c", shuffled,
                      str(bootstrap.SITECUSTOMIZE_DIR), "0", "36")
    assert f"    hotfix fixes applied: {', '.join(order)}" in lines, lines
