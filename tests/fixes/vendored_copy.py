"""megatron-core's vendored Megatron-FSDP read from disk, and one fix's state on it: for the fixes
whose gate lives in megatron-core outside Megatron-FSDP (its fused linear, its MoE experts)."""

from __future__ import annotations

from pathlib import Path

from mfsdp_hotfix import detection, fix_catalogue, installer, registry, settings
from mfsdp_hotfix.fix_type import Fix

_, VENDORED = registry.COPIES


def detect(root: Path) -> detection.Detection:
    """The vendored copy under ``root`` (an unpacked megatron-core), detected, not imported."""
    found = detection.find_installed(VENDORED, [str(root)])
    assert found is not None
    return detection.detect_file(VENDORED, found, installed=False)


def fix_state(fix: Fix, found: detection.Detection) -> str:
    """``fix``'s state on ``found`` with the default settings."""
    return installer.fix_state(fix, found, settings.read(known_fixes=fix_catalogue.FIX_IDS))[0]
