"""Parity's run command lines through the real releases' own ``parse_and_validate_args`` (on
CPU): the Megatron-FSDP command line of the GPU validation (``validation/megatron_lm``), with
the user's output flags added, planned by parity; each run's flags, with each run's environment,
must be taken by the release and mean what parity says: the reference is Megatron's own DDP with
the distributed optimizer and fused wgrad accumulation off, in deterministic mode, for the
planned iterations, with evaluation off and nothing saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import releases
from conftest import REPO

from mfsdp_hotfix.parity.job_command import JobCommand
from mfsdp_hotfix.parity.plan import make_plan

sys.path.insert(0, str(REPO / "validation"))
from megatron_lm.arguments import pretrain_args  # noqa: E402
from megatron_lm.plan import case  # noqa: E402

PARSE = r"""
import json, sys, typing
if not hasattr(typing, "override"):  # Python < 3.12: a no-op decorator
    typing.override = lambda f: f
import megatron.training.arguments as arguments
import torch
arguments.get_device_arch_version = lambda: 9  # a Hopper GPU, which this CPU machine lacks
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
keys = ("use_megatron_fsdp", "use_distributed_optimizer", "gradient_accumulation_fusion",
        "ckpt_format", "deterministic_mode", "train_iters", "log_interval", "eval_iters", "save",
        "tensorboard_dir", "data_cache_path", "one_logger", "data_parallel_sharding_strategy",
        "fsdp_double_buffer", "exit_interval")
out = {}
import megatron.training.global_vars as global_vars
import megatron.core.num_microbatches_calculator as microbatches
for name, argv in json.loads(sys.argv[1]).items():
    for module in (global_vars, microbatches):  # the parser's globals, set once per process
        for var in [v for v in vars(module) if v.startswith("_GLOBAL_")]:
            setattr(module, var, None)
    sys.argv = ["pretrain_gpt.py"] + argv
    args = arguments.parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    out[name] = {k: getattr(args, k, None) for k in keys}
print("PARSED " + json.dumps(out))
"""


def parsed(release: str, runs: dict[str, list[str]], env: dict[str, str]
           ) -> dict[str, dict[str, Any]]:
    """Each run's flags as the release parses them (one process; the runs' environments differ
    only in what the parser does not read: MFSDP_HOTFIX and where the capture writes)."""
    full = dict(os.environ, **env, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    full["PYTHONPATH"] = os.pathsep.join([str(releases.unpacked("megatron-core", release)),
                                          str(REPO)])
    full.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    proc = subprocess.run([sys.executable, "-c", PARSE, json.dumps(runs)], env=full,
                          capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("PARSED "):
            return dict(json.loads(line[len("PARSED "):]))
    raise AssertionError(f"{release} refused {runs}: {(proc.stdout + proc.stderr)[-3000:]}")


@pytest.mark.parametrize("release", ["0.18.2", "0.19.2"])
def test_the_release_takes_every_run_as_parity_means_it(release: str, tmp_path: Path) -> None:
    user = [str(a) for a in pretrain_args(case("core", f"core-{release}", dtype="bf16"))]
    user += ["--save", "/user/ckpt", "--save-interval", "100", "--tensorboard-dir", "/user/tb",
             "--exit-interval", "50"]
    out = str(tmp_path / "out")
    plan = make_plan(JobCommand(("python",), "pretrain_gpt.py", tuple(user)), out, 3, False,
                     True, None, {})
    seen = parsed(release, {run.name: run.command[2:] for run in plan.runs}, plan.runs[1].env)
    for name, values in seen.items():
        assert values["train_iters"] == 3 and values["log_interval"] == 1, name
        assert values["eval_iters"] == 0 and values["deterministic_mode"], name
        assert values["save"] is None and values["exit_interval"] is None, name
        assert values["tensorboard_dir"] == f"{out}/{name}/tensorboard", name
        assert values["data_cache_path"] == f"{out}/data-cache" and not values["one_logger"]
    assert seen["candidate"]["use_megatron_fsdp"] and seen["candidate"]["fsdp_double_buffer"]
    assert seen["candidate"]["gradient_accumulation_fusion"]
    assert seen["candidate"]["ckpt_format"] == "fsdp_dtensor"
    reference = seen["reference"]
    assert not reference["use_megatron_fsdp"] and not reference["fsdp_double_buffer"]
    assert reference["use_distributed_optimizer"]
    assert not reference["gradient_accumulation_fusion"]
    assert reference["ckpt_format"] == "torch_dist"
