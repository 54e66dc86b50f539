#!/usr/bin/env python3
"""GPU confirmation of the ZeRO-1 accumulation defect (docs/ACCUMULATION.md), on one GPU.

Megatron-FSDP sets ``overwrite_main_grad`` for every strategy (fixed upstream by
NVIDIA/Megatron-LM #6357), so under ZeRO-1, where the unsharded gradient buffer accumulates a
step's microbatches, TransformerEngine-style fused wgrad overwrites what the earlier microbatches
wrote. The check needs no reference model: a step of 2 microbatches must differ from a step of
its last microbatch alone; where it is bit-identical, the first microbatch was lost. Each
(ZeRO stage, protocol) runs both through ``harness.run_case`` (fake 2-rank group, NCCL work
semantics, ``fsdp_double_buffer=False``: the double buffer is not involved) and the record says,
per case, whether the 2-microbatch step equals the last microbatch alone (expected: ZeRO-1 on
megatron-fsdp 0.2.0-0.6.1 yes, NVIDIA main and ZeRO-2/3 no). ``--fix hotfix`` loads mfsdp_hotfix
first: its ``zero1-accumulate`` fix must make ZeRO-1 keep the first microbatch (expected: no
case loses it).

    python3 validation/accumulation_gpu.py --pkg megatron_fsdp --out accumulation-gpu.json
    python3 validation/accumulation_gpu.py --pkg megatron_fsdp --fix hotfix --out fixed.json
    python3 validation/accumulation_gpu.py --cpu --tiny --pkg megatron_fsdp --out cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

TINY = dict(hidden=32, units=4, ffn=64, tokens=16, steps=2)
FULL = dict(hidden=1024, units=4, ffn=2048, tokens=2048, steps=3)


def plan(pkg: str, tiny: bool, fix: str = "none") -> list[dict[str, Any]]:
    size = TINY if tiny else FULL
    cases = []
    for zero in (1, 2, 3):
        for protocol in ("megatron-lm", "auto-sync"):
            base = dict(pkg=pkg, fix=fix, zero=zero, db=False, protocol=protocol, **size)
            cases.append(dict(base, id=f"zero{zero}-{protocol}-2mb", microbatches=2))
            # its last microbatch alone: input seeds of microbatch 1 of every step
            cases.append(dict(base, id=f"zero{zero}-{protocol}-last", microbatches=1,
                              input_seed=10_001))
    return cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pkg", default="megatron_fsdp")
    p.add_argument("--out", required=True)
    p.add_argument("--fix", default="none", choices=("none", "hotfix"),
                   help="hotfix: load mfsdp_hotfix before the release (its zero1-accumulate fix)")
    p.add_argument("--cpu", action="store_true", help="CPU stand-in (tests): nothing races")
    p.add_argument("--tiny", action="store_true", help="a small model (tests)")
    p.add_argument("--dry", action="store_true", help="print the plan, run nothing")
    a = p.parse_args(argv)
    cases = plan(a.pkg, a.tiny, a.fix)
    if a.dry:
        for case in cases:
            print(case["id"])
        return 0
    if a.cpu:
        os.environ["MFSDP_VAL_CPU"] = "1"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness

    records: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            res = harness.run_case(dict(case, truth={"mode": "save",
                                                     "path": os.path.join(tmp, case["id"])}))
            records[case["id"]] = {k: res.get(k) for k in ("crashed", "error", "process")}
            if not res["crashed"]:  # the gradients only (the losses differ by design)
                import torch

                grads = torch.load(os.path.join(tmp, case["id"]))["grads"]
                records[case["id"]]["grads"] = grads
    summary = {}
    for case in cases[::2]:
        two, last = records[case["id"]], records[case["id"].replace("-2mb", "-last")]
        crashed = bool(two["crashed"] or last["crashed"])
        lost = None if crashed else all(
            bool((a == b).all()) for a, b in zip(two["grads"], last["grads"], strict=True))
        summary[case["id"][:-4]] = {"crashed": crashed, "first_microbatch_lost": lost}
    for record in records.values():
        record.pop("grads", None)
    with open(a.out, "w") as f:
        json.dump({"fix": a.fix, "summary": summary, "runs": records}, f, indent=1, default=str)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
