"""Which environment names are taken for a misspelling of the package's own, and what that costs
(the ``.pth`` runs it in every Python process)."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

from mfsdp_hotfix import variables


@pytest.mark.parametrize("name, closest", [
    ("MFSDP_HOTFX", "MFSDP_HOTFIX"),  # one letter missing: the switch a user meant to turn off
    ("MFSDP_HOTFIXX", "MFSDP_HOTFIX"),
    ("mfsdp_hotfix", "MFSDP_HOTFIX"),  # names are case-sensitive
    ("MSDP_HOTFIX", "MFSDP_HOTFIX"),  # the prefix itself misspelt
    ("MFSDPHOTFIX", "MFSDP_HOTFIX"),
    ("MFSDP_HOTFX_AUDIT", "MFSDP_HOTFIX_AUDIT"),
    ("MFSDP_HOTFIX_AUDT", "MFSDP_HOTFIX_AUDIT"),
    ("MFSDP_HOTFIX_TIMEOUT", "MFSDP_HOTFIX_CROSS_RANK_TIMEOUT"),  # words left out
    ("MFSDP_HOTFIX_CHECK", "MFSDP_HOTFIX_CROSS_RANK_CHECK"),
    ("MFSDP_HOTFIX_DISABLE", "MFSDP_HOTFIX_DISABLED_FIXES"),  # a word cut short
])
def test_a_name_close_to_ours_is_named_with_the_closest(name: str, closest: str) -> None:
    (warning,) = variables.misspelt([name])
    assert warning == (f"{name} is not a variable mfsdp_hotfix reads (did you mean {closest}?); "
                       "it is ignored")


@pytest.mark.parametrize("name", [
    # "MFSDP" is the common short name of Megatron-FSDP: users and launchers set these
    "MFSDP_DEBUG", "MFSDP_LOG_LEVEL", "MFSDP_CKPT_DIR", "MFSDP_HOME", "MFSDP_NOTHING_LIKE_IT",
    # under our prefix, but far from every name we read: no typo of one of ours
    "MFSDP_HOTFIX_DEBUG", "MFSDP_HOTFIX_LOG_LEVEL", "MFSDP_HOTFIX_VERBOSE",
])
def test_other_mfsdp_names_are_quiet(name: str) -> None:
    assert variables.misspelt([name]) == []


@pytest.mark.parametrize("name", [*variables.ALL_VARIABLES, "PATH", "HOTFIX", "FSDP_MODE",
                                  "MEGATRON_FSDP", "NCCL_DEBUG", "MFSDP_TEST_CACHE",
                                  "MFSDP_VAL_CPU", "MFSDP_WRITE_CONFIGURATIONS", "TFIX_HOME"])
def test_ours_and_unrelated_names_are_quiet(name: str) -> None:
    assert variables.misspelt([name]) == []


def test_every_mfsdp_name_this_repository_reads_is_quiet() -> None:
    """A test or validation variable close to one of ours would warn in every process."""
    names = set()
    for path in [*REPO.glob("*.md"), *REPO.glob("docs/*.md"), *REPO.glob("*/**/*.py"),
                 REPO / ".ci" / "run"]:
        names |= set(re.findall(r"\bMFSDP_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    misspelt = {name for name in names if variables.misspelt([name])}
    # the misspellings the tests and docs show on purpose
    assert misspelt <= {"MFSDP_HOTFIX_TIMEOUT", "MFSDP_HOTFIX_DISABLE_FIXES", "MFSDP_HOTFIXX",
                        "MFSDP_HOTFIX_AUDT", "MFSDP_HOTFX", "MFSDP_HOTFX_AUDIT",
                        "MFSDP_HOTFIX_CHECK", "MFSDP_HOTFIX_DISABLE"}, misspelt


def _one_edit(name: str) -> set[str]:
    return ({name[:i] + name[i + 1:] for i in range(len(name))}
            | {name[:i] + "#" + name[i + 1:] for i in range(len(name))}
            | {name[:i] + "#" + name[i:] for i in range(len(name) + 1)})


def test_only_names_holding_a_piece_of_ours_are_measured() -> None:
    """The cheap filter is exact: every name within two edits (deletions, substitutions,
    insertions) of one of ours holds a piece of MFSDP_HOTFIX, so no close name goes unmeasured."""
    for known in variables.ALL_VARIABLES:
        for once in _one_edit(known):
            for twice in _one_edit(once):
                assert any(piece in twice for piece in variables._PIECES), twice


def test_on_off_values_are_parsed_in_one_place() -> None:
    """Every switch reads its value through ``variables.switch``; the ``.pth`` line, which runs
    before the package can be imported, spells out the same off values."""
    for raw in ("", "1", " ON ", "true", "Yes"):
        assert variables.switch(raw) is True, raw
    for raw in ("0", "off", " FALSE", "no"):
        assert variables.switch(raw) is False, raw
    assert variables.switch("strict") is None and variables.switch("maybe") is None
    pth = (REPO / "mfsdp_hotfix" / "mfsdp_hotfix.pth").read_text()
    (spelled,) = re.findall(r"not in \(([^)]*)\)", pth)
    assert {value.strip(" '") for value in spelled.split(",")} == variables.OFF
    for module in ("settings", "trigger", "bootstrap", "commands/status"):
        source = (REPO / "mfsdp_hotfix" / f"{module}.py").read_text()
        assert '"false"' not in source and "'false'" not in source, module
