"""The never-worse search: seeded random configurations, each run as shipped and with the hotfix,
each against plain PyTorch (docs/ACCUMULATION.md, "The never-worse search").

A seed draws one configuration (:func:`draw`: it depends on the seed alone) over the settings
users choose and the model's layout: the release, the strategy and the ranks (two ranks, one
rank, HSDP on four ranks or on two with a one-rank DP-Shard group, experts), overlap, the double
buffer, microbatches, the accumulation protocol, the loss reduction, fused or plain linears;
the unit count, where each unit's norm sits, parameters outside every unit (before or after the
units, owned by a root-level child or by the root itself, a final norm) and whether a
parameter-free module is registered last. Each configuration is measured twice through the
accumulation grid's :func:`accumulation.measure` (the real release on CPU/gloo, compared with
the plain PyTorch reference, never with a run of the code under test).

:func:`verdict` is the rule: with the hotfix the configuration is exact or refused before
training, never worse than shipped (an exact configuration stays exact; a crash never becomes
a silent error). ``docs/validation/never-worse-search.json`` records ``VALIDATION_SEEDS``
(``python tests/real_library/search.py --write``, a few seconds a run on 2 cores); CI reruns
``CI_SEEDS`` (``test_search.py``).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # mfsdp_hotfix

import accumulation as acc  # noqa: E402
import releases  # noqa: E402

from mfsdp_hotfix.selftest.model import OUTSIDE_PARTS  # noqa: E402
from mfsdp_hotfix.selftest.protocol import PROTOCOLS  # noqa: E402

RECORD = releases.REPO / "docs" / "validation" / "never-worse-search.json"
# One megatron-fsdp release per code family the hotfix repairs (megatron-core's releases vendor
# the same files: accumulation.SAME_FILES), the fixed one most often.
RELEASES = ("0.6.1", "0.6.1", "0.5.1", "0.4.0", "0.4.0", "0.3.1", "0.2.3")
LAYOUTS = tuple(acc.STRATEGIES)
GRAD_REDUCES = ("scale-then-sum", "per-token", "premul-sum")
# 160 and 70: ZeRO-3 with the double buffer on 0.4.0 and 0.3.1, wrong as shipped and exact with
# missed-post-backward (70 a crash as shipped); 174: no_shard's average under model auto-sync,
# once stopped by auto-sync-stop, right as shipped
CI_SEEDS = (2, 3, 4, 70, 160, 174)
# A case's limit: a hang (a collective one rank never joins) ends there as a crash.
TIMEOUT_S = 120.0
VALIDATION_SEEDS = tuple(range(200))

# Seeds that break the rule, found by the search and not yet repaired or refused; each is named
# in docs/ACCUMULATION.md ("The never-worse search"). test_search.py checks that the recorded
# rule-breakers are exactly these: a repair takes its seed off, a new finding must be added.
KNOWN_BREAKS: dict[int, str] = {}

# How a configuration ends (:func:`verdict`)
OK = "ok"  # with the hotfix: exact, or refused where it is not exact as shipped
OVER_REFUSED = "over-refused"  # exact as shipped, refused with the hotfix
WORSE = "worse"  # exact as shipped, not with the hotfix; or a crash made silent
NOT_EXACT = "not exact"  # wrong or crashed with the hotfix, as shipped too


def draw(seed: int) -> acc.Case:
    """The configuration of ``seed`` (with the hotfix off; :func:`pair` gives both runs)."""
    rng = random.Random(seed)
    layout = rng.choice(LAYOUTS)
    strategy = acc.STRATEGIES[layout]["strategy"]
    parts = [part for part in OUTSIDE_PARTS if rng.random() < 0.25]
    return acc.Case(
        release=rng.choice(RELEASES), layout=layout, protocol=rng.choice(PROTOCOLS),
        linear=rng.choice(("emulated", "unfused")), grad_reduce=rng.choice(GRAD_REDUCES),
        microbatches=rng.randint(1, 3),
        # the releases force overlap on for ZeRO-2/3: drawn where it is a choice
        overlap_grad_reduce=(rng.random() < 0.5 if strategy in ("optim", "no_shard")
                             else True),
        double_buffer=strategy in ("optim_grads", "optim_grads_params") and rng.random() < 0.5,
        units=rng.randint(2, 4), norm=rng.choice(("pre", "post")),
        outside="+".join(parts), head=rng.random() < 0.6)


def pair(seed: int) -> tuple[acc.Case, acc.Case]:
    shipped = draw(seed)
    return shipped, acc.Case(**{**asdict(shipped), "hotfix": "on"})


def verdict(shipped: dict[str, Any], hotfix: dict[str, Any]) -> str:
    """The rule, from the two runs' outcomes (:func:`accumulation.outcome`)."""
    before, after = shipped["outcome"], hotfix["outcome"]
    if before == acc.CANNOT_RUN:  # the release lacks an option the configuration needs
        return OK if after in (acc.CANNOT_RUN, acc.REFUSED) else WORSE
    if after == acc.EXACT:
        return OK
    if after == acc.REFUSED:
        return OVER_REFUSED if before == acc.EXACT else OK
    if before == acc.EXACT or (before not in (acc.WRONG,) and after == acc.WRONG):
        return WORSE  # a right run made wrong, or a loud crash made a silent error
    return NOT_EXACT


def measure(seed: int, shipped_run: dict[str, Any] | None = None) -> dict[str, Any]:
    """Both runs of ``seed``; ``shipped_run``: the run as shipped already measured (the
    hotfix plays no part in it)."""
    shipped, fixed = pair(seed)
    row = {"seed": seed, "id": shipped.id,
           "shipped": shipped_run or _without_case(acc.measure(shipped, TIMEOUT_S)),
           "hotfix": _without_case(acc.measure(fixed, TIMEOUT_S))}
    row["verdict"] = verdict(row["shipped"], row["hotfix"])
    return row


def _without_case(run: dict[str, Any]) -> dict[str, Any]:
    """A run as recorded: without its configuration, which is the seed's (:func:`draw`)."""
    return {key: value for key, value in run.items() if key != "case"}


def load_record() -> dict[str, Any]:
    return dict(json.loads(RECORD.read_text())) if RECORD.exists() else {}


def summary(record: dict[str, Any]) -> str:
    """The doc's summary of a record: counts by verdict and by the two outcomes, and each seed
    whose verdict is not ok."""
    rows = sorted(record["rows"].values(), key=lambda row: row["seed"])
    verdicts = collections.Counter(row["verdict"] for row in rows)
    outcomes = collections.Counter((row["shipped"]["outcome"], row["hotfix"]["outcome"])
                                   for row in rows)
    lines = [f"{len(rows)} seeds ({min(r['seed'] for r in rows)}-"
             f"{max(r['seed'] for r in rows)}), "
             + ", ".join(f"{count} {name}" for name, count in sorted(verdicts.items())) + ".",
             "", "| as shipped | with the hotfix | configurations |", "|---|---|---|"]
    lines += [f"| {before} | {after} | {count} |"
              for (before, after), count in sorted(outcomes.items())]
    bad = [row for row in rows if row["verdict"] != OK]
    if bad:
        lines += ["", "| seed | configuration | as shipped | with the hotfix | verdict |",
                  "|---|---|---|---|---|"]
        lines += [f"| {row['seed']} | {row['id']} | {_cell(row['shipped'])} | "
                  f"{_cell(row['hotfix'])} | {row['verdict']} |" for row in bad]
    return "\n".join(lines)


def _cell(run: dict[str, Any]) -> str:
    if run["outcome"] == acc.WRONG:
        return f"wrong {run['max_abs_grad_error']:g}"
    if run["outcome"] == "crashed":
        return "crashed: " + (run["exception"] or "").split("\n")[0][:80].replace("|", "/")
    return str(run["outcome"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default=f"{VALIDATION_SEEDS[0]}:{VALIDATION_SEEDS[-1] + 1}",
                        help="a range start:stop (default: the validation seeds)")
    parser.add_argument("--write", action="store_true",
                        help=f"add the rows to {RECORD.relative_to(releases.REPO)}")
    parser.add_argument("--summary", action="store_true", help="print the record's summary")
    parser.add_argument("--hotfix-only", action="store_true",
                        help="rerun only the hotfix's runs of seeds already recorded")
    args = parser.parse_args(argv)
    if args.summary:
        print(summary(load_record()))
        return 0
    start, stop = (int(bit) for bit in args.seeds.split(":"))
    record = load_record() or {"rows": {}}
    started = time.monotonic()
    for seed in range(start, stop):
        old = record["rows"].get(str(seed))
        row = measure(seed, old["shipped"] if old and args.hotfix_only else None)
        print(f"[{time.monotonic() - started:6.0f}s] seed {seed}: {row['verdict']}: {row['id']} "
              f"shipped {_cell(row['shipped'])}, hotfix {_cell(row['hotfix'])}", flush=True)
        if args.write:
            record["rows"][str(seed)] = row
            RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
