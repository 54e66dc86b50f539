"""``status``'s one-line answer, computed from the copies' data alone: a fix, a defect or a state
the registry adds later flows into it without an edit (the names here are made up for that)."""

from __future__ import annotations

from typing import Any

import pytest

from mfsdp_hotfix import reporting


def _copy(fixes: dict[str, str], defects: dict[str, str] | None = None, refused: str = "",
          version: str = "9.9.0") -> dict[str, Any]:
    return {"copy": "megatron-fsdp", "version": version, "era": None if refused else "Z",
            "refused": bool(refused), "reason": refused,
            "fixes": {fix: {"state": state, "reason": "why"} for fix, state in fixes.items()},
            "release_defects": [{"name": name, "fix": fix, "workarounds": [f"avoid {name}",
                                                                           "other"],
                                 "repaired": fixes.get(fix) in ("applied", "would apply")}
                                for name, fix in (defects or {}).items()]}


def _line(hotfix: str | None, *copies: dict[str, Any]) -> str:
    return str(reporting.verdict({"copies": list(copies)}, hotfix)["line"])


def test_protected_names_every_fix_that_protects() -> None:
    copy = _copy({"new-fix": "would apply", "other-fix": "not needed", "late-fix": "applied"})
    assert _line("armed", copy) == ("affected: megatron-fsdp 9.9.0 (era Z) — protected: the "
                                    "hotfix is armed and applies new-fix, late-fix")
    assert _line(None, copy) == ("affected: megatron-fsdp 9.9.0 (era Z) — repaired where the "
                                 "hotfix is loaded: it applies new-fix, late-fix")


def test_switched_off_says_so_and_what_to_use_for_each_defect() -> None:
    copy = _copy({"new-fix": "off", "defect-fix": "off"}, {"new-defect": "defect-fix"})
    assert _line("off", copy) == (
        "affected: megatron-fsdp 9.9.0 (era Z) — NOT protected: MFSDP_HOTFIX=0; use "
        "fsdp_double_buffer=False; for new-defect use avoid new-defect")


@pytest.mark.parametrize("state", ["disabled", "failed", "unverified", "a state added later"])
def test_a_fix_that_does_not_protect_is_named_with_its_state(state: str) -> None:
    copy = _copy({"new-fix": "would apply", "defect-fix": state}, {"new-defect": "defect-fix"})
    assert _line("armed", copy) == (
        f"affected: megatron-fsdp 9.9.0 (era Z) — NOT protected: defect-fix {state}; for "
        "new-defect use avoid new-defect")


def test_not_loaded_protects_nothing() -> None:
    line = _line("not loaded", _copy({"new-fix": "would apply"}))
    assert line.startswith("affected: megatron-fsdp 9.9.0 (era Z) — NOT protected: nothing "
                           "loads the hotfix in a new process here"), line
    assert line.endswith("; use fsdp_double_buffer=False"), line


def test_a_refused_copy_is_not_protected_and_another_copy_keeps_its_name() -> None:
    line = _line("armed", _copy({}, refused="unknown getter"),
                 _copy({"new-fix": "disabled"}, version="1.0.0"))
    assert line == ("affected: megatron-fsdp 9.9.0 (not recognised), megatron-fsdp 1.0.0 (era Z)"
                    " — NOT protected: megatron-fsdp 9.9.0 (not recognised): left as shipped "
                    "(unknown getter); megatron-fsdp 1.0.0 (era Z): new-fix disabled; use "
                    "fsdp_double_buffer=False")
    assert _line("armed", _copy({}, refused="unknown getter")) == (
        "affected: megatron-fsdp 9.9.0 (not recognised) — NOT protected: left as shipped "
        "(unknown getter); use fsdp_double_buffer=False")


def test_a_refused_copys_release_defects_are_told_what_to_use() -> None:
    """A refused copy has no fix state, but the defects its code has still need a workaround."""
    assert _line("armed", _copy({}, {"new-defect": "defect-fix"}, refused="unknown getter")) == (
        "affected: megatron-fsdp 9.9.0 (not recognised) — NOT protected: left as shipped "
        "(unknown getter); use fsdp_double_buffer=False; for new-defect use avoid new-defect")


def test_a_copy_without_version_metadata_is_named_by_its_era() -> None:
    copy = {**_copy({"new-fix": "not needed"}), "version": None, "era": "none"}
    assert _line("armed", copy) == ("not affected: megatron-fsdp (no version metadata, era none) "
                                    "needs none of the fixes")


def test_not_affected() -> None:
    assert _line("armed") == "not affected: no Megatron-FSDP copy found"
    assert _line("armed", _copy({"new-fix": "not needed"})) == (
        "not affected: megatron-fsdp 9.9.0 (era Z) needs none of the fixes")
    data = reporting.verdict({"copies": [_copy({"new-fix": "not needed"})]}, "off")
    assert (data["affected"], data["protected"]) == (False, None)
