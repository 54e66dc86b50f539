"""Never touch the user's data: every flag through which Megatron-LM writes outside the run is
dropped or pointed into the run's own folder under parity's ``--out``.

``OUTPUT_FLAGS`` lists each such flag of megatron-core 0.14 to 0.19 and NVIDIA main with what a
parity run does with it and why. ``--data-cache-path`` is set on every run even when the user
gave none: without it Megatron writes its dataset index cache next to the user's data. Weights
& Biases is off in the environment as well (``WANDB_MODE=disabled``), so a ``wandb`` set up by
the user's own code uploads nothing. ``--load`` is read, never written, and stays the same for
every run."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from . import flags
from .flags import MANY

DROP = "drop"


@dataclass(frozen=True)
class Output:
    """``into``: a path inside the run's folder the flag is pointed at (``DROP``: removed);
    ``values``: the words the flag takes."""

    into: str
    values: int
    reason: str


_NO_CHECKPOINT = "parity writes no checkpoint: it compares iterations, and a checkpoint " \
                 "of a few iterations is of no use"
_NO_UPLOAD = "nothing is uploaded from a parity run"
_NO_PROFILE = "a profile of a few iterations is not what parity checks; it would slow the runs"

OUTPUT_FLAGS: dict[str, Output] = {
    "--save": Output(DROP, 1, _NO_CHECKPOINT + "; the user's checkpoint folder stays untouched"),
    "--save-interval": Output(DROP, 1, _NO_CHECKPOINT),
    "--persistent-save-interval": Output(DROP, 1, _NO_CHECKPOINT),
    "--non-persistent-save-interval": Output(DROP, 1, _NO_CHECKPOINT),
    "--non-persistent-global-ckpt-dir": Output(DROP, 1, _NO_CHECKPOINT),
    "--non-persistent-local-ckpt-dir": Output(DROP, 1, _NO_CHECKPOINT),
    "--save-retain-interval": Output(DROP, 1, _NO_CHECKPOINT),
    "--async-save": Output(DROP, 0, _NO_CHECKPOINT),
    "--ckpt-convert-save": Output(DROP, 1, _NO_CHECKPOINT),
    "--log-progress": Output(DROP, 0, "writes progress.txt into the checkpoint folder"),
    "--save-wgrads-interval": Output(DROP, 1, "writes gradients into the checkpoint folder"),
    "--save-dgrads-interval": Output(DROP, 1, "writes gradients into the checkpoint folder"),
    "--save-params-interval": Output(DROP, 1, "writes parameters into the checkpoint folder"),
    "--save-activations-interval": Output(DROP, 1, "writes activations into the checkpoint "
                                                   "folder"),
    "--save-tokens-per-expert-interval": Output(DROP, 1, "writes routing data into the "
                                                         "checkpoint folder"),
    "--ckpt-pg-tensors-cache-path": Output(DROP, 1, "a checkpoint-save cache; no checkpoint "
                                                    "is saved"),
    "--ckpt-pg-tensors-cache-create": Output(DROP, 0, "creates that cache"),
    "--tensorboard-dir": Output("tensorboard", 1, "TensorBoard events of the run, kept in its "
                                                  "folder"),
    "--wandb-project": Output(DROP, 1, _NO_UPLOAD),
    "--wandb-exp-name": Output(DROP, 1, _NO_UPLOAD),
    "--wandb-entity": Output(DROP, 1, _NO_UPLOAD),
    "--wandb-save-dir": Output(DROP, 1, _NO_UPLOAD),
    "--one-logger-project": Output(DROP, 1, _NO_UPLOAD + " (--no-one-logger is added)"),
    "--one-logger-run-name": Output(DROP, 1, _NO_UPLOAD),
    "--one-logger-async": Output(DROP, 0, _NO_UPLOAD),
    "--data-cache-path": Output("data-cache", 1, "Megatron's dataset index cache, else written "
                                                 "next to the user's data (set on every run)"),
    "--object-storage-cache-path": Output("object-storage-cache", 1, "a cache of index files "
                                                                     "of remote data"),
    "--config-logger-dir": Output("config-logger", 1, "dumps of the entry-point configuration"),
    "--flight-recorder-dump-path": Output("flight-recorder/dump", 1, "NCCL flight-recorder "
                                                                     "dumps"),
    "--memory-snapshot-path": Output("memory-snapshot.pickle", 1, "the memory history dump"),
    "--record-memory-history": Output(DROP, 0, _NO_PROFILE),
    "--profile": Output(DROP, 0, _NO_PROFILE),
    "--use-pytorch-profiler": Output(DROP, 0, _NO_PROFILE + " (it writes into TensorBoard's "
                                                            "folder)"),
    "--profile-step-start": Output(DROP, 1, _NO_PROFILE),
    "--profile-step-end": Output(DROP, 1, _NO_PROFILE),
    "--profile-ranks": Output(DROP, MANY, _NO_PROFILE),
    "--pytorch-profiler-collect-shapes": Output(DROP, 0, _NO_PROFILE),
    "--pytorch-profiler-collect-callstack": Output(DROP, 0, _NO_PROFILE),
    "--pytorch-profiler-collect-chakra": Output(DROP, 0, _NO_PROFILE),
    "--record-shapes": Output(DROP, 0, _NO_PROFILE),
    "--moe-routing-trace-path": Output("moe-routing-trace", 1, "MoE router decision traces"),
    "--logits-save-dir": Output("logits", 1, "saved logits"),
    "--rl-profile": Output(DROP, 0, _NO_PROFILE + " (it writes into the checkpoint folder "
                                                  "unless --rl-profile-dir is given)"),
    "--rl-profile-dir": Output("rl-profile", 1, "RL profiling data"),
    "--rl-rollout-bank-dir": Output("rollout-bank", 1, "the RL rollout bank"),
    "--result-rejected-tracker-filename": Output("result-rejected.txt", 1,
                                                 "the file tracking rejected results"),
}
# Set on every run (whether or not the user gave it), into the folder all runs share.
SHARED = {"--data-cache-path"}
ADDED = {"--no-one-logger": "one-logger telemetry off: " + _NO_UPLOAD}
ENVIRONMENT = {"WANDB_MODE": "disabled"}


def redirect(args: Sequence[str], run_folder: str, shared_folder: str
             ) -> tuple[list[str], list[str]]:
    """``args`` with every output flag dropped or pointed into ``run_folder``
    (``shared_folder`` for ``SHARED``); returns the new args and one note per change."""
    out, notes = list(args), []
    for flag, rule in OUTPUT_FLAGS.items():
        given = flags.has(out, flag)
        if not given and flag not in SHARED:
            continue
        out, removed = flags.remove(out, flag, rule.values)
        if rule.into == DROP:
            notes.append(f"dropped {' '.join(removed)}: {rule.reason}")
            continue
        target = os.path.join(shared_folder if flag in SHARED else run_folder, rule.into)
        out += [flag, target]
        notes.append(f"{flag} -> {target}" + (f" (was {removed[-1]})" if given else "")
                     + f": {rule.reason}")
    for flag, reason in ADDED.items():
        out = flags.put(out, flag)
        notes.append(f"added {flag}: {reason}")
    return out, notes


def written_paths(args: Sequence[str]) -> list[str]:
    """The output paths ``args`` still names (for the check that each lies under ``--out``)."""
    return [value for flag, rule in OUTPUT_FLAGS.items() if rule.into != DROP
            for value in [flags.value_of(args, flag)] if value is not None]


# Folders of the user's that ``--out`` must not lie in: what the job reads or writes itself.
USER_FOLDERS = ("--save", "--load", "--tensorboard-dir", "--data-cache-path", "--wandb-save-dir")


def inside_user_data(out: str, args: Sequence[str]) -> str | None:
    """Why ``out`` must not take the runs (it lies in a folder of the user's job), or None."""
    out = os.path.realpath(out)
    for flag in USER_FOLDERS:
        given = flags.value_of(args, flag)
        if given and (out + os.sep).startswith(os.path.realpath(given) + os.sep):
            return f"lies in the job's {flag} folder {given}: give a folder of its own"
    return None
