"""``status``'s one-line answer, computed from the copies' data alone: a fix, a defect or a state
the registry adds later flows into it without an edit (the names here are made up for that)."""

from __future__ import annotations

from typing import Any

import pytest

from mfsdp_hotfix import reporting
from mfsdp_hotfix.verdict_text import FIRST_LINE_MAX, block


def _copy(fixes: dict[str, str], defects: dict[str, str | None] | None = None,
          refused: str = "", version: str = "9.9.0", carrier_shape: str | None = "9.9"
          ) -> dict[str, Any]:
    """A copy as status lists it; a defect whose fix is None is one no fix repairs, found in
    the function ``carrier`` (its shape ``carrier_shape``, None: unknown)."""
    return {"copy": "megatron-fsdp", "version": version, "era": None if refused else "Z",
            "refused": bool(refused), "reason": refused,
            "fixes": {fix: {"state": state, "reason": "why"} for fix, state in fixes.items()},
            "release_defects": [{"name": name, "fix": fix, "workarounds": [f"avoid {name}",
                                                                           "other"],
                                 "repaired": fixes.get(fix or "") in ("applied", "would apply"),
                                 "carrier": None if fix else {"function": "Cls.carrier",
                                                              "shape": carrier_shape}}
                                for name, fix in (defects or {}).items()]}


def _line(hotfix: str | None, *copies: dict[str, Any],
          failures: dict[str, str] | None = None) -> str:
    """The verdict as ``status`` prints it: the first line, then the details indented."""
    data = {"copies": list(copies), "failures": failures or {}}
    found = reporting.verdict(data, hotfix)
    assert len(found["line"]) <= FIRST_LINE_MAX, found["line"]
    return block(found["line"], found["details"])


def test_protected_names_every_fix_that_protects() -> None:
    copy = _copy({"new-fix": "would apply", "other-fix": "not needed", "late-fix": "applied"})
    assert _line("armed", copy) == ("affected: megatron-fsdp 9.9.0 (era Z) — protected: the "
                                    "hotfix is armed\n  applies new-fix, late-fix")
    assert _line(None, copy) == ("affected: megatron-fsdp 9.9.0 (era Z) — repaired where the "
                                 "hotfix is loaded\n  applies new-fix, late-fix")


def test_switched_off_says_so_and_what_to_use_for_each_defect() -> None:
    copy = _copy({"new-fix": "off", "defect-fix": "off"}, {"new-defect": "defect-fix"})
    assert _line("off", copy) == (
        "affected: megatron-fsdp 9.9.0 (era Z) — NOT protected: MFSDP_HOTFIX=0; use "
        "fsdp_double_buffer=False\n  why: MFSDP_HOTFIX=0\n  instead: use fsdp_double_buffer=False"
        "\n  instead: for new-defect use avoid new-defect")


@pytest.mark.parametrize("state", ["disabled", "failed", "unverified", "a state added later"])
def test_a_fix_that_does_not_protect_is_named_with_its_state(state: str) -> None:
    copy = _copy({"new-fix": "would apply", "defect-fix": state}, {"new-defect": "defect-fix"})
    why = " (why)" if state == "failed" else ""  # a failure is named with what failed
    assert _line("armed", copy) == (
        f"affected: megatron-fsdp 9.9.0 (era Z) — NOT protected: defect-fix {state}; use avoid "
        f"new-defect\n  why: defect-fix {state}{why}\n  instead: for new-defect use avoid "
        "new-defect")


@pytest.mark.parametrize("state", ["applied", "would apply"])
def test_a_fix_that_failed_at_runtime_protects_nothing(state: str) -> None:
    """incidents.report() switched the fix off for the process: its state may still read
    applied, but the verdict reads the failures too, names the failure and the workaround."""
    copy = _copy({"new-fix": state, "defect-fix": "applied"}, {"new-defect": "defect-fix"})
    failures = {"new-fix": "in the drain: RuntimeError: boom", "audit": "unrelated"}
    assert _line("active", copy, failures=failures) == (
        "affected: megatron-fsdp 9.9.0 (era Z) — NOT protected: new-fix failed; use "
        "fsdp_double_buffer=False\n  why: new-fix failed (in the drain: RuntimeError: boom)\n"
        "  instead: use fsdp_double_buffer=False")
    failures = {"defect-fix": "in the setter: KeyError: 'x'"}
    assert _line("active", copy, failures=failures) == (
        "affected: megatron-fsdp 9.9.0 (era Z) — NOT protected: defect-fix failed; use avoid "
        "new-defect\n  why: defect-fix failed (in the setter: KeyError: 'x')\n  instead: for "
        "new-defect use avoid new-defect")
    assert _line("active", copy, failures={"audit": "unrelated"}).endswith(
        "protected: the hotfix is active\n  applies new-fix, defect-fix")


def test_a_failed_install_protects_nothing() -> None:
    line = _line("active", _copy({"new-fix": "applied"}),
                 failures={"install": "the import hook of x: ValueError: y"})
    assert line == ("affected: megatron-fsdp 9.9.0 (era Z) — NOT protected: installing the "
                    "hotfix failed; use fsdp_double_buffer=False\n  why: installing the hotfix "
                    "failed (the import hook of x: ValueError: y)\n  instead: use "
                    "fsdp_double_buffer=False")


@pytest.mark.parametrize(("shape", "said"), [
    ("9.9", "new-defect is not repaired by the hotfix"),
    (None, "new-defect not ruled out (carrier has a code shape the hotfix does not know) and "
           "not repaired by the hotfix")])
def test_a_release_defect_no_fix_repairs_is_not_protected(shape: str | None, said: str) -> None:
    copy = _copy({"new-fix": "would apply"}, {"new-defect": None}, carrier_shape=shape)
    assert _line("armed", copy) == (
        "affected: megatron-fsdp 9.9.0 (era Z) — NOT protected: 1 defect not repaired; use avoid "
        f"new-defect\n  why: {said}\n  instead: for new-defect use avoid new-defect")
    copy["limits"] = [{"configuration": "ZeRO-9", "fix": None, "defect": "new-defect"}]
    assert f"  why: {said} (it hits ZeRO-9)\n" in _line(None, copy)
    assert _line("off", copy).startswith(
        "affected: megatron-fsdp 9.9.0 (era Z) — NOT protected: MFSDP_HOTFIX=0; use "
        f"fsdp_double_buffer=False\n  why: MFSDP_HOTFIX=0\n  why: {said}")


def test_not_loaded_protects_nothing() -> None:
    line = _line("not loaded", _copy({"new-fix": "would apply"}))
    assert line.startswith("affected: megatron-fsdp 9.9.0 (era Z) — NOT protected: hotfix not "
                           "loaded; use fsdp_double_buffer=False\n  why: nothing loads the "
                           "hotfix in a new process here"), line
    assert line.endswith("\n  instead: use fsdp_double_buffer=False"), line


def test_a_refused_copy_is_not_protected_and_another_copy_keeps_its_name() -> None:
    line = _line("armed", _copy({}, refused="unknown getter"),
                 _copy({"new-fix": "disabled"}, version="1.0.0"))
    assert line == ("affected: 2 Megatron-FSDP copies — NOT protected: left as shipped, new-fix "
                    "disabled; use fsdp_double_buffer=False\n"
                    "  why: megatron-fsdp 9.9.0 (not recognised): left as shipped (unknown getter)"
                    "\n  why: megatron-fsdp 1.0.0 (era Z): new-fix disabled\n"
                    "  instead: use fsdp_double_buffer=False")
    assert _line("armed", _copy({}, refused="unknown getter")) == (
        "affected: megatron-fsdp 9.9.0 (not recognised) — NOT protected: left as shipped; use "
        "fsdp_double_buffer=False\n  why: left as shipped (unknown getter)\n  instead: use "
        "fsdp_double_buffer=False")


def test_a_refused_copys_release_defects_are_told_what_to_use() -> None:
    """A refused copy has no fix state, but the defects its code has still need a workaround."""
    assert _line("armed", _copy({}, {"new-defect": "defect-fix"}, refused="unknown getter")) == (
        "affected: megatron-fsdp 9.9.0 (not recognised) — NOT protected: left as shipped; use "
        "fsdp_double_buffer=False\n  why: left as shipped (unknown getter)\n  instead: use "
        "fsdp_double_buffer=False\n  instead: for new-defect use avoid new-defect")


def test_a_refused_copy_names_what_still_applies_what_is_left_and_each_workaround() -> None:
    copy = _copy({"db-fix": "refused", "other-db-fix": "refused", "kept-fix": "would apply",
                  "unneeded": "not needed", "defect-fix": "would apply", "off-fix": "disabled"},
                 {"kept-defect": "defect-fix", "left-defect": "off-fix"},
                 refused="unknown drain")
    assert _line("armed", copy) == (
        "affected: megatron-fsdp (not recognised) — NOT protected: left as shipped and more "
        "(below); use fsdp_double_buffer=False\n  why: db-fix, other-db-fix left as shipped "
        "(unknown drain); the hotfix still applies kept-fix, defect-fix; off-fix disabled\n"
        "  instead: use fsdp_double_buffer=False\n  instead: for left-defect use avoid "
        "left-defect")
    # nothing applies where nothing loads the hotfix
    assert "still applies" not in _line("not loaded", copy)


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


def test_several_copies_not_affected_are_counted_and_named_below() -> None:
    assert _line("armed", _copy({"new-fix": "not needed"}),
                 _copy({"new-fix": "not needed"}, version="1.0.0")) == (
        "not affected: none of 2 Megatron-FSDP copies needs a fix\n"
        "  megatron-fsdp 9.9.0 (era Z) needs none of the fixes\n"
        "  megatron-fsdp 1.0.0 (era Z) needs none of the fixes")


def test_a_refusal_at_model_construction_is_a_line_of_its_own() -> None:
    """'refuses ...' inside a protected verdict read as 'my job will be refused': it is a
    detail of its own, saying it holds only if such a model is built."""
    copy = {**_copy({"new-fix": "would apply"}), "limits": [
        {"configuration": "HSDP with ZeRO-9", "refused_at_model_construction": True,
         "workaround": "ZeRO-8"}]}
    assert _line("armed", copy) == (
        "affected: megatron-fsdp 9.9.0 (era Z) — protected: the hotfix is armed\n"
        "  applies new-fix\n"
        "  refused at model construction, if you build: HSDP with ZeRO-9 (no fix makes it "
        "right): use ZeRO-8")
