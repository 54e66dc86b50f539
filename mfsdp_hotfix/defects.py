"""What a release defect is: the facts users are told about one defect of released Megatron-FSDP
(``status``, docs/RELEASE_DEFECTS.md), and the configurations it hits. Each defect a fix repairs
is declared beside that fix (``fix_catalogue``); the others in ``release_defects``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .limits import Limit
from .registry import Shape


@dataclass(frozen=True)
class ReleaseDefect:
    """A defect of released Megatron-FSDP outside the double buffer that users are told about
    (``status``, docs/RELEASE_DEFECTS.md), and what protects them from it.

    ``fix``: the id of the fix (in :data:`~mfsdp_hotfix.fix_catalogue.FIXES`) that repairs it;
    the releases it affects are the copies whose code needs that fix (a fix's gate shape decides,
    whatever the label), so a copy is judged by its code and the ranges here only say where the
    shipped releases stand.
    ``fix`` None: no fix repairs it; ``carrier`` (in
    :data:`~mfsdp_hotfix.registry.DEFECT_CARRIERS`) is the function whose shape decides, by its
    :attr:`~mfsdp_hotfix.registry.Shape.carries` (an unknown shape: the copy may have it).
    ``limits``: the configurations it hits where no fix repairs it (``fix`` None: all of them);
    a model built in one is refused (``coverage.py``), so no defect is only told.
    ``not_covered``: where the defect remains even with the fix, in words; each such
    configuration is one of ``limits`` or of its fix's limits with ``repaired=False``.
    """

    name: str
    fix: str | None
    releases: dict[str, str]  # distribution -> affected release range
    git_trees: str  # how a git install or fork is recognised
    configuration: str  # what triggers it
    symptom: str
    workarounds: tuple[str, ...]  # for users who cannot take the fix, each verified
    upstream: str
    not_covered: str
    carrier: str | None = None  # fix None: the function whose shape has the defect
    limits: tuple[Limit, ...] = ()
    # fix None: every model its limits match is refused when built, so the verdict names the
    # refusal instead of NOT protected
    refused_when_built: bool = False


def carried(defect: ReleaseDefect, shapes: Mapping[str, Shape | None]) -> bool | None:
    """Whether a copy with these shapes has ``defect``, one no fix repairs: True, False, or None
    where its carrier's shape is unknown (the copy may have it). False where the carrier was not
    read at all (absent from ``shapes``: a copy refused before its code was read)."""
    assert defect.carrier is not None, f"{defect.name} has a fix; its fix's state decides"
    if defect.carrier not in shapes:
        return False
    shape = shapes[defect.carrier]
    return None if shape is None else defect.name in shape.carries
