"""The runs of one check, planned before anything runs: iterations (past a checkpoint's),
logging and evaluation, the environment of each run, --shrink and its refusals, and a
Megatron-FSDP checkpoint the reference cannot load."""

from __future__ import annotations

from pathlib import Path

import pytest

from mfsdp_hotfix.parity import flags
from mfsdp_hotfix.parity.job_command import JobCommand, Refused
from mfsdp_hotfix.parity.plan import CANDIDATE, REFERENCE, SHIPPED, make_plan, shrink

FSDP = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--ckpt-format", "fsdp_dtensor", "--num-layers", "8", "--seed", "5", "--train-iters",
        "500000", "--log-interval", "100", "--eval-interval", "1000", "--exit-interval", "900",
        "--save", "/ckpt", "--tensorboard-dir", "/tb", "--data-path", "/data/corpus")


def plan_of(args: tuple[str, ...] = FSDP, **options: object):  # type: ignore[no-untyped-def]
    job = JobCommand(("torchrun", "--nproc-per-node", "8"), "pretrain_gpt.py", args)
    settings = dict(out="/out", iters=3, with_shipped=False, deterministic=True, layers=None,
                    env={})
    settings.update(options)
    return make_plan(job, **settings)  # type: ignore[arg-type]


def test_every_run_gets_the_same_iterations_logging_and_outputs() -> None:
    plan = plan_of(with_shipped=True)
    assert [run.name for run in plan.runs] == [CANDIDATE, REFERENCE, SHIPPED]
    assert (plan.first, plan.last) == (1, 3)
    for run in plan.runs:
        args = run.command[4:]
        assert run.command[:4] == ["torchrun", "--nproc-per-node", "8", "pretrain_gpt.py"]
        assert [flags.value_of(args, f) for f in ("--train-iters", "--log-interval",
                                                  "--eval-iters")] == ["3", "1", "0"]
        assert not flags.has(args, "--exit-interval") and not flags.has(args, "--save")
        assert flags.value_of(args, "--tensorboard-dir") == f"/out/{run.name}/tensorboard"
        assert flags.value_of(args, "--data-cache-path") == "/out/data-cache"
        assert flags.has(args, "--deterministic-mode") and run.env["WANDB_MODE"] == "disabled"
        assert run.env["NCCL_ALGO"] == "Ring" and run.folder == f"/out/{run.name}"
    candidate, reference, shipped = plan.runs
    assert "MFSDP_HOTFIX" not in candidate.env
    assert reference.env["MFSDP_HOTFIX"] == shipped.env["MFSDP_HOTFIX"] == "0"
    assert flags.has(candidate.command, "--use-megatron-fsdp")
    assert shipped.command[4:] == [w.replace("candidate", "shipped") for w in candidate.command[4:]]
    assert not flags.has(reference.command, "--use-megatron-fsdp")
    assert flags.value_of(reference.command, "--ckpt-format") == "torch_dist"


def test_with_load_the_iterations_count_from_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1200\n")
    args = ("--load", str(tmp_path), "--train-iters", "5000", "--ckpt-format", "torch_dist")
    plan = plan_of(args, iters=4)
    assert (plan.first, plan.last) == (1201, 1204)
    assert all(flags.value_of(run.command, "--train-iters") == "1204" for run in plan.runs)
    assert all(flags.value_of(run.command, "--load") == str(tmp_path) for run in plan.runs)
    assert "read from" in plan.every_run[0]
    assert plan_of(args + ("--finetune",)).last == 3
    assert plan_of(args + ("--ckpt-step", "40")).last == 43


def test_a_megatron_fsdp_checkpoint_to_load_is_refused(tmp_path: Path) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(Refused, match="Megatron's DDP reference cannot load"):
        plan_of(("--load", str(tmp_path), "--ckpt-format", "fsdp_dtensor"))
    plan_of(("--load", str(tmp_path / "none"), "--ckpt-format", "fsdp_dtensor"))  # nothing there


def test_train_samples_are_set_for_the_iterations() -> None:
    plan = plan_of(("--train-samples", "900", "--global-batch-size", "16"), iters=2)
    assert all(flags.value_of(run.command, "--train-samples") == "32" for run in plan.runs)
    assert not flags.has(plan.runs[0].command, "--train-iters")
    with pytest.raises(Refused, match="fixed --global-batch-size"):
        plan_of(("--train-samples", "900", "--global-batch-size", "16", "--rampup-batch-size",
                 "4", "4", "100"))


def test_skip_train_is_refused() -> None:
    with pytest.raises(Refused, match="--skip-train"):
        plan_of(("--skip-train",))


def test_shrink_sets_the_layers_of_every_run() -> None:
    plan = plan_of(layers=2)
    assert all(flags.value_of(run.command, "--num-layers") == "2" for run in plan.runs)
    assert plan.shrink == 2 and any("--shrink" in note for note in plan.every_run)


@pytest.mark.parametrize("args, layers, reason", [
    (["--num-layers", "8", "--pipeline-model-parallel-layout", "Et*4|t*4L"], 2,
     "names its layers"),
    (["--num-layers", "8", "--decoder-first-pipeline-num-layers", "3"], 2, "names its layers"),
    (["--num-layers", "8", "--hybrid-override-pattern", "M*M*"], 2, "names its layers"),
    (["--num-layers", "8", "--moe-layer-freq", "([0]+[1]*7)"], 2, "names its layers"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "4"], 3, "do not split over 4"),
    (["--num-layers", "8", "--recompute-num-layers", "4", "--pipeline-model-parallel-size",
      "2"], 4, "more than a stage's 2"),
    (["--num-layers", "2"], 2, "is not fewer than"),
    (["--seed", "1"], 2, "no --num-layers"),
])
def test_shrink_is_refused_where_it_would_break_the_layout(args: list[str], layers: int,
                                                           reason: str) -> None:
    with pytest.raises(Refused, match=reason):
        shrink(args, layers)


def test_a_hotfix_switched_off_in_the_environment_is_said() -> None:
    assert any("candidate runs without the hotfix" in note
               for note in plan_of(env={"MFSDP_HOTFIX": "0"}).every_run)
    assert not any("without the hotfix" in note for note in plan_of().every_run)
