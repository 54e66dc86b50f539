"""The environment switch: every value, and garbage in every variable."""

from __future__ import annotations

import pytest

from mfsdp_hotfix import fix_catalogue, settings


def read(**env: str) -> settings.Settings:
    return settings.read(env, known_fixes=fix_catalogue.FIX_IDS)


@pytest.mark.parametrize("value, mode", [("", "on"), ("1", "on"), ("on", "on"), ("ON ", "on"),
                                         ("0", "off"), ("off", "off"), ("strict", "strict"),
                                         ("Strict", "strict")])
def test_switch_values(value: str, mode: str) -> None:
    found = read(MFSDP_HOTFIX=value)
    assert found.mode == mode and not found.problems


def test_unset_is_on() -> None:
    assert read() == settings.Settings()


def test_disabled_fixes() -> None:
    listed = ", ".join(sorted(fix_catalogue.FIX_IDS, reverse=True))  # a comma list, any order
    assert read(MFSDP_HOTFIX_DISABLED_FIXES=listed).disabled_fixes == fix_catalogue.FIX_IDS
    assert read(MFSDP_HOTFIX_DISABLED_FIXES="*").disabled_fixes == fix_catalogue.FIX_IDS


@pytest.mark.parametrize("name, value, field, default", [
    ("MFSDP_HOTFIX", "maybe", "mode", "on"),
    ("MFSDP_HOTFIX_CROSS_RANK_CHECK", "loud", "cross_rank_check", "error"),
    ("MFSDP_HOTFIX_CROSS_RANK_TIMEOUT", "soon", "cross_rank_timeout", 60.0),
    ("MFSDP_HOTFIX_CROSS_RANK_TIMEOUT", "-5", "cross_rank_timeout", 60.0),
    ("MFSDP_HOTFIX_DISABLED_FIXES", "getter-guard,bogus", "disabled_fixes",
     frozenset({"getter-guard"})),
])
def test_garbage_gives_one_clear_problem_and_the_default(name: str, value: str, field: str,
                                                         default: object) -> None:
    found = read(**{name: value})
    assert getattr(found, field) == default
    assert len(found.problems) == 1
    assert name in found.problems[0] and repr(value.split(",")[-1]) in found.problems[0] or \
        "bogus" in found.problems[0]


@pytest.mark.parametrize("name, closest", [
    ("MFSDP_HOTFIX_TIMEOUT", "MFSDP_HOTFIX_CROSS_RANK_TIMEOUT"),
    ("MFSDP_HOTFIX_DISABLE_FIXES", "MFSDP_HOTFIX_DISABLED_FIXES"),
    ("MFSDP_HOTFIXX", "MFSDP_HOTFIX"),
    ("MFSDP_HOTFIX_AUDT", "MFSDP_HOTFIX_AUDIT"),
])
def test_unknown_name_is_named_with_the_closest_known_one(name: str, closest: str) -> None:
    found = read(**{name: "-3"})
    assert found == settings.Settings()  # ignored ...
    (problem,) = found.problems  # ... but never in silence
    assert problem.startswith(f"{name} is not a variable") and f"did you mean {closest}?" in problem


def test_every_known_name_is_quiet() -> None:
    assert not read(**{name: "" for name in settings.ALL_VARIABLES}).problems


def test_audit_path() -> None:
    assert read().audit_path is None and read(MFSDP_HOTFIX_AUDIT=" ").audit_path is None
    assert read(MFSDP_HOTFIX_AUDIT=" /scratch/a ").audit_path == "/scratch/a"
