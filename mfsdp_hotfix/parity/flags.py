"""Megatron-LM flags in a command line: read one, remove one with its values, set one.

Megatron-LM's parser takes ``--flag VALUE`` and ``--flag=VALUE`` and no abbreviations
(``allow_abbrev=False``), so a flag is matched by its whole name only."""

from __future__ import annotations

from collections.abc import Sequence

# ``values`` of a flag that takes every word up to the next flag (argparse ``nargs='+'``).
MANY = -1


def name_of(word: str) -> str | None:
    """The flag ``word`` is (``--a=1`` is ``--a``), None for a value."""
    return word.split("=", 1)[0] if word.startswith("--") else None


def _span(args: Sequence[str], index: int, values: int) -> int:
    """How many words the flag at ``index`` spans with its values."""
    if "=" in args[index]:
        return 1
    if values == MANY:
        end = index + 1
        while end < len(args) and name_of(args[end]) is None:
            end += 1
        return end - index
    return 1 + values


def value_of(args: Sequence[str], flag: str) -> str | None:
    """The value given to ``flag`` (the last one, as argparse keeps), None when absent."""
    found = None
    for index, word in enumerate(args):
        if name_of(word) == flag:
            if "=" in word:
                found = word.split("=", 1)[1]
            elif index + 1 < len(args):
                found = args[index + 1]
    return found


def has(args: Sequence[str], flag: str) -> bool:
    return any(name_of(word) == flag for word in args)


def remove(args: Sequence[str], flag: str, values: int) -> tuple[list[str], list[str]]:
    """``args`` without every occurrence of ``flag`` and its ``values``; and what was removed."""
    kept: list[str] = []
    removed: list[str] = []
    index = 0
    while index < len(args):
        if name_of(args[index]) == flag:
            span = _span(args, index, values)
            removed += args[index:index + span]
            index += span
        else:
            kept.append(args[index])
            index += 1
    return kept, removed


def put(args: Sequence[str], flag: str, value: str | None = None) -> list[str]:
    """``args`` with ``flag`` (and its one ``value``) set: earlier occurrences removed, the flag
    appended."""
    kept, _ = remove(args, flag, 0 if value is None else 1)
    return kept + ([flag] if value is None else [flag, value])


def replace_value(args: Sequence[str], flag: str, value: str) -> list[str]:
    """``args`` with the value of every occurrence of ``flag`` replaced by ``value``, in place."""
    out = list(args)
    for index, word in enumerate(out):
        if name_of(word) == flag:
            if "=" in word:
                out[index] = f"{flag}={value}"
            elif index + 1 < len(out):
                out[index + 1] = value
    return out
