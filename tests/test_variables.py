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
    ("MFSDP_HOTFIX_TIMEOUT", "MFSDP_HOTFIX_CROSS_RANK_TIMEOUT"),  # an unknown rest
])
def test_a_name_close_to_ours_is_named_with_the_closest(name: str, closest: str) -> None:
    (warning,) = variables.misspelt([name])
    assert warning == (f"{name} is not a variable mfsdp_hotfix reads (did you mean {closest}?); "
                       "it is ignored")


def test_an_unknown_rest_after_the_prefix_is_told() -> None:
    (warning,) = variables.misspelt(["MFSDP_NOTHING_LIKE_IT"])
    assert warning.startswith("MFSDP_NOTHING_LIKE_IT is not a variable mfsdp_hotfix reads")


@pytest.mark.parametrize("name", [*variables.ALL_VARIABLES, "PATH", "HOTFIX", "FSDP_MODE",
                                  "MEGATRON_FSDP", "NCCL_DEBUG", "MFSDP_TEST_CACHE",
                                  "MFSDP_VAL_CPU", "MFSDP_WRITE_CONFIGURATIONS", "TFIX_HOME"])
def test_ours_and_unrelated_names_are_quiet(name: str) -> None:
    assert variables.misspelt([name]) == []


def test_every_mfsdp_name_this_repository_reads_is_ours_or_a_development_one() -> None:
    """A test or validation variable added under another prefix would warn in every process."""
    names = set()
    for path in [*REPO.glob("*.md"), *REPO.glob("docs/*.md"), *REPO.glob("*/**/*.py"),
                 REPO / ".ci" / "run"]:
        names |= set(re.findall(r"\bMFSDP_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    misspelt = {name for name in names if variables.misspelt([name])
                and f"{name}_" not in variables.DEVELOPMENT_PREFIXES}
    # the misspellings the tests and docs show on purpose
    assert misspelt <= {"MFSDP_HOTFIX_TIMEOUT", "MFSDP_HOTFIX_DISABLE_FIXES", "MFSDP_HOTFIXX",
                        "MFSDP_HOTFIX_AUDT", "MFSDP_HOTFX", "MFSDP_HOTFX_AUDIT",
                        "MFSDP_NOTHING_LIKE_IT"}, misspelt


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
