"""The runs of one parity check, fully written out before anything runs: the candidate (the
user's command), the reference (Megatron's own DDP, ``rewrite``) and with ``--with-shipped`` the
candidate again without the hotfix; each with its command line, environment and folder.

What every run gets, the same way: ``--log-interval 1``, ``--train-iters`` (``--iters`` past
the iteration the checkpoint of ``--load`` holds), evaluation off, the exit flags removed,
Megatron's deterministic mode where the command allows it, its outputs in its own folder
(``outputs``), and the capture of full-precision values (``capture``). Anything that cannot
be planned is refused here, before anything runs (:class:`~.job_command.Refused`)."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from . import flags, outputs, rewrite
from .capture import capture_environment
from .job_command import JobCommand, Refused

CANDIDATE, REFERENCE, SHIPPED = "candidate", "reference", "shipped"
TITLES = {CANDIDATE: "Megatron-FSDP as you run it", REFERENCE: "Megatron DDP reference",
          SHIPPED: "Megatron-FSDP as shipped (MFSDP_HOTFIX=0)"}
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's checkpoint tracker file

# Removed from every run: parity sets its own (``--train-iters`` ...) or they end a run early.
RUN_CONTROL: dict[str, tuple[int, str]] = {
    "--exit-interval": (1, "would end the run before its iterations"),
    "--exit-duration-in-mins": (1, "would end the run before its iterations"),
}
# Flags that Megatron's deterministic mode refuses (asserts in the releases' arguments.py).
NOT_DETERMINISTIC = ("--use-flash-attn", "--cross-entropy-loss-fusion", "--tp-comm-overlap")
# What --deterministic-mode needs in the environment (megatron-core 0.18 asserts NCCL_ALGO;
# Transformer Engine's attention asserts NVTE_ALLOW_NONDETERMINISTIC_ALGO=0; cuBLAS needs a
# fixed workspace); a value the user set is kept.
DETERMINISM_ENV = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                   "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# Layouts that name layers one by one: --shrink cannot cut them.
LAYER_LAYOUTS = ("--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
                 "--decoder-last-pipeline-num-layers", "--num-layers-per-virtual-pipeline-stage",
                 "--num-virtual-stages-per-pipeline-rank", "--hybrid-override-pattern",
                 "--encoder-num-layers", "--decoder-num-layers")


@dataclass(frozen=True)
class Run:
    name: str
    command: list[str]
    env: dict[str, str]  # set on top of parity's own environment
    folder: str

    @property
    def title(self) -> str:
        return TITLES[self.name]

    @property
    def capture(self) -> str:
        return os.path.join(self.folder, "capture")

    @property
    def log(self) -> str:
        return os.path.join(self.folder, "output.log")


@dataclass(frozen=True)
class Plan:
    runs: list[Run]
    first: int  # the first and last iteration numbers the runs print
    last: int
    every_run: list[str] = field(default_factory=list)  # what changed, for every run
    reference: list[str] = field(default_factory=list)  # ... and for the reference alone
    shrink: int | None = None


def start_iteration(args: Sequence[str]) -> tuple[int, str | None]:
    """The iteration the runs resume from (0 without ``--load``), and where it was read."""
    load = flags.value_of(args, "--load")
    if load is None or flags.has(args, "--finetune"):
        return 0, None
    step = flags.value_of(args, "--ckpt-step")
    if step is not None:
        return int(step), f"--ckpt-step {step}"
    tracker = os.path.join(load, TRACKER)
    try:
        with open(tracker) as f:
            text = f.read().strip()
    except OSError:
        return 0, None
    return (0 if text == "release" else int(text)), tracker


def _iterations(args: list[str], iters: int) -> tuple[list[str], int, int, list[str]]:
    start, source = start_iteration(args)
    last = start + iters
    notes = [f"iterations {start + 1} to {last}" + (f" (resuming at {start}, read from "
                                                      f"{source})" if source else "")]
    if flags.has(args, "--train-samples"):
        batch = flags.value_of(args, "--global-batch-size")
        if batch is None or flags.has(args, "--rampup-batch-size"):
            raise Refused("--train-samples needs a fixed --global-batch-size for parity to set "
                          "how many samples make its iterations (no --rampup-batch-size): give "
                          "--global-batch-size, or train by --train-iters")
        args = flags.put(args, "--train-samples", str(last * int(batch)))
        notes.append(f"--train-samples {last * int(batch)} ({iters} iterations)")
    else:
        args = flags.put(args, "--train-iters", str(last))
    for flag, value in (("--log-interval", "1"), ("--eval-iters", "0")):
        args = flags.put(args, flag, value)
    notes.append("--log-interval 1, --eval-iters 0 (evaluation off)")
    for flag, (values, reason) in RUN_CONTROL.items():
        args, removed = flags.remove(args, flag, values)
        if removed:
            notes.append(f"dropped {' '.join(removed)}: {reason}")
    return args, start + 1, last, notes


def _determinism(args: list[str], env: Mapping[str, str], on: bool
                 ) -> tuple[list[str], dict[str, str], list[str]]:
    if not on:
        return args, {}, ["deterministic mode not added (--no-deterministic)"]
    blocking = [flag for flag in NOT_DETERMINISTIC if flags.has(args, flag)]
    if blocking:
        return args, {}, [f"deterministic mode not added: the job uses {', '.join(blocking)}, "
                          "which Megatron's --deterministic-mode refuses (both runs keep it; "
                          "run-to-run noise is then part of what is compared)"]
    added = {k: v for k, v in DETERMINISM_ENV.items() if k not in env}
    return flags.put(args, "--deterministic-mode"), added, [
        "added --deterministic-mode" + (f" and {' '.join(f'{k}={v}' for k, v in added.items())}"
                                        if added else "")]


def shrink(args: list[str], layers: int) -> list[str]:
    """``args`` with ``--num-layers layers``; refused where the layout names layers itself."""
    given = flags.value_of(args, "--num-layers")
    cut = [flag for flag in LAYER_LAYOUTS if flags.has(args, flag)]
    freq = flags.value_of(args, "--moe-layer-freq")
    if freq is not None and not freq.isdigit():
        cut.append(f"--moe-layer-freq {freq}")
    pipeline = int(flags.value_of(args, "--pipeline-model-parallel-size") or 1)
    recompute = int(flags.value_of(args, "--recompute-num-layers") or 0)
    problem = (f"the layout names its layers ({', '.join(cut)})" if cut
               else "the command gives no --num-layers" if given is None
               else f"--shrink {layers} is not fewer than --num-layers {given}"
               if layers >= int(given) or layers < 1
               else f"{layers} layers do not split over {pipeline} pipeline stages"
               if layers % pipeline
               else f"--recompute-num-layers {recompute} is more than a stage's "
                    f"{layers // pipeline} layers" if recompute > layers // pipeline else None)
    if problem:
        raise Refused(f"--shrink {layers} cannot be applied: {problem}. Run without --shrink, "
                      "or give a command with fewer layers")
    return flags.put(args, "--num-layers", str(layers))


def make_plan(job: JobCommand, out: str, iters: int, with_shipped: bool,
              deterministic: bool, layers: int | None, env: Mapping[str, str]) -> Plan:
    """Every run of the check, or :class:`Refused`."""
    if flags.has(job.args, "--skip-train"):
        raise Refused("the command has --skip-train: it trains no iteration to compare")
    args, first, last, notes = _iterations(list(job.args), iters)
    args, added_env, determinism = _determinism(args, env, deterministic)
    notes += determinism
    if layers is not None:
        args = shrink(args, layers)
        notes.append(f"--num-layers {layers} on every run (--shrink)")
    _refuse_unloadable(job.args)
    reference, reference_notes = rewrite.rewrite(args, reference=True)
    candidate, candidate_notes = rewrite.rewrite(args, reference=False)
    runs: list[Run] = []
    output_notes: list[str] = []
    for name, run_args, hotfix in ((CANDIDATE, candidate, None), (REFERENCE, reference, "0"),
                                   (SHIPPED, candidate, "0")):
        if name == SHIPPED and not with_shipped:
            continue
        folder = os.path.join(out, name)
        run_args, said = outputs.redirect(run_args, folder, out)
        output_notes = output_notes or [note.replace(folder, os.path.join(out, "<run>"))
                                        for note in said]
        run_env = dict(outputs.ENVIRONMENT, **added_env)
        if hotfix is not None:
            run_env["MFSDP_HOTFIX"] = hotfix
        run_env.update(capture_environment(os.path.join(folder, "capture"),
                                           dict(env, **run_env)))
        runs.append(Run(name, job.with_args(run_args), run_env, folder))
    notes += candidate_notes + output_notes
    if env.get("MFSDP_HOTFIX") == "0":
        notes.append("MFSDP_HOTFIX=0 is set here: the candidate runs without the hotfix too")
    return Plan(runs, first, last, notes, reference_notes, layers)


def _refuse_unloadable(args: Sequence[str]) -> None:
    """A Megatron-FSDP checkpoint (fsdp_dtensor) at ``--load``: the DDP reference cannot load
    it, so the two runs could not start from the same weights."""
    load = flags.value_of(args, "--load")
    if load and flags.value_of(args, "--ckpt-format") == "fsdp_dtensor" and \
            os.path.exists(os.path.join(load, TRACKER)):
        raise Refused(
            f"--load {load} holds a Megatron-FSDP checkpoint (--ckpt-format fsdp_dtensor), "
            "which Megatron's DDP reference cannot load: the runs would not start from the "
            "same weights. Run parity without --load (both runs then start from the same "
            "initialisation, by --seed)")


def describe(run: Run) -> str:
    """The run's command line as a shell would take it, with the environment it adds."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(run.env.items()))
    return f"{env} {shlex.join(run.command)}".strip()
