"""The arguments that choose a GPU call's cases and share its machine, one definition for the
drivers that run Megatron-LM's own scripts (``validation/megatron_lm``, ``validation/parity_gpu``):
where Megatron-LM's checkouts and the release wheels are, which releases, groups and case ids,
how many workers and how many seconds."""

from __future__ import annotations

import argparse
import os

VALIDATION = os.path.dirname(os.path.abspath(__file__))


def add_arguments(p: argparse.ArgumentParser, releases: tuple[str, ...],
                  groups: tuple[str, ...], workers: int) -> None:
    p.add_argument("--megatron-lm", action="append", default=[], metavar="[RELEASE=]DIR")
    p.add_argument("--releases", default=",".join(releases))
    p.add_argument("--groups", default=",".join(groups))
    p.add_argument("--only", default="", help="regular expression on the case ids")
    p.add_argument("--wheels", default=os.path.join(VALIDATION, "wheels"))
    p.add_argument("--workers", type=int, default=workers)
    p.add_argument("--budget-s", type=float, default=520.0)


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p``'s arguments, with ``--releases`` and ``--groups`` as tuples."""
    a = p.parse_args(argv)
    a.releases = tuple(r for r in a.releases.split(",") if r)
    a.groups = tuple(g for g in a.groups.split(",") if g)
    return a
