"""The environment variables the hotfix reads, and the names that look like a misspelling of one.

A misspelt switch (``MFSDP_HOTFX=0``) would otherwise be ignored in silence: the hotfix stays
armed while the user believes it is off. The ``.pth`` bootstrap runs :func:`misspelt` in every
Python process of the environment, so it imports nothing (``os`` and ``sys`` are loaded by
``site`` already) and costs a pass over the environment's names: a name is compared (edit
distance) only when it contains a piece of ``MFSDP_HOTFIX`` that any name within 2 edits of it
must contain.
"""

SWITCH = "MFSDP_HOTFIX"
DISABLED_FIXES = "MFSDP_HOTFIX_DISABLED_FIXES"
CROSS_RANK_CHECK = "MFSDP_HOTFIX_CROSS_RANK_CHECK"
CROSS_RANK_TIMEOUT = "MFSDP_HOTFIX_CROSS_RANK_TIMEOUT"
BOOTSTRAP = "MFSDP_HOTFIX_BOOTSTRAP"
AUDIT = "MFSDP_HOTFIX_AUDIT"

ALL_VARIABLES = (SWITCH, DISABLED_FIXES, CROSS_RANK_CHECK, CROSS_RANK_TIMEOUT, BOOTSTRAP, AUDIT)
# Names under MFSDP_ that this repository's tests and validation scripts read (never the
# package): not a misspelling of the package's names.
DEVELOPMENT_PREFIXES = ("MFSDP_TEST_", "MFSDP_VAL_", "MFSDP_WRITE_")
PREFIX = "MFSDP_"
MAX_EDITS = 2
# Two edits change at most two of these three disjoint pieces of MFSDP_HOTFIX (which every name
# above starts with), so a name within two edits of one of them contains at least one piece.
_PIECES = ("MFSD", "P_HO", "TFIX")

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs more to import than this whole module
    from collections.abc import Iterable

_told: set[str] = set()


def misspelt(names: "Iterable[str]") -> list[str]:
    """One warning per name in ``names`` (an environment's keys) that is not one the package
    reads but is within :data:`MAX_EDITS` edits of one (case ignored), or starts with
    ``MFSDP_`` and is neither ours nor a development name."""
    found = []
    for name in names:
        if name in ALL_VARIABLES:
            continue
        upper = name.upper()
        if upper.startswith(PREFIX):
            if not upper.startswith(DEVELOPMENT_PREFIXES):
                found.append(_warning(name))
        elif (_PIECES[0] in upper or _PIECES[1] in upper or _PIECES[2] in upper) and any(
                _within(upper, known, MAX_EDITS) for known in ALL_VARIABLES):
            found.append(_warning(name))
    return found


def tell_once(warnings: list[str]) -> list[str]:
    """Write each warning not yet told in this process to stderr; returns those written (the
    bootstrap tells first, so that ``install()`` and ``status`` do not repeat it)."""
    import sys

    new = [w for w in warnings if w not in _told]
    for warning in new:
        _told.add(warning)
        sys.stderr.write(f"mfsdp_hotfix: warning: {warning}\n")
    return new


def told(warning: str) -> bool:
    """Whether :func:`tell_once` wrote ``warning`` in this process."""
    return warning in _told


def _warning(name: str) -> str:
    """The warning for an unknown name, with the closest known one (built only when a warning
    is due, so its cost does not matter)."""
    import difflib

    closest = min(ALL_VARIABLES, key=lambda known: _distance(name.upper(), known))
    if _distance(name.upper(), closest) > MAX_EDITS:
        # Compared without the common prefix, which would otherwise dominate the similarity.
        tails = {known.removeprefix(f"{SWITCH}_"): known for known in ALL_VARIABLES}
        close = difflib.get_close_matches(name.upper().removeprefix(f"{SWITCH}_"), tails, n=1,
                                          cutoff=0.5)
        closest = tails[close[0]] if close else ""
    hint = f"did you mean {closest}?" if closest else f"known: {', '.join(ALL_VARIABLES)}"
    return f"{name} is not a variable mfsdp_hotfix reads ({hint}); it is ignored"


def _within(a: str, b: str, limit: int) -> bool:
    return abs(len(a) - len(b)) <= limit and _distance(a, b) <= limit


def _distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    previous = list(range(len(b) + 1))
    for i, char in enumerate(a, 1):
        current = [i]
        for j, other in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (char != other)))
        previous = current
    return previous[-1]
