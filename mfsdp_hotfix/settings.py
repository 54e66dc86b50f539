"""Every environment variable the hotfix reads, parsed once and leniently.

Ranks must not diverge mid-run, so the values are read when ``install()`` runs and frozen in a
``Settings`` object. Garbage never raises: it produces one warning naming the variable, the
accepted values and the default that is used instead. A misspelt name would otherwise be ignored
in silence, so every name close to one of ours (``variables.misspelt``) gets one warning naming
the closest known one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import variables
from .variables import (
    ALL_VARIABLES,
    AUDIT,
    BOOTSTRAP,
    CROSS_RANK_CHECK,
    CROSS_RANK_TIMEOUT,
    DISABLED_FIXES,
    SWITCH,
)

__all__ = ["ALL_VARIABLES", "AUDIT", "BOOTSTRAP", "CROSS_RANK_CHECK", "CROSS_RANK_TIMEOUT",
           "DISABLED_FIXES", "SWITCH", "Settings", "read"]

DEFAULT_CROSS_RANK_TIMEOUT = 60.0

_SWITCH_VALUES = {**dict.fromkeys(variables.ON, "on"), **dict.fromkeys(variables.OFF, "off"),
                  "strict": "strict"}
_CHECK_VALUES = {"": "error", "error": "error", "1": "error", "on": "error",
                 "warn": "warn", "warning": "warn", "off": "off", "0": "off"}


@dataclass(frozen=True)
class Settings:
    """The hotfix's configuration for this process."""

    mode: str = "on"  # "on", "off" or "strict"
    disabled_fixes: frozenset[str] = frozenset()
    cross_rank_check: str = "error"  # "error", "warn" or "off"
    cross_rank_timeout: float = DEFAULT_CROSS_RANK_TIMEOUT  # seconds to wait for other ranks
    audit_path: str | None = None  # MFSDP_HOTFIX_AUDIT: rank files go to <path>.rank<N>.json
    problems: tuple[str, ...] = field(default=(), compare=False)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def strict(self) -> bool:
        return self.mode == "strict"


def _choice(env: Mapping[str, str], name: str, table: Mapping[str, str], default: str,
            problems: list[str]) -> str:
    raw = env.get(name, "")
    value = table.get(raw.strip().lower())
    if value is None:
        accepted = ", ".join(sorted({k for k in table if k}))
        problems.append(f"{name}={raw!r} is not understood (accepted: {accepted}); "
                        f"using the default, {default!r}")
        return default
    return value


def read(env: Mapping[str, str] | None = None, known_fixes: frozenset[str] = frozenset()
         ) -> Settings:
    """Parse the environment; every problem found is returned in ``Settings.problems``."""
    env = os.environ if env is None else env
    problems = variables.misspelt(sorted(env))
    mode = _choice(env, SWITCH, _SWITCH_VALUES, "on", problems)
    check = _choice(env, CROSS_RANK_CHECK, _CHECK_VALUES, "error", problems)
    names = {n.strip() for n in env.get(DISABLED_FIXES, "").split(",") if n.strip()}
    if "*" in names:
        names = set(known_fixes)
    unknown = sorted(names - known_fixes) if known_fixes else []
    if unknown:
        problems.append(f"{DISABLED_FIXES} names unknown fixes {unknown} (known: "
                        f"{', '.join(sorted(known_fixes))}, or '*'); ignoring those names")
    return Settings(mode=mode, disabled_fixes=frozenset(names - set(unknown)),
                    cross_rank_check=check, cross_rank_timeout=_seconds(env, problems),
                    audit_path=env.get(AUDIT, "").strip() or None, problems=tuple(problems))


def _seconds(env: Mapping[str, str], problems: list[str]) -> float:
    raw = env.get(CROSS_RANK_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_CROSS_RANK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 86400:
        problems.append(f"{CROSS_RANK_TIMEOUT}={raw!r} is not a number of seconds between 0 and "
                        f"86400; using the default, {DEFAULT_CROSS_RANK_TIMEOUT:g}")
        return DEFAULT_CROSS_RANK_TIMEOUT
    return value
