"""The user's launch command taken apart: the launcher in front (``torchrun ...``, ``srun ...
python``, ``python -m torch.distributed.run ...``, ``mfsdp-hotfix run -- python``), the
Megatron-LM training script, and the script's own arguments, which parity rewrites.

Only the script's arguments are rewritten; the launcher is kept as typed, so each run is one
launch exactly like the user's own (SLURM, multi-node, container wrappers). A command whose
script parity cannot recognise is refused before anything runs: rewriting the flags of a script
whose flags parity does not know could compare two runs that differ in more than the data
parallelism."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

# Megatron-LM's training entry points: each calls ``megatron.training.pretrain``, whose
# ``training_log`` prints the lines parity reads, and parses Megatron-LM's own flags.
_MEGATRON_SCRIPT = re.compile(r"^pretrain_\w+\.py$")
# A script under another name is taken when its text calls Megatron-LM's ``pretrain``.
_CALLS_PRETRAIN = re.compile(r"from\s+megatron\.training\s+import[^\n]*\bpretrain\b|"
                             r"megatron\.training\.pretrain\(|\bmegatron\.training\.training\b")
# Megatron-Bridge recipes take ``section.key=value`` overrides instead of Megatron-LM flags.
_BRIDGE_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")
_SHELL_SCRIPT = re.compile(r"\.(sh|bash|zsh|sbatch|slurm)$")
_SHELLS = ("bash", "sh", "zsh", "dash")

COMPARE_ROUTE = ("run the job twice yourself, once as it is and once with Megatron's own DDP "
                 "(the reference flags are listed in docs/PARITY.md), then compare the two "
                 "logs: mfsdp-hotfix parity --compare REFERENCE_LOG CANDIDATE_LOG")


class Refused(Exception):
    """The command cannot be run by parity; the message says why and what to do instead."""


@dataclass(frozen=True)
class JobCommand:
    """``launcher + [script] + args``: ``launcher`` ends with the interpreter or launcher that
    takes the script (kept as typed), ``args`` are the script's own flags."""

    launcher: tuple[str, ...]
    script: str
    args: tuple[str, ...]

    def with_args(self, args: Sequence[str]) -> list[str]:
        return [*self.launcher, self.script, *args]


def split_command(command: Sequence[str]) -> JobCommand:
    """Find the Megatron-LM script in ``command``; raises :class:`Refused` (with the reason and
    the way around it) for a wrapper shell script, an unknown script or a Bridge recipe."""
    for index, word in enumerate(command):
        if _SHELL_SCRIPT.search(word) or (os.path.basename(word) in _SHELLS
                                          and command[index + 1:index + 2] == ["-c"]):
            raise Refused(
                f"{word} is a shell script: parity rewrites the flags of Megatron-LM's training "
                "script, which it cannot see inside a wrapper. Give the line that starts "
                "training (e.g. torchrun ... pretrain_gpt.py ARGS, or srun ... python "
                "pretrain_gpt.py ARGS) after --, with the wrapper's variables expanded; or "
                + COMPARE_ROUTE)
        if word.endswith(".py"):
            return _job(command, index)
        if word in ("-c", "-m") and index > 0 and _is_python(command[index - 1]):
            if word == "-m" and index + 1 < len(command) and command[index + 1] in (
                    "torch.distributed.run", "torch.distributed.launch"):
                continue
            what = " ".join(command[index - 1:index + 2])
            raise Refused(
                f"'{what}' runs no Megatron-LM training script parity knows: give the command that "
                "runs pretrain_gpt.py (or another pretrain_*.py of Megatron-LM); or "
                + COMPARE_ROUTE)
    raise Refused("no Python training script (pretrain_*.py) found in the command: parity runs "
                  "Megatron-LM's training script, e.g. -- torchrun --nproc-per-node 8 "
                  "pretrain_gpt.py ARGS; or " + COMPARE_ROUTE)


def _job(command: Sequence[str], index: int) -> JobCommand:
    script, args = command[index], tuple(command[index + 1:])
    bridge = [arg for arg in args if _BRIDGE_OVERRIDE.match(arg)]
    if bridge:
        raise Refused(
            f"{script} takes Megatron-Bridge overrides ({bridge[0]}): parity rewrites "
            "Megatron-LM's flags, not a recipe's configuration. Run the recipe twice, once as "
            "it is and once with ddp.use_megatron_fsdp=false ddp.use_distributed_optimizer=true "
            "model.gradient_accumulation_fusion=false (and the logging interval at 1), then: "
            "mfsdp-hotfix parity --compare REFERENCE_LOG CANDIDATE_LOG (docs/PARITY.md)")
    if not (_MEGATRON_SCRIPT.match(os.path.basename(script)) or _calls_pretrain(script)):
        raise Refused(
            f"{script} is not a Megatron-LM training script parity knows (pretrain_*.py, or a "
            "script that calls megatron.training's pretrain): its flags may not be Megatron-"
            "LM's. If it is one under another name, copy it to pretrain_<name>.py; else "
            + COMPARE_ROUTE)
    return JobCommand(tuple(command[:index]), script, args)


def _calls_pretrain(script: str) -> bool:
    try:
        with open(script, errors="replace") as f:
            return bool(_CALLS_PRETRAIN.search(f.read(200_000)))
    except OSError:
        return False


def _is_python(word: str) -> bool:
    return re.fullmatch(r"python[\d.]*", os.path.basename(word)) is not None
