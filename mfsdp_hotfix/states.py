"""The states a fix can be in on one copy, one vocabulary for the installer, the coverage gate,
``status`` and the README (``reporting.FIX_STATES`` says what each means to a user).

A ``StrEnum``: each state is its own word, so ``status --json`` and a comparison with the word
read the same."""

from enum import StrEnum


class FixState(StrEnum):
    APPLIED = "applied"  # to this imported copy
    WOULD_APPLY = "would apply"  # once this copy is imported
    NOT_NEEDED = "not needed"  # the copy's code does not have the defect
    DISABLED = "disabled"  # listed in MFSDP_HOTFIX_DISABLED_FIXES
    FAILED = "failed"  # raised inside the hotfix, switched off for the process
    UNVERIFIED = "unverified"  # a gate's code shape is unknown: not applied
    OFF = "off"  # MFSDP_HOTFIX=0
    REFUSED = "refused"  # the copy is refused and the fix rests on code not recognised
    # Not a fix's state: a release defect no fix repairs, which the copy has or may have
    # (the coverage gate's state for it).
    NOT_REPAIRED = "not repaired"
