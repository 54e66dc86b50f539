"""The audit's verdicts: what one Megatron-FSDP copy's record on a rank (or summed over ranks)
says, which verdict is the worst, and the exit status of ``mfsdp-hotfix audit`` each one gives.
"""

from __future__ import annotations

from typing import Any

from ..fix_catalogue import SINGLE_RANK_REDUCE
from ..release_defects import SINGLE_RANK_GRADS

# A command killed by signal N exits, as the shell reports it, with this plus N.
SIGNALLED = 128


# The verdicts, worst first: (meaning, what to do, exit status of ``mfsdp-hotfix audit`` when
# the command itself exited 0). Only ``ordered`` means something was checked and found right.
VERDICTS: dict[str, tuple[str, str, int]] = {
    "UNORDERED": ("a gradient-buffer slot was reused by a stream not ordered after the "
                  "reduce-scatter still reading it: on a GPU, silent gradient corruption",
                  "load the hotfix, or run with fsdp_double_buffer=False; with the hotfix "
                  "loaded, report it with the rank files", 3),
    "CRASH": ("the release's double buffer crashed ('No buffer found for bucket_id', era A): "
              "Megatron-FSDP's own code raised it; frames of mfsdp_hotfix/patching.py and "
              "mfsdp_hotfix/slot_reuse.py in the traceback are the audit's observer, which "
              "passes the release's errors on unchanged",
              "load the hotfix, or run with fsdp_double_buffer=False", 3),
    "WRONG GRADIENTS": ("a ZeRO-2/3 gradient buffer's data-parallel group has one rank "
                        "(data-parallel size 1; experts with expert-parallel size equal to the "
                        "data-parallel size) and the release defect "
                        "single-rank-grads-reduced-every-microbatch is not repaired there: the "
                        "releases reduce that buffer in every microbatch, so its gradients are "
                        "wrong as shipped (the lines above say which buffers, and why the "
                        "repair is missing)",
                        "load the hotfix, whose single-rank-reduce repairs it (`mfsdp-hotfix "
                        "status --verbose` says whether it applies); without it, the "
                        "workarounds above", 3),
    "UNWATCHED": ("a Megatron-FSDP copy, or a gradient pool it built, is of a shape the audit "
                  "cannot watch (an allocator or hooks it does not know): nothing about it was "
                  "checked",
                  "read the note above; run with fsdp_double_buffer=False, or report the "
                  "release with `mfsdp-hotfix status --json`", 4),
    "INCOMPLETE": ("some ranks wrote no file, their audit was disabled by an error, or some "
                   "reuses could not be judged: what was checked is not the whole job",
                   "see the lines above; rerun with a path every rank can write", 4),
    "NOT CHECKED": ("the audit watched the job but saw no gradient-slot reuse: no gradient "
                    "pool was built (fsdp_double_buffer=False; or ZeRO-1/2 through "
                    "megatron-core's adapter, which makes no FSDP unit on the releases) or its "
                    "slots were never handed out (one data-parallel rank; ZeRO-1: gradients not "
                    "sharded): there was nothing to check",
                    "nothing to fix where no pool was built; otherwise run at least one full "
                    "step with 2+ ranks, ZeRO-2/3 and 3+ FSDP units", 4),
    "ordered": ("every gradient-slot reuse the audit saw was ordered after the reduce-scatter "
                "that last read the slot", "nothing", 0),
    "UNWRITABLE": ("no rank file could be written where the audit was told to write them, "
                   "so nothing the ranks counted is here",
                   "give --out (or MFSDP_HOTFIX_AUDIT) a path every rank can write", 4),
    "NO DATA": ("no rank wrote a file: no process of the command imported Megatron-FSDP "
                "(megatron_fsdp, or megatron.core.distributed.fsdp) and ran finish_grad_sync() "
                "with the audit on, or the ranks could not write there (each rank's warning "
                "says so)",
                "check that the command trains with Megatron-FSDP itself and passes its "
                "environment (PYTHONPATH, MFSDP_HOTFIX_AUDIT) on to every rank", 4),
}
# Each verdict in the fewest words, and the one thing to do: the first line of the summary
# (:mod:`..verdict_text`'s rule); :data:`VERDICTS` has the whole of both, on the lines below.
GLANCE: dict[str, tuple[str, str]] = {
    "UNORDERED": ("a gradient slot was reused before its reduce-scatter was done",
                  "load the hotfix, or use fsdp_double_buffer=False"),
    "CRASH": ("the release's double buffer crashed",
              "load the hotfix, or use fsdp_double_buffer=False"),
    "WRONG GRADIENTS": ("one-rank gradient buffers are reduced every microbatch",
                        "load the hotfix (single-rank-reduce)"),
    "UNWATCHED": ("a copy or gradient pool the audit cannot watch: not checked",
                  "read the note below"),
    "INCOMPLETE": ("not every rank or reuse was checked", "see below; rerun with a path every "
                                                            "rank can write"),
    "NOT CHECKED": ("no gradient-slot reuse was seen: nothing checked", "see why below"),
    "ordered": ("every gradient-slot reuse was ordered", "nothing to do"),
    "UNWRITABLE": ("no rank file could be written",
                   "give --out a path every rank can write"),
    "NO DATA": ("no process of the command trained with Megatron-FSDP",
                "check the command (below)"),
}
_ORDER = list(VERDICTS)


def worst(verdicts: list[str]) -> str:
    """The first of ``verdicts`` in the order of :data:`VERDICTS`."""
    return min(verdicts, key=_ORDER.index)


FOUND = 3  # the exit status of a finding: UNORDERED, CRASH or WRONG GRADIENTS
WRONG = "WRONG GRADIENTS"


def exit_status(verdict: str, command_status: int) -> int:
    """``mfsdp-hotfix audit``'s exit status (docs/CLI.md, "Exit statuses"): 3 for a finding
    whatever the command's status (a crash fails the command, and is the finding); else the
    command's when it failed (128 + N after signal N); else the verdict's (0 only for
    ``ordered``, 4 for a verdict that checked nothing or not everything)."""
    if VERDICTS[verdict][2] == FOUND:
        return FOUND
    if command_status < 0:  # killed by a signal
        return SIGNALLED - command_status
    return command_status or VERDICTS[verdict][2]


def one_rank(copy: dict[str, Any]) -> tuple[str, int, str] | None:
    """The size-one group defect in one copy's record: ``(state, buffers, words)``, the state
    ``wrong`` (not repaired, and this job is in its configuration), ``repaired`` (by
    single-rank-reduce) or ``right`` (not repaired, but one microbatch per step on a release
    that gets that right); None where no ZeRO-2/3 gradient buffer has a one-rank group or the
    copy's code has no such defect. A release that may add the buffer onto itself
    (``may_self_add``) is wrong from one microbatch on, and under HSDP not repaired."""
    found = copy.get("one_rank_grads")
    if not found or found.get("defect") == "no":
        return None
    dense, expert, hybrid = (int(found.get(k) or 0) for k in ("dense", "expert", "hsdp"))
    kinds = [f"{n} {kind}" for n, kind in ((dense, "dense"), (expert, "expert")) if n]
    buffers = (" and ".join(kinds) + " ZeRO-2/3 gradient buffer(s) whose data-parallel group "
               "has one rank" + (f" ({hybrid} of them under HSDP: a DP-Shard group of one "
                                 "rank)" if hybrid else ""))
    defect = f"the size-one group defect ({SINGLE_RANK_GRADS.name})"
    applied = SINGLE_RANK_REDUCE.id in (copy.get("fixes") or [])
    self_add = found.get("may_self_add", True)
    if applied and not (hybrid and self_add):
        return "repaired", dense + expert, (f"{buffers}: {defect} applies to this job and is "
                                            f"repaired by {SINGLE_RANK_REDUCE.id}")
    why = (f"{SINGLE_RANK_REDUCE.id} does not cover it here: not covered is "
           f"{SINGLE_RANK_GRADS.not_covered}, and a copy without such a release's label or a "
           "later one is taken as one of those" if applied else
           f"{SINGLE_RANK_REDUCE.id} is not applied to this copy (the hotfix is off, or the fix "
           "is disabled, refused or unverified: `mfsdp-hotfix status --verbose` says which)")
    if found.get("defect") != "yes":
        why += ", and the hotfix does not know its hooks' code shape, so it may have the defect"
    microbatches = int(found.get("microbatches") or 0)
    if microbatches == 1 and not self_add:
        return "right", dense + expert, (
            f"{buffers}: {defect} applies and is not repaired, because {why}; this job "
            f"accumulated one microbatch per step, which {copy.get('version')} gets right, but "
            "with 2 or more its gradients are wrong: load the hotfix")
    steps = (f"up to {microbatches} microbatches per step" if microbatches > 1 else
             "1 microbatch per step" if microbatches else "microbatches per step not seen")
    return "wrong", dense + expert, (f"{buffers}: {defect} is not repaired, because {why}; "
                                     f"its gradients are wrong as shipped ({steps})")


def copy_verdict(copy: dict[str, Any]) -> tuple[str, str | None]:
    """One copy's verdict on one rank (or summed over ranks), and why when it is not a count
    (or, where a one-rank gradient buffer has the size-one group defect, what it is)."""
    verdict, why = _slot_verdict(copy)
    size_one = one_rank(copy)
    if size_one is None:
        return verdict, why
    state, _, words = size_one
    if state == "wrong" and worst([verdict, WRONG]) == WRONG:
        return WRONG, words
    if verdict == "NOT CHECKED":
        return verdict, f"{why}; {words}"
    return verdict, why


def _slot_verdict(copy: dict[str, Any]) -> tuple[str, str | None]:
    pools = copy.get("grad_pools")
    if copy.get("audited") is False:
        return "UNWATCHED", copy.get("note") or "not audited"
    if copy.get("unwatched_pools"):
        return "UNWATCHED", ("gradient pool(s) " + ", ".join(copy["unwatched_pools"])
                             + " built from a class the audit does not watch")
    if int(copy.get("unordered", 0)):
        return "UNORDERED", None
    if copy.get("crashed"):
        return "CRASH", None
    if int(copy.get("unseen", 0)):
        return "INCOMPLETE", f"{copy['unseen']} reuses not judged (reduce-scatter not seen)"
    if not int(copy.get("reuses", 0)):
        if pools == {}:
            return "NOT CHECKED", ("no gradient pool was built (fsdp_double_buffer off, or no "
                                   "FSDP unit)")
        return "NOT CHECKED", ("gradient pool(s) " + ", ".join(pools or {}) + " built, no slot "
                               "reused" if pools else "no gradient-slot reuse seen")
    return "ordered", None


def is_used(copy: dict[str, Any]) -> bool:
    """A copy that built a gradient pool, saw anything, could not be watched, or built a
    one-rank gradient buffer that has the size-one group defect: one whose verdict counts."""
    return copy.get("grad_pools") != {} or bool(
        copy.get("reuses") or copy.get("crashed") or copy.get("unseen")
        or copy.get("unwatched_pools") or copy.get("audited") is False) \
        or one_rank(copy) is not None
