"""The launch commands users type, taken apart into launcher, Megatron-LM script and its
flags; a wrapper shell script, an unknown script and a Megatron-Bridge recipe are refused with
the way around it."""

from __future__ import annotations

from pathlib import Path

import pytest

from mfsdp_hotfix.parity.job_command import Refused, split_command

ARGS = ["--num-layers", "2", "--use-megatron-fsdp"]


@pytest.mark.parametrize("launcher", [
    ["torchrun", "--nproc-per-node", "8", "--nnodes=2", "--rdzv-endpoint", "h:29500"],
    ["python", "-m", "torch.distributed.run", "--nproc_per_node", "8"],
    ["python3", "-m", "torch.distributed.launch", "--use-env"],
    ["srun", "-N", "2", "--ntasks-per-node", "8", "python"],
    ["srun", "--container-image", "nvcr.io/x.sqsh", "python", "-u"],
    ["python"],
    ["mfsdp-hotfix", "run", "--", "torchrun", "--standalone", "--nproc-per-node", "2"],
    [],  # the script itself (executable, with a shebang)
])
def test_the_launcher_is_kept_and_the_script_found(launcher: list[str]) -> None:
    job = split_command([*launcher, "Megatron-LM/pretrain_gpt.py", *ARGS])
    assert job.launcher == tuple(launcher) and job.script == "Megatron-LM/pretrain_gpt.py"
    assert job.args == tuple(ARGS)
    assert job.with_args(["--x"]) == [*launcher, "Megatron-LM/pretrain_gpt.py", "--x"]


def test_a_script_under_another_name_that_calls_pretrain_is_taken(tmp_path: Path) -> None:
    script = tmp_path / "train_mine.py"
    script.write_text("from megatron.training import get_args, pretrain\n")
    assert split_command(["torchrun", str(script), "--seed", "1"]).args == ("--seed", "1")


@pytest.mark.parametrize("command, words", [
    (["bash", "train.sh"], "shell script"),
    (["sbatch", "job.sbatch"], "shell script"),
    (["bash", "-c", "torchrun pretrain_gpt.py --seed 1"], "shell script"),
    (["srun", "./launch.sh", "--seed", "1"], "shell script"),
    (["torchrun", "train.py", "--seed", "1"], "not a Megatron-LM training script"),
    (["python", "-c", "print(1)"], "runs no Megatron-LM training script"),
    (["python", "-m", "mymodule", "--seed", "1"], "runs no Megatron-LM training script"),
    (["torchrun", "--nproc-per-node", "2"], "no Python training script"),
    (["python", "examples/recipes/pretrain_llama3_8b.py", "ddp.use_megatron_fsdp=true",
      "train.train_iters=10"], "Megatron-Bridge overrides"),
])
def test_what_parity_cannot_rewrite_is_refused_with_the_way_around(command: list[str],
                                                                   words: str) -> None:
    with pytest.raises(Refused) as refused:
        split_command(command)
    assert words in str(refused.value)
    assert "mfsdp-hotfix parity --compare" in str(refused.value)
