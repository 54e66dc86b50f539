"""The environment variables the hotfix reads, and the names that look like a misspelling of one.

A misspelt switch (``MFSDP_HOTFX=0``) would otherwise be ignored in silence: the hotfix stays
armed while the user believes it is off. Only a likely typo warns: "MFSDP" is also the common
short name of Megatron-FSDP, and launchers and users set names such as ``MFSDP_DEBUG`` or
``MFSDP_CKPT_DIR`` that are none of ours; a warning on those would teach people to ignore
warnings. The ``.pth`` bootstrap runs :func:`misspelt` in every Python process of the
environment, so it imports nothing (``os`` and ``sys`` are loaded by ``site`` already) and costs
a pass over the environment's names: a name is compared (edit distance) only when it contains a
piece of ``MFSDP_HOTFIX`` that any name within 2 edits of it must contain.
"""

SWITCH = "MFSDP_HOTFIX"
DISABLED_FIXES = "MFSDP_HOTFIX_DISABLED_FIXES"
CROSS_RANK_CHECK = "MFSDP_HOTFIX_CROSS_RANK_CHECK"
CROSS_RANK_TIMEOUT = "MFSDP_HOTFIX_CROSS_RANK_TIMEOUT"
BOOTSTRAP = "MFSDP_HOTFIX_BOOTSTRAP"
AUDIT = "MFSDP_HOTFIX_AUDIT"

# The on/off values every switch accepts (case and spaces ignored), parsed here alone: the
# ``.pth`` line, which runs before the package is importable, repeats OFF (tests/test_bootstrap.py
# holds it to this set).
ON = frozenset({"", "1", "on", "true", "yes"})
OFF = frozenset({"0", "off", "false", "no"})

ALL_VARIABLES = (SWITCH, DISABLED_FIXES, CROSS_RANK_CHECK, CROSS_RANK_TIMEOUT, BOOTSTRAP, AUDIT)
MAX_EDITS = 2
# A word of a shortened name (``MFSDP_HOTFIX_DISABLE``) stands for a word of ours it begins, if
# it has at least this many letters.
MIN_WORD = 3
# Two edits change at most two of these three disjoint pieces of MFSDP_HOTFIX (which every name
# above starts with), so a name within two edits of one of them contains at least one piece.
_PIECES = ("MFSD", "P_HO", "TFIX")

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs more to import than this whole module
    from collections.abc import Iterable

_told: set[str] = set()


def switch(raw: str) -> bool | None:
    """What an on/off variable's value ``raw`` says: True (on, also unset), False (off), or None
    (not an on/off value)."""
    value = raw.strip().lower()
    return True if value in ON else False if value in OFF else None


def misspelt(names: "Iterable[str]") -> list[str]:
    """One warning per name in ``names`` (an environment's keys) that is not one the package
    reads but is likely meant for one (:func:`meant_for`)."""
    return [f"{name} is not a variable mfsdp_hotfix reads (did you mean {known}?); it is ignored"
            for name in names
            if name not in ALL_VARIABLES and (known := meant_for(name)) is not None]


def meant_for(name: str) -> str | None:
    """The variable of ours that ``name`` is likely a typo of (case ignored), or None: one within
    :data:`MAX_EDITS` edits (``MFSDP_HOTFX``), or, under ``MFSDP_HOTFIX_``, one shortened by
    leaving words out or cutting them short (``MFSDP_HOTFIX_TIMEOUT``, ``MFSDP_HOTFIX_DISABLE``).
    Any other name, ``MFSDP_DEBUG`` or ``MFSDP_HOTFIX_DEBUG`` alike, is not ours to judge."""
    upper = name.upper()
    if not (_PIECES[0] in upper or _PIECES[1] in upper or _PIECES[2] in upper):
        return None
    close = [(distance, known) for known in ALL_VARIABLES
             if abs(len(upper) - len(known)) <= MAX_EDITS
             and (distance := _distance(upper, known)) <= MAX_EDITS]
    if close:
        return min(close)[1]
    rest = upper.removeprefix(f"{SWITCH}_")
    if rest == upper or not rest:
        return None
    return next((known for known in ALL_VARIABLES[1:]
                 if _shortens(rest.split("_"), known.removeprefix(f"{SWITCH}_").split("_"))),
                None)


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


def _shortens(words: list[str], known: list[str]) -> bool:
    """Whether ``words`` are some of ``known`` in order, each whole or its first letters."""
    at = 0
    for word in words:
        while at < len(known) and not (known[at] == word or (
                len(word) >= MIN_WORD and known[at].startswith(word))):
            at += 1
        if at == len(known):
            return False
        at += 1
    return True


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
