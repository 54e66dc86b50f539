"""Rank files: written whole, probed before a run, found and read by the CLI (no torch needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rank_records import rank_record

from mfsdp_hotfix.audit.rank_files import RankFile, probe, rank_files, read_rank_files


def test_rank_file_is_written_whole_and_replaced(tmp_path: Path) -> None:
    out = RankFile(str(tmp_path / "sub" / "audit"))
    name = out.write(rank_record(3))
    assert name == str(tmp_path / "sub" / "audit.rank3.json")
    assert json.loads(Path(name).read_text())["rank"] == 3
    assert out.write(rank_record(3, reuses=7)) == name
    assert json.loads(Path(name).read_text())["copies"][0]["reuses"] == 7
    assert os.listdir(tmp_path / "sub") == ["audit.rank3.json"]  # no temporary left behind


def test_an_unwritable_path_raises_for_the_caller_to_report(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        RankFile(str(tmp_path / "file" / "audit")).write(rank_record(0))


@pytest.mark.parametrize(("where", "words"), [
    # a folder nobody can create files in: the true reason, not proc's "No such file"
    ("/proc/x", "cannot create a file in /proc: it is on a proc filesystem, which takes no new "
                "files"),
    ("file/run1", "/file is not a folder"),
    ("new/deeper/run1", None),  # created when the files are written: probed where it would be
    ("run1", None),
])
def test_probe_creates_a_file_and_removes_it(tmp_path: Path, where: str, words: str | None
                                            ) -> None:
    (tmp_path / "file").write_text("")
    path = where if where.startswith("/") else str(tmp_path / where)
    problem = probe(path)
    assert (problem is None) == (words is None) and (words is None or words in problem), problem
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing left behind


def test_reading_rank_files(tmp_path: Path) -> None:
    prefix = str(tmp_path / "audit")
    Path(prefix + ".rank0.json").write_text(json.dumps(rank_record(0)))
    Path(prefix + ".rank12.json").write_text("{")
    Path(prefix + ".rank2.json.123.tmp").write_text("{")
    Path(prefix + "x.rank3.json").write_text("{}")
    assert rank_files(prefix) == {0: prefix + ".rank0.json", 12: prefix + ".rank12.json"}
    reports, unreadable = read_rank_files(prefix)
    assert list(reports) == [0] and unreadable[0].startswith(prefix + ".rank12.json (")
