"""Every double-buffer configuration a release offers, as one matrix (docs/CONFIGURATIONS.md).

Each row is run with the real library through the selftest harness (CPU stand-in, gloo), as
shipped (``MFSDP_HOTFIX=0``) and with the hotfix, always with the on-the-job audit on. The
measurement is :func:`measure`; ``docs/configurations.json`` is its committed record (rewritten
with ``MFSDP_WRITE_CONFIGURATIONS=1``), and :func:`table` renders that record as the table in
docs/CONFIGURATIONS.md. ``test_configurations.py`` checks the rows' expectations, that a new
measurement equals the record, and that the doc shows the record.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import accumulation
import releases
import snapshots

from mfsdp_hotfix.selftest.protocol import AUTO_SYNC, MEGATRON_LM
from mfsdp_hotfix.selftest.runner import run_case
from mfsdp_hotfix.selftest.spec import CaseResult, CaseSpec

RECORD = releases.REPO / "docs" / "configurations.json"
DOC = releases.REPO / "docs" / "CONFIGURATIONS.md"
BEGIN, END = "<!-- configurations table: begin -->", "<!-- configurations table: end -->"

# What the hotfix must do in a row:
FIXED = "fixed"  # with the hotfix: >0 reuses, none unordered, gradients equal the reference
REFUSED = "refused"  # the hotfix refuses the copy (with its reason); the audit reports the race
NOT_CHECKED = "not checked"  # no gradient-slot reuse at all; the audit says NOT CHECKED
CONTROL = "control"  # fsdp_double_buffer=False: what accumulation does without the double buffer


@dataclass(frozen=True)
class Configuration:
    id: str
    source: str  # "0.6.1" (a megatron-fsdp wheel), "git:<ref>" (a Megatron-LM branch) or
    #              "snapshot:<name>" (a copy rebuilt by tests/snapshots.py, no clone needed)
    what: str
    expect: str
    fields: dict[str, Any] = field(default_factory=dict)
    # what explains gradients that differ from the reference in this row (accumulation.CAUSES
    # keys); recorded only for a run whose gradients do differ
    cause: tuple[str, ...] = ()

    def spec(self, hotfix: str) -> CaseSpec:
        return CaseSpec(flavour="standalone", path=str(path_of(self.source)), hotfix=hotfix,
                        audit=True, **{"units": 6, "microbatches": 2,
                                       "protocol": MEGATRON_LM, **self.fields})

    @property
    def hotfix_modes(self) -> tuple[str, ...]:
        return ("on",) if self.expect == CONTROL else ("off", "on")


MAXPOOL = {"maxpool_double_buffer": True}
# Every row runs 2 microbatches per step, driven as Megatron-LM drives them (no_sync() around all
# but the last), except the one single-microbatch control; docs/ACCUMULATION.md says why ZeRO-1
# with fused wgrad differs from the reference on the releases (zero1-fused-wgrad-overwrite) and
# why the auto-sync controls do (auto-sync-accumulation).
OVERWRITE = (accumulation.ZERO1_OVERWRITE,)
TWICE = (accumulation.REDUCED_TWICE,)
AUTO = (accumulation.AUTO_SYNC_ACCUMULATION,)
NO_OVERLAP = {"overlap_grad_reduce": False}
CONFIGURATIONS = (
    Configuration("fixedpool-zero3", "0.6.1", "FixedPoolAllocator, ZeRO-3", FIXED),
    Configuration("maxpool-zero3", "0.6.1", "MaxPoolAllocator (maxpool_double_buffer=True), "
                  "ZeRO-3", FIXED, {"options": MAXPOOL}),
    Configuration("fixedpool-zero2", "0.6.1", "FixedPoolAllocator, ZeRO-2", FIXED,
                  {"strategy": "optim_grads"}),
    Configuration("maxpool-zero2", "0.6.1", "MaxPoolAllocator, ZeRO-2", FIXED,
                  {"strategy": "optim_grads", "options": MAXPOOL}),
    Configuration("fixedpool-wide-fallback", "0.6.1",
                  "FixedPoolAllocator, one unit 2x wider: its bucket falls back to the "
                  "backup (storage-resize) allocator", FIXED, {"wide_units": 1}),
    Configuration("fixedpool-wide-persist", "0.6.1",
                  "FixedPoolAllocator, one wider unit in a persistent buffer "
                  "(fsdp_db_use_persist_buf_on_alloc_fail=True)", FIXED,
                  {"wide_units": 1,
                   "options": {"fsdp_db_use_persist_buf_on_alloc_fail": True}}),
    Configuration("maxpool-wide", "0.6.1", "MaxPoolAllocator, one wider unit (the max pool "
                  "sizes its slots for it)", FIXED, {"wide_units": 1, "options": MAXPOOL}),
    Configuration("zero1", "0.6.1", "FixedPoolAllocator built, ZeRO-1 (gradients not "
                  "sharded)", NOT_CHECKED, {"strategy": "optim"}, OVERWRITE),
    Configuration("zero1-no-overlap", "0.6.1", "FixedPoolAllocator built, ZeRO-1, "
                  "overlap_grad_reduce=False", NOT_CHECKED, {"strategy": "optim", **NO_OVERLAP},
                  OVERWRITE + TWICE),
    Configuration("zero1-1mb", "0.6.1", "control: ZeRO-1 as above, 1 microbatch (nothing "
                  "accumulated)", NOT_CHECKED, {"strategy": "optim", "microbatches": 1}),
    Configuration("hsdp", "0.6.1", "HSDP: 4 ranks, DP-Outer 2 x DP-Shard 2, ZeRO-3 "
                  "(hsdp_grad_comm pool built, idle without grad_comm_dtype)",
                  FIXED, {"world": 4, "outer": 2}),
    Configuration("hsdp-grad-comm", "0.6.1", "HSDP as above, gradients reduced in bfloat16 "
                  "(grad_comm_dtype): slots of the hsdp_grad_comm pool in use", FIXED,
                  {"world": 4, "outer": 2, "grad_comm_dtype": "bfloat16"}),
    Configuration("main-zero3", "git:main", "NVIDIA main (with PR #6357), FixedPool, ZeRO-3",
                  FIXED),
    Configuration("main-zero2", "git:main", "NVIDIA main (PR #6357: ZeRO-2 FSDP units), "
                  "FixedPool, ZeRO-2", FIXED, {"strategy": "optim_grads"}),
    Configuration("main-maxpool-zero2", "git:main", "NVIDIA main, MaxPool, ZeRO-2", FIXED,
                  {"strategy": "optim_grads", "options": MAXPOOL}),
    Configuration("main-zero1", "git:main", "NVIDIA main (PR #6357: ZeRO-1 fused wgrad), "
                  "ZeRO-1", NOT_CHECKED, {"strategy": "optim"}),
    Configuration("pr6316-count3", "git:pull-request/6316",
                  "PR #6316 (fsdp_buffer_count, on NVIDIA dev), fsdp_buffer_count=3", FIXED,
                  {"options": {"fsdp_buffer_count": 3}}),
    # PR #6316's siblings (open #6317, #6318, #6665 build on its change; closed #5657 sized only
    # the MaxPool, with megatron_fsdp_max_pool_buffer_count, and kept 0.19's drain).
    *(Configuration(f"pr{pull}-count3", f"git:refs/pull/{pull}/head",
                    f"PR #{pull} ({what}), FixedPool, ZeRO-3, fsdp_buffer_count=3", FIXED,
                    {"options": {"fsdp_buffer_count": 3}})
      for pull, what in (("6317", "PR #6316 + deterministic manual UBR registration"),
                         ("6318", "PR #6316 + symmetric UBR scoped to dense inner gathers"),
                         ("6665", "as #6318, expert allocator units in double_buf_units"))),
    Configuration("pr5657-maxpool-count3", "git:refs/pull/5657/head",
                  "PR #5657 (closed: megatron_fsdp_max_pool_buffer_count, 0.19's drain), "
                  "MaxPool, ZeRO-3, 3 slots", FIXED,
                  {"options": {**MAXPOOL, "maxpool_buffer_count": 3}}),
    # PR #6316 rebuilt from the 0.6.1 wheel (tests/snapshots.py), so that CI runs N-slot pools.
    *(Configuration(f"pr6316-rebuilt-{pool}-count{n}", "snapshot:pr6316",
                    f"PR #6316 rebuilt, {what}, ZeRO-3, fsdp_buffer_count={n}", FIXED,
                    {"options": {**options, "fsdp_buffer_count": n}})
      for pool, what, options in (("fixedpool", "FixedPool", {}), ("maxpool", "MaxPool", MAXPOOL))
      for n in (3, 4)),
    Configuration("pr6316-rebuilt-zero2-count3", "snapshot:pr6316",
                  "PR #6316 rebuilt, FixedPool, ZeRO-2, fsdp_buffer_count=3", FIXED,
                  {"strategy": "optim_grads", "options": {"fsdp_buffer_count": 3}}),
    Configuration("control-zero1-2mb", "0.6.1", "control: ZeRO-1, "
                  "fsdp_double_buffer=False", CONTROL,
                  {"strategy": "optim", "double_buffer": False}, OVERWRITE),
    Configuration("control-zero1-2mb-no-overlap", "0.6.1", "control: ZeRO-1, "
                  "fsdp_double_buffer=False, overlap_grad_reduce=False", CONTROL,
                  {"strategy": "optim", "double_buffer": False, **NO_OVERLAP},
                  OVERWRITE + TWICE),
    Configuration("control-no_shard-2mb", "0.6.1", "control: no_shard, "
                  "fsdp_double_buffer=False", CONTROL,
                  {"strategy": "no_shard", "double_buffer": False}),
    Configuration("control-no_shard-2mb-no-overlap-sum", "0.6.1", "control: no_shard, "
                  "fsdp_double_buffer=False, overlap_grad_reduce=False, SUM reduction "
                  "(calculate_per_token_loss)", CONTROL,
                  {"strategy": "no_shard", "double_buffer": False, "grad_reduce": "per-token",
                   **NO_OVERLAP}, TWICE),
    Configuration("control-hsdp-2mb", "0.6.1", "control: HSDP, "
                  "fsdp_double_buffer=False", CONTROL,
                  {"world": 4, "outer": 2, "double_buffer": False}),
    Configuration("control-zero1-2mb-auto-sync", "0.6.1", "control: ZeRO-1, "
                  "fsdp_double_buffer=False, auto-sync", CONTROL,
                  {"strategy": "optim", "double_buffer": False, "protocol": AUTO_SYNC},
                  OVERWRITE + AUTO),
    Configuration("control-hsdp-2mb-auto-sync", "0.6.1", "control: HSDP, "
                  "fsdp_double_buffer=False, auto-sync", CONTROL,
                  {"world": 4, "outer": 2, "double_buffer": False, "protocol": AUTO_SYNC},
                  AUTO),
)


def path_of(source: str) -> Path | None:
    if source.startswith("git:"):
        return releases.git_tree(source[4:])
    if source.startswith("snapshot:"):
        return snapshots.cached(source[9:])
    return releases.unpacked("megatron-fsdp", source)


def release_label(source: str) -> str:
    if source.startswith("git:"):
        ref = source[4:]
        pull = re.search(r"\d+", ref)
        name = "NVIDIA main" if pull is None else f"PR #{pull.group()}"
        return f"{name} @{releases.git_commit(ref)}"
    if source.startswith("snapshot:"):
        snapshot = snapshots.SNAPSHOTS[source[9:]]
        return (f"{snapshot.distribution} {snapshot.base} + PR #6316's change "
                f"(@{snapshot.commit[:10]}), rebuilt")
    return f"megatron-fsdp {source}"


# Reduced in bfloat16 (8 significant bits): each rank's term is rounded (relative error up to
# 2^-9), and so is each partial sum; 2^-6 of the largest gradient leaves room for that and is
# still far below what a broken buffer gives (O(1e-1), or NaN).
BF16_RELATIVE = 2.0 ** -6


def tolerance(spec: CaseSpec) -> float:
    """Two ranks: exact (see realcases.GRAD_TOLERANCE). Four: each gradient is a sum of four
    ranks' terms, added in another order by the reduce-scatter than by the reference."""
    return 0.0 if spec.world == 2 else 1e-6


def grads_equal(result: CaseResult) -> bool:
    if result.spec.grad_comm_dtype is None:
        return result.grads_match(tolerance(result.spec))
    return (not result.crashed and result.max_rel_grad_error is not None
            and result.max_rel_grad_error <= BF16_RELATIVE)


def _refusal(log: str) -> str | None:
    """The reason in the hotfix's 'NOT patching' warning (the path before it varies)."""
    found = re.search(r"mfsdp_hotfix: NOT patching .*? at \S+: (.*)", log)
    return found.group(1).strip() if found else None


def _causes(row: Configuration, copy: dict[str, Any]) -> tuple[str, ...]:
    """The row's causes that can explain this run: a release cause is repaired where the
    hotfix applied its fix (``accumulation.REPAIRED_BY``)."""
    applied = copy.get("fixes") or []
    return tuple(c for c in row.cause if accumulation.REPAIRED_BY.get(c) not in applied)


def _run(result: CaseResult, row: Configuration) -> dict[str, Any]:
    copies = (result.audit_report or {}).get("copies", [])
    copy = copies[0] if copies else {}
    return {"unordered": result.ordering_violations, "reuses": result.ordering_checks,
            "audit_unordered": result.audit_unordered, "audit_reuses": result.audit_reuses,
            "audit_verdict": result.audit_verdict, "crashed": result.crashed,
            "exception": (result.exception or "")[:200] or None,
            # 3 significant digits: a wrong gradient's last digits vary between machines
            "max_abs_grad_error": accumulation.significant(result.max_abs_grad_error),
            "max_rel_grad_error": accumulation.significant(result.max_rel_grad_error),
            "bf16": result.spec.grad_comm_dtype == "bfloat16",
            "grads_equal": grads_equal(result),
            "cause": None if grads_equal(result) else (
                "; ".join(accumulation.CAUSES[c] for c in _causes(row, copy)) or None),
            "era": copy.get("era"), "fixes": copy.get("fixes"),
            "grad_pools": copy.get("grad_pools"),
            "grad_pools_unordered": copy.get("grad_pools_unordered"), "note": copy.get("note"),
            "refusal": _refusal(result.log_tail)}


def measure(row: Configuration) -> dict[str, Any]:
    """Both runs of one row (one for a control), as plain data."""
    spec = row.spec("on")
    return {"release": release_label(row.source), "what": row.what, "expect": row.expect,
            "microbatches": spec.microbatches, "protocol": spec.protocol,
            "runs": {mode: _run(run_case(row.spec(mode)), row) for mode in row.hotfix_modes}}


def load_record() -> dict[str, Any]:
    return dict(json.loads(RECORD.read_text()))


# With the hotfix, auto-sync over an in-place gradient buffer (wrong as shipped) is stopped at
# the step with the workaround, by design.
AUTO_SYNC_STOPPED = "UnsupportedConfiguration: mfsdp_hotfix: auto-sync-stop: "


def stopped_by_design(run: dict[str, Any]) -> bool:
    return (run["exception"] or "").startswith(AUTO_SYNC_STOPPED)


def _grads(run: dict[str, Any]) -> str:
    if stopped_by_design(run):
        return "stopped at the step by auto-sync-stop, with the workaround"
    if run["crashed"]:
        return "crash"
    error = run["max_abs_grad_error"]
    if run["grads_equal"] and run["bf16"]:
        return f"equal within bf16 rounding (relative {run['max_rel_grad_error']:.0e})"
    if run["grads_equal"]:
        return "equal" if error == 0 else f"equal (within {error:.0e})"
    names = ", ".join(re.findall(r"(?:release|harness): ([\w-]+)", run["cause"] or ""))
    return f"WRONG (max abs error {error:.2g}; {names})"


def _counts(run: dict[str, Any]) -> str:
    return f"{run['unordered']}/{run['reuses']}"


def _hotfix(run: dict[str, Any]) -> str:
    if run["era"] == "refused":
        return "refused: unrecognised code shape, nothing patched"
    return ", ".join(run["fixes"] or []) or "none"


def _per_pool(run: dict[str, Any]) -> str:
    """``fsdp_grads 16/22, fsdp_grads fallback 0/3`` (rank 0's file)."""
    parts = []
    for label, reuses in (run["grad_pools"] or {}).items():
        name, _, detail = label.partition(" (")
        kind = detail.rstrip(")").split(", ")[1:]
        unordered = (run["grad_pools_unordered"] or {}).get(label, 0)
        parts.append(f"{' '.join([name, *kind])} {unordered}/{reuses}")
    return ", ".join(parts) or "none built"


def table(record: dict[str, Any]) -> str:
    """The markdown table of docs/CONFIGURATIONS.md, from the record."""
    lines = ["| configuration | release | microbatches, protocol | shipped: unordered/reuses, "
             "audit | shipped, per gradient pool (rank 0) | hotfix applied | hotfix: "
             "unordered/reuses, audit | hotfix: gradients vs reference |",
             "|---|---|---|---|---|---|---|---|"]
    for row in CONFIGURATIONS:
        got = record[row.id]
        runs = got["runs"]
        shipped = runs.get("off")
        fixed = runs["on"]
        lines.append(
            f"| {got['what']} | {got['release']} | {got['microbatches']}, {got['protocol']} | "
            + (f"{_counts(shipped)}, `{shipped['audit_verdict']}` | {_per_pool(shipped)}"
               if shipped else "— | —")
            + f" | {_hotfix(fixed)} | {_counts(fixed)}, `{fixed['audit_verdict']}` | "
            f"{_grads(fixed)} |")
    return "\n".join(lines)


def doc_table() -> str:
    text = DOC.read_text()
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
