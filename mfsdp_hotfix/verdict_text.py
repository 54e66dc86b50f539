"""The one rule for every verdict a command prints (docs/CLI.md, "Verdicts"): a first line a
person reads in one glance, the state and the one thing to do, at most :data:`FIRST_LINE_MAX`
characters; then the details, each on a line of its own, indented by :data:`INDENT`.

Here, below every layer that words a verdict (``status``, the audit, the selftest), so that each
renders its own with the same rule.
"""

from __future__ import annotations

FIRST_LINE_MAX = 120
INDENT = "  "


def first_line(state: str, todo: str = "") -> str:
    """``state; todo`` in at most :data:`FIRST_LINE_MAX` characters (the details below it carry
    the whole of both). Where they do not fit, the thing to do loses its parenthesis first, then
    the state is cut at a word, keeping at least half the line, then the thing to do."""
    line = f"{state}; {todo}" if todo else state
    if len(line) <= FIRST_LINE_MAX:
        return line
    todo = todo.split(" (", 1)[0]
    tail = f"; {todo}" if todo else ""
    room = max(FIRST_LINE_MAX - len(tail), FIRST_LINE_MAX // 2)
    if len(state) > room:
        state = _cut(state, room)
    return state + _cut(tail, FIRST_LINE_MAX - len(state)) if tail else state


def _cut(text: str, room: int) -> str:
    """``text`` in ``room`` characters, cut at a word and ending in ``…`` where it is longer."""
    if len(text) <= room:
        return text
    cut = text[:max(room - 1, 0)]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(",;:— ") + "…"


def block(first: str, details: list[str]) -> str:
    """The verdict's first line, then each detail on a line of its own, indented."""
    return "\n".join([first] + [INDENT + detail for detail in details])
