"""A case's command line for ``pretrain_gpt.py``, and its check by the release's own argument
parser (on the CPU, before any GPU time is spent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from .plan import MICROBATCHES, SIZE

# the experts through TE's op fuser, weighted squared-ReLU: the fused path a Hopper GPU reaches
# (SwiGLU's needs the CuTe kernel of Blackwell)
OP_FUSER_FLAGS = ("--use-transformer-engine-op-fuser", "--squared-relu",
                  "--use-fused-weighted-squared-relu")


def pretrain_args(c: dict[str, Any], size: dict[str, int] = SIZE) -> list[str]:
    """``pretrain_gpt.py``'s command line for a case (a small GPT, mock data, TE layers)."""
    z = size
    gbs = MICROBATCHES * z["mbs"] * c["dp"]
    a = ["--num-layers", z["layers"], "--hidden-size", z["hidden"],
         "--num-attention-heads", z["heads"], "--ffn-hidden-size", z["ffn"],
         "--seq-length", z["seq"], "--max-position-embeddings", z["seq"],
         "--micro-batch-size", z["mbs"], "--global-batch-size", gbs,
         "--train-iters", c["iterations"], "--eval-iters", 0, "--eval-interval", 1000,
         "--log-interval", 1,
         "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "constant",
         "--clip-grad", "1.0", "--weight-decay", "0.01", "--optimizer", "adam", "--seed", 1234,
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", z["vocab"],
         "--num-workers", 0,
         "--position-embedding-type", "rope", "--no-rope-fusion", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--hidden-dropout", 0,
         "--attention-dropout", 0]
    if c["fsdp"]:
        a += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", c["sharding"],
              "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
    else:  # the reference: Megatron's own DDP (the default) with the distributed optimizer
        a += ["--use-distributed-optimizer"]
    if c["impl"] == "te":
        a += ["--transformer-impl", "transformer_engine", "--attention-backend", "unfused"]
    else:
        # the local layer spec always takes megatron-core's DotProductAttention
        # and, without TE or APEX, none of Megatron's fused CUDA kernels: bf16 would take the
        # fused softmax (scaled_masked_softmax_cuda)
        a += ["--transformer-impl", "local", "--no-persist-layer-norm",
              "--no-masked-softmax-fusion"]
    if not c["fusion"]:
        a.append("--no-gradient-accumulation-fusion")
    if c["deterministic"]:
        a.append("--deterministic-mode")
    if c["db"]:
        a.append("--fsdp-double-buffer")
    if c["overlap_grad_reduce"]:
        a.append("--overlap-grad-reduce")
    if c["overlap_param_gather"]:
        a.append("--overlap-param-gather")
    if c["dtype"] in ("bf16", "fp8"):
        a.append("--bf16")
    if c["dtype"] == "fp8":
        a += ["--fp8-format", "hybrid"]
    if c["recompute"]:
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform",
              "--recompute-num-layers", 1]
    if c["moe"]:
        a += ["--num-experts", z["experts"], "--moe-ffn-hidden-size", z["moe_ffn"],
              # one expert per token: the releases require the softmax before the top-k
              "--moe-router-topk", 1, "--moe-router-pre-softmax", "--moe-grouped-gemm",
              "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", 0,
              "--moe-router-load-balancing-type", "none"]
        if c.get("op_fuser"):
            a += list(OP_FUSER_FLAGS)
    if c["launcher"] == "fake":
        a.append("--fake-process-group")
    return [str(x) for x in a]


PARSE_CODE = r"""
import json, sys, typing
if not hasattr(typing, "override"):  # Python < 3.12 (CPU checks only): a no-op decorator
    typing.override = lambda f: f
import megatron.training.arguments as arguments
import torch
# the GPU runs' H100/H200 (there is no GPU here)
arguments.get_device_arch_version = lambda: 9
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
sys.argv = ["pretrain_gpt.py"] + json.loads(sys.argv[1])
args = arguments.parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
from megatron.core.num_microbatches_calculator import get_num_microbatches
keys = ("data_parallel_size", "world_size", "use_megatron_fsdp", "fsdp_double_buffer",
        "data_parallel_sharding_strategy", "overlap_grad_reduce", "overlap_param_gather",
        "use_distributed_optimizer", "gradient_accumulation_fusion", "bf16", "fp8",
        "recompute_granularity", "recompute_method", "num_experts", "moe_grouped_gemm",
        "fake_process_group", "ckpt_format", "global_batch_size", "micro_batch_size",
        "deterministic_mode", "transformer_impl", "cross_entropy_loss_fusion",
        "use_transformer_engine_op_fuser", "use_fused_weighted_squared_relu", "squared_relu")
out = {k: getattr(args, k, None) for k in keys}
out["num_microbatches"] = get_num_microbatches()
print("PARSED " + json.dumps(out))
"""


def determinism_env(c: dict[str, Any]) -> dict[str, str]:
    """What ``--deterministic-mode`` needs in the environment: 0.18.2 asserts that
    ``NCCL_ALGO`` is set (and to an order-fixed algorithm), and TE's attention asserts
    ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``; 0.19.2 sets both itself when they are unset."""
    return dict(NCCL_ALGO="Ring", NVTE_ALLOW_NONDETERMINISTIC_ALGO="0") \
        if c["deterministic"] else {}


def parse_check(release_dir: str, c: dict[str, Any], timeout: float = 300.0,
                args: list[str] | None = None, env: dict[str, str] | None = None
                ) -> dict[str, Any]:
    """The case's command line (``args``, by default ``pretrain_args``) through the release's own
    ``parse_and_validate_args`` (CPU: the device architecture is given as Hopper's), with
    ``env`` added to the environment. Returns the parsed settings that the case sets."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [release_dir] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        WORLD_SIZE=str(c["dp"]), RANK="0", LOCAL_RANK="0", **determinism_env(c), **(env or {}))
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    argv = pretrain_args(c) if args is None else args
    p = subprocess.run([sys.executable, "-c", PARSE_CODE, json.dumps(argv)],
                       env=env, capture_output=True, text=True, timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("PARSED "):
            parsed: dict[str, Any] = json.loads(line[len("PARSED "):])
            return parsed
    raise RuntimeError(f"{c['id']}: the release refused the command line "
                       f"(exit {p.returncode}): {(p.stdout + p.stderr)[-3000:]}")

