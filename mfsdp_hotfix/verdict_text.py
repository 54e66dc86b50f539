"""The one rule for every verdict a command prints (docs/CLI.md, "Verdicts"): a first line a
person reads in one glance, the state and the one thing to do, at most :data:`FIRST_LINE_MAX`
characters; then the details, each on a line of its own, indented by :data:`INDENT`.

Here, below every layer that words a verdict (``status``, the audit, the selftest), so that each
renders its own with the same rule.
"""

from __future__ import annotations

FIRST_LINE_MAX = 120
INDENT = "  "


def first_line(state: str, todo: str = "", shorter: tuple[str, ...] = ()) -> str:
    """``state; todo`` in at most :data:`FIRST_LINE_MAX` characters (the details below carry the
    whole of both). Where it does not fit, the shorter forms are tried: of the state, those the
    caller gives (``shorter``), of the thing to do, without its parenthesis, then its first
    clause; failing all, the shortest state is cut at a word, ending in ``…``."""
    todos = list(dict.fromkeys([todo, todo.split(" (", 1)[0], todo.split(" (", 1)[0]
                                .split(", ", 1)[0]]))
    for form in (state, *shorter):
        for told in todos:
            line = f"{form}; {told}" if told else form
            if len(line) <= FIRST_LINE_MAX:
                return line
    tail = f"; {todos[-1]}" if todos[-1] else ""
    state = (shorter or (state,))[-1]
    room = max(FIRST_LINE_MAX - len(tail), FIRST_LINE_MAX // 2)
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
