#!/usr/bin/env python3
"""Megatron-LM's own training loop on one GPU: ``pretrain_gpt.py``, unchanged, with mock data.

Every run trains ``ITERS`` iterations of ``MICROBATCHES`` microbatches through
``megatron.training.pretrain`` (``forward_backward_no_pipelining``, ``finalize_model_grads``, the
distributed optimizer, gradient clipping) with ``--use-megatron-fsdp``, and is compared bit for
bit, iteration by iteration, with the same run serialized (``CUDA_LAUNCH_BLOCKING=1``): the
reported losses, the grad norm, the reduced gradient (every gradient buffer after the
iteration) and the updated parameters (every weight buffer).

``megatron/training`` comes from the megatron-core wheel; ``pretrain_gpt.py``,
``gpt_builders.py`` and ``model_provider.py`` from a Megatron-LM checkout given by
``--megatron-lm [RELEASE=]DIR`` whose ``megatron/training`` must be the wheel's, file for file
(``training_differences``; a checkout that differs is refused). The three scripts are copied
into the run's own folder and run from there, so the checkout's ``megatron/`` never shadows the
wheel. What the process needs around the script goes in through ``PYTHONPATH``
(``validation/mlm_inject/sitecustomize.py``): the fake group's NCCL semantics and the slow
reduce-scatter, the APEX stub, the shipped dataset helpers, and the capture.

Runs (``plan``), most important first:
* ``dp2``: data-parallel size 2 in one process, Megatron-LM's ``--fake-process-group`` with
  ``WORLD_SIZE=2`` and NCCL work semantics, a reduce-scatter delayed 0 and 20 ms; each
  configuration as shipped, with the hotfix (``mfsdp-hotfix run --``) and with
  ``--fsdp-double-buffer`` left out, each against its own serialized run; the audit route
  (``mfsdp-hotfix audit``) with and without ``MFSDP_HOTFIX=0`` beside ZeRO-3.
* ``dp1``: world size 1 with real NCCL through ``torchrun``, the plain user route, and the
  audit route on it. At a data-parallel size of 1 the gradient buffer is not distributed and
  ``fetch_bucket`` returns a view of it: no gradient-pool slot is ever taken, which the capture
  counts (``pool_allocations``); those runs are smoke tests.
* ``unit``: Megatron-LM's own Megatron-FSDP unit tests from the same checkout, through
  ``torchrun --nproc-per-node 1 -m pytest``, as shipped and with the hotfix.

    python3 validation/megatron_lm.py --megatron-lm core-0.19.2=ML19 \\
        --megatron-lm core-0.18.2=ML18 --out megatron-lm.json       # GPU
    python3 validation/megatron_lm.py --dry                          # the plan, no GPU
    python3 validation/megatron_lm.py --summary megatron-lm.json     # the summary rows
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if REPO not in sys.path:  # mfsdp_hotfix.selftest.processes, where the package is not installed
    sys.path.append(REPO)

import comparison  # noqa: E402  (no torch at import)
import mlm_verdict  # noqa: E402
import workdir  # noqa: E402
from mlm_probe import mfsdp_val_unit_probe  # noqa: E402

INJECT = os.path.join(HERE, "mlm_inject")
PROBE = os.path.join(HERE, "mlm_probe")  # the unit tests' pytest plugin
RELEASES = ("core-0.19.2", "core-0.18.2")
WHEELS = {"core-0.19.2": "megatron_core-0.19.2-*.whl", "core-0.18.2": "megatron_core-0.18.2-*.whl"}
# the Megatron-LM revision each wheel's megatron/training was found identical to (the check is
# by content, training_differences; these names are what the docs tell users to check out)
REVISIONS = {"core-0.19.2": "core_r0.19.0", "core-0.18.2": "core_v0.18.2"}
SCRIPTS = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")
UNIT_TESTS = {"core-0.19.2": "tests/unit_tests/distributed/mfsdp_v1",
              "core-0.18.2": "tests/unit_tests/distributed/megatron_fsdp"}
ZERO = {"optim_grads_params": 3, "optim_grads": 2, "optim": 1}
VARIANTS = ("shipped", "hotfix", "db-off")
AUDITS = ("audit-shipped", "audit-hotfix")  # audit route, with MFSDP_HOTFIX=0 / as installed
ITERS = 3
MICROBATCHES = 4
SIZE = dict(layers=4, hidden=512, heads=8, ffn=2048, seq=512, mbs=2, vocab=8192, experts=4,
            moe_ffn=1024)
DELAYS = (0.0, 20.0)
ROW_KEYS = ("id", "group", "release", "dp", "launcher", "zero", "dtype", "overlap_grad_reduce",
            "overlap_param_gather", "recompute", "moe", "variant", "delay_ms", "serialized",
            "outcome", "rel_l2", "max_abs", "first_bad_step", "iterations", "grad_pool",
            "grad_pool_allocations", "audit", "error")
OUTCOMES = ("exact", "float noise", "wrong", "crash", "refused", "unsupported", "ok",
            "ran, no truth", "not run")


# ------------------------------------------------------------------------- the checkout
def git_blob_sha1(path: str) -> str:
    """The file's git blob id, so a plain tree compares with ``git ls-tree`` output too."""
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tree_ids(root: str, sub: str = "megatron/training") -> dict[str, str]:
    out = {}
    base = os.path.join(root, sub)
    for folder, _, files in os.walk(base):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                out[os.path.relpath(path, root)] = git_blob_sha1(path)
    return out


def training_differences(checkout: str, release_dir: str) -> dict[str, Any]:
    """``megatron/training/**.py`` of a Megatron-LM checkout against the wheel's, by content."""
    mine, wheel = tree_ids(checkout), tree_ids(release_dir)
    return {"files": len(wheel),
            "differing": sorted(k for k in wheel if k in mine and mine[k] != wheel[k]),
            "only_in_wheel": sorted(set(wheel) - set(mine)),
            "only_in_checkout": sorted(set(mine) - set(wheel))}


def matches(diff: dict[str, Any]) -> bool:
    return bool(diff["files"]) and not (diff["differing"] or diff["only_in_wheel"]
                                        or diff["only_in_checkout"])


def missing_test_modules(root: str, folder: str) -> list[str]:
    """The ``tests.*`` modules that the unit tests in ``folder`` (and the ``conftest.py`` files
    above them) import, directly or through each other, and that ``root`` lacks: read from
    the files (``ast``), so a checkout given in part is refused before any GPU time is spent
    (pytest would stop loading the conftest)."""
    import ast

    def path_of(module: str) -> str | None:
        base = os.path.join(root, *module.split("."))
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
        return None

    todo = [os.path.join(dirpath, name)
            for dirpath, _, names in os.walk(os.path.join(root, folder)) for name in names
            if name.endswith(".py")]
    parts = folder.split("/")
    todo += [os.path.join(root, *parts[:i], "conftest.py") for i in range(len(parts) + 1)
             if os.path.isfile(os.path.join(root, *parts[:i], "conftest.py"))]
    seen, missing = set(todo), set()
    while todo:
        with open(todo.pop(), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and not node.level else [])
            for name in names:
                if name.split(".")[0] != "tests":
                    continue
                found = path_of(name)
                if found is None:
                    missing.add(name)
                elif found not in seen:
                    seen.add(found)
                    todo.append(found)
    return sorted(missing)


# ------------------------------------------------------------------------- the plan
def case(group: str, release: str, *, dp: int = 2, zero: int = 3, dtype: str = "fp32",
         ogr: bool = True, recompute: bool = False, moe: bool = False, variant: str = "shipped",
         delay_ms: float = 0.0, serialized: bool = False, impl: str = "te",
         fusion: bool | None = None, fsdp: bool = True, deterministic: bool = False
         ) -> dict[str, Any]:
    """``impl``: ``te`` (TE layers) or ``local`` (megatron-core's own layers; TE importable only
    with ``fusion``, ``needs_te``).
    ``fusion``: fused wgrad accumulation; by default on with TE layers (Megatron-LM's default)
    and off with local layers. ``fsdp=False``: Megatron's own ``DistributedDataParallel`` with
    the distributed optimizer instead of Megatron-FSDP (``zero`` is then 0). ``deterministic``:
    ``--deterministic-mode``."""
    zero = zero if fsdp else 0
    c = dict(group=group, release=release, dp=dp, launcher="fake" if dp == 2 else "torchrun",
             impl=impl, fsdp=fsdp, zero=zero, sharding={v: k for k, v in ZERO.items()}.get(zero),
             fusion=(impl == "te") if fusion is None else fusion, deterministic=deterministic,
             dtype=dtype, overlap_grad_reduce=ogr, overlap_param_gather=ogr,
             recompute=recompute, moe=moe, variant=variant,
             db=fsdp and variant != "db-off", delay_ms=0.0 if serialized else float(delay_ms),
             serialized=serialized, iterations=ITERS, microbatches=MICROBATCHES)
    c["config"] = config_key(c)
    c["id"] = f"{c['config']}|{variant}|" + ("serialized" if serialized else f"d{delay_ms:g}")
    return c


def config_key(c: dict[str, Any]) -> str:
    fusion_default = c["impl"] == "te"
    extra = [x for x, on in (("local", c["impl"] == "local"),
                             ("fused" if c["fusion"] else "unfused",
                              c["fusion"] != fusion_default),
                             ("recompute", c["recompute"]), ("moe", c["moe"]),
                             ("no-overlap", not c["overlap_grad_reduce"]),
                             ("det", c["deterministic"])) if on]
    layout = f"zero{c['zero']}" if c["fsdp"] else "ddp"
    return "|".join([c["release"], f"dp{c['dp']}", layout, c["dtype"]] + extra)


def truth_variant(c: dict[str, Any]) -> str:
    """Whose serialized run a case is compared with: its own variant's (the audit runs: the
    code they run, shipped or hotfix)."""
    return {"audit-shipped": "shipped", "audit-hotfix": "hotfix"}.get(c["variant"], c["variant"])


def configurations(release: str, dp: int, zero: int, dtype: str, ogr: bool = True,
                   recompute: bool = False, moe: bool = False, delays=DELAYS,
                   group: str = "dp2", variants=VARIANTS, impl: str = "te"
                   ) -> list[dict[str, Any]]:
    """One configuration: a serialized run per variant, then each variant at each delay."""
    kw = dict(dp=dp, zero=zero, dtype=dtype, ogr=ogr, recompute=recompute, moe=moe, impl=impl)
    out = [case(group, release, variant=v, serialized=True, **kw) for v in variants]
    out += [case(group, release, variant=v, delay_ms=d, **kw) for d in delays for v in variants]
    return out


GROUPS = ("local", "core", "dp1", "zero1", "unit", "extras")
MORE_GROUPS = ("core3", "core2", "local3", "local2", "dp1-local")  # halves, or without TE
# judged against a reference that is not the code under test (``reference_cases``)
REFERENCE_GROUPS = ("ddp", "ddp-local", "fused", "fused-local", "moe-ref")


def reference_cases(group: str, release: str) -> list[dict[str, Any]]:
    """The runs of a ``REFERENCE_GROUPS`` group, fp32 and ``--deterministic-mode``, each judged
    by ``mlm_verdict`` against its reference (``judge``: the reference's id; a reference is
    ``judged``; ``set``: the reference's id, which ``pipelined`` keeps together):

    * ``ddp`` (TE layers), ``ddp-local`` (local layers): world size 1 through ``torchrun`` and
      NCCL; the reference is ``DistributedDataParallel`` + the distributed optimizer with the
      wgrad apart (``--no-gradient-accumulation-fusion``: fusion in megatron-core's own linear
      needs APEX, which the machine lacks); judged are Megatron-FSDP ZeRO-1/2/3, fused wgrad
      accumulation on and off, as shipped and with the hotfix, by the reported losses and grad
      norm;
    * ``fused``, ``fused-local``: two data-parallel ranks through ``--fake-process-group``;
      each ZeRO level and variant fused against the same run unfused, by the reported values
      and the reduced gradient;
    * ``moe-ref``: a MoE model (expert-parallel size 1), ZeRO-3 with fused wgrad: at world size
      1 against DDP, and at two ranks fused against unfused.

    Expert-parallel size equal to the data-parallel size is not here: the fake group's
    all-to-all moves no tokens between its ranks."""
    impl = "local" if group.endswith("-local") else "te"
    moe = group == "moe-ref"
    zeros = (3,) if moe else (1, 2, 3)
    kw = dict(dtype="fp32", deterministic=True, impl=impl, moe=moe)
    out: list[dict[str, Any]] = []
    if group.startswith("ddp") or moe:
        ref = dict(case(group, release, dp=1, fsdp=False, fusion=False, **kw), judged=True)
        ref["set"] = ref["id"]
        out.append(ref)
        for fusion in (True,) if moe else (True, False):
            for zero in zeros:
                out += [dict(case(group, release, dp=1, zero=zero, fusion=fusion, variant=v,
                                  **kw), judge=ref["id"], set=ref["id"])
                        for v in ("shipped", "hotfix")]
    if group.startswith("fused") or moe:
        for zero in zeros:
            for v in ("shipped", "hotfix"):
                unfused = dict(case(group, release, zero=zero, fusion=False, variant=v, **kw),
                               judged=True)
                unfused["set"] = unfused["id"]
                out += [unfused, dict(case(group, release, zero=zero, fusion=True, variant=v,
                                           **kw), judge=unfused["id"], set=unfused["id"])]
    return out


def plan(releases=RELEASES, groups=GROUPS) -> list[dict[str, Any]]:
    """Every run, in the order of ``groups`` (a cut time budget drops the end of the list):
    ``local`` (``core`` without TE: megatron-core's own layers; runs while TE is being built),
    ``core`` (ZeRO-3 and ZeRO-2, fp32 and bf16, the audit route; the first release, then the
    others), ``dp1`` (world size one), ``zero1``, ``unit``, ``extras`` (fp8, recompute, MoE);
    and ``MORE_GROUPS``: ``core3``/``core2`` and ``local3``/``local2`` (one ZeRO level),
    ``dp1-local`` (world size one without TE). ``GROUP@RELEASE`` plans a group for one
    release."""
    out: list[dict[str, Any]] = []
    for spec in groups:
        group, _, only = spec.partition("@")  # GROUP@RELEASE: that release only
        if only and only not in releases:
            raise ValueError(f"{spec}: {only} is not among the releases {releases}")
        first, rest = (only, ()) if only else (releases[0], releases[1:])
        releases_here = (first,) + tuple(rest)
        if group in ("core", "core3", "core2", "local", "local3", "local2"):
            # core3/core2 (local3/local2): its ZeRO-3/ZeRO-2 half; local*: without TE
            zeros = {"": (3, 2), "3": (3,), "2": (2,)}[group[-1] if group[-1] in "23" else ""]
            impl = "local" if group.startswith("local") else "te"
            label = "local" if impl == "local" else "core"
            for rel in releases_here:
                for zero in zeros:
                    for dtype in ("fp32", "bf16"):
                        out.extend(configurations(rel, 2, zero, dtype, group=label, impl=impl))
                    # the audit route on the DP=2 job, at the delay that breaks the shipped
                    # code
                    out.extend(case(label, rel, zero=zero, variant=v, delay_ms=DELAYS[-1],
                                    impl=impl) for v in AUDITS)
        elif group in ("dp1", "dp1-local"):
            # world size 1, real NCCL: the plain route and the audit route (no fake group, no
            # delay); dp1-local: the same without TE
            impl = "local" if group == "dp1-local" else "te"
            out.extend(configurations(first, 1, 3, "fp32", delays=(0.0,), group="dp1",
                                      variants=("shipped", "hotfix"), impl=impl))
            out.extend(case("dp1", first, dp=1, variant=v, impl=impl) for v in AUDITS)
        elif group == "zero1":
            for rel in releases_here:
                for ogr in (True, False):
                    out.extend(configurations(rel, 2, 1, "fp32", ogr=ogr, group="zero1"))
        elif group in REFERENCE_GROUPS:
            for rel in releases_here:
                out.extend(reference_cases(group, rel))
        elif group == "unit":
            for rel in releases_here:
                out.extend(dict(group="unit", release=rel, variant=v, impl="te",
                                id=f"{rel}|unit-tests|{v}", serialized=False)
                           for v in ("shipped", "hotfix"))
        elif group == "extras":
            for rel in releases_here:
                out.extend(configurations(rel, 2, 3, "fp8", group="extras"))
                out.extend(configurations(rel, 2, 3, "bf16", recompute=True, group="extras"))
                out.extend(configurations(rel, 2, 3, "bf16", moe=True, group="extras"))
        else:
            raise ValueError(f"unknown group {group!r} (known: "
                             f"{', '.join(GROUPS + MORE_GROUPS + REFERENCE_GROUPS)})")
    ids = [c["id"] for c in out]
    assert len(ids) == len(set(ids)), "a case is planned twice"
    return out


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
        "deterministic_mode", "transformer_impl", "cross_entropy_loss_fusion")
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


def parse_check(release_dir: str, c: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """The case's command line through the release's own ``parse_and_validate_args`` (CPU: the
    device architecture is given as Hopper's). Returns the parsed settings that the case sets."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [release_dir] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        WORLD_SIZE=str(c["dp"]), RANK="0", LOCAL_RANK="0", **determinism_env(c))
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    p = subprocess.run([sys.executable, "-c", PARSE_CODE, json.dumps(pretrain_args(c))],
                       env=env, capture_output=True, text=True, timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("PARSED "):
            parsed: dict[str, Any] = json.loads(line[len("PARSED "):])
            return parsed
    raise RuntimeError(f"{c['id']}: the release refused the command line "
                       f"(exit {p.returncode}): {(p.stdout + p.stderr)[-3000:]}")


# ------------------------------------------------------------------------- one run
class Paths:
    """Where the release, the scripts and this run's folders are."""

    def __init__(self, rel_dirs: dict[str, str], src_dirs: dict[str, str],
                 unit_tests_missing: dict[str, list[str]] | None = None) -> None:
        self.rel = rel_dirs
        self.src = src_dirs
        self.unit_tests_missing = unit_tests_missing or {}


def stage_sources(checkouts: dict[str, str], rel_dirs: dict[str, str]) -> tuple[dict, dict]:
    """Per release: check the checkout against the wheel, copy its root's modules, its pytest
    options and its ``tests/`` into this run's folder. Returns (src dirs, checks)."""
    src, checks = {}, {}
    for rel, checkout in checkouts.items():
        if rel not in rel_dirs:
            continue
        diff = training_differences(checkout, rel_dirs[rel])
        # named as the command line names it: a record holds no path of the machine it ran on
        checks[rel] = dict(diff, checkout=checkout, matches=matches(diff),
                           missing_scripts=[n for n in SCRIPTS
                                            if not os.path.isfile(os.path.join(checkout, n))])
        if not matches(diff) or checks[rel]["missing_scripts"]:
            continue
        dest = os.path.join(workdir.run_dir(), "src", rel)
        os.makedirs(dest)
        # every module at the root: SCRIPTS, and those the unit tests import besides (0.19's
        # import hybrid_builders); pyproject.toml holds Megatron-LM's pytest options
        for name in sorted(os.listdir(checkout)):
            if (name.endswith(".py") or name == "pyproject.toml") and \
                    os.path.isfile(os.path.join(checkout, name)):
                shutil.copy2(os.path.join(checkout, name), dest)
        tests = os.path.join(checkout, "tests")
        if os.path.isdir(tests):
            shutil.copytree(tests, os.path.join(dest, "tests"))
        checks[rel]["unit_tests_missing"] = missing_test_modules(dest, UNIT_TESTS[rel])
        src[rel] = dest
    return src, checks


def command(c: dict[str, Any], paths: Paths, folder: str, cycles_per_ms: float
            ) -> tuple[list[str], dict[str, str]]:
    """The exact command line and environment of a case."""
    py = sys.executable
    script = os.path.join(paths.src[c["release"]], "pretrain_gpt.py")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    env["PYTHONPATH"] = os.pathsep.join(
        [INJECT, paths.rel[c["release"]], REPO] + te_paths(c, env))
    env.update(CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               MFSDP_VAL_MLM_CAPTURE=folder)
    # NVTE_*_ATTN: --attention-backend sets them; GPTModel refuses values set beside it
    for k in ("MFSDP_HOTFIX", "MFSDP_HOTFIX_AUDIT", "CUDA_LAUNCH_BLOCKING", "NVTE_FLASH_ATTN",
              "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        env.pop(k, None)
    if c["serialized"]:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    env.update(determinism_env(c))
    if c["launcher"] == "fake":
        # FakeStore has neither set nor get: the hotfix's cross-rank check cannot run there
        env.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), MFSDP_VAL_MLM_FAKE_NCCL="1",
                   MFSDP_HOTFIX_CROSS_RANK_CHECK="off",
                   MFSDP_VAL_MLM_RS_DELAY_CYCLES=str(int(round(c["delay_ms"] * cycles_per_ms))))
        job = [py, script]
    else:
        job = torchrun() + ["--nproc-per-node", "1", "--master-port", str(free_port()), script]
    job += pretrain_args(c)
    hotfix_cli = [py, "-m", "mfsdp_hotfix"]
    if c["variant"] == "hotfix":
        job = hotfix_cli + ["run", "--"] + job
    elif c["variant"] in AUDITS:
        if c["variant"] == "audit-shipped":
            env["MFSDP_HOTFIX"] = "0"
        job = hotfix_cli + ["audit", "--out", os.path.join(folder, "audit", "run"), "--"] + job
    return job, env


def needs_te(c: dict[str, Any]) -> bool:
    """TE layers, or fused wgrad accumulation with any layers: Megatron-FSDP asserts
    TransformerEngine 2.10 or later for ``gradient_accumulation_fusion`` (megatron-core's own
    linear then takes TE's ``general_gemm`` for the wgrad), so a local-layer run with fusion
    has TE importable, as a user's job with TE installed has."""
    return bool(c.get("impl", "te") == "te" or c.get("fusion"))


def te_paths(c: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The ``PYTHONPATH`` tail of a case; a TE case also gets what TE's setup exported (its
    site folder, library path), when TE was set up by ``megatron_lm_call.sh``."""
    import engine

    tail = [p for p in [env.get("PYTHONPATH")] if p]
    if not needs_te(c):
        return tail
    te = engine.te_env()
    if te.get("LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = te["LD_LIBRARY_PATH"]
    return [p for p in [te.get("PYTHONPATH")] if p] + tail


def torchrun() -> list[str]:
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ERROR_LINE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?([A-Za-z_.]*(?:Error|Exception|Exit))(?::\s*(.*))?$")
AUDIT_LINE = re.compile(r"^audit: ([A-Z ]+|ordered):")


def last_error(log: str) -> str | None:
    """The last ``SomeError: message`` line of a log (the exception that ended the run)."""
    found = None
    for line in log.splitlines():
        m = ERROR_LINE.match(line)
        if m:
            found = f"{m.group(1)}: {(m.group(2) or '').strip()}"[:600]
    return found


def audit_verdict(log: str) -> str | None:
    for line in reversed(log.splitlines()):
        m = AUDIT_LINE.match(line.strip())
        if m:
            return m.group(1).strip()
    return None


def classify(rc: Any, capture: dict[str, Any] | None, iterations: int, error: str | None,
             comparison_outcome: str | None) -> str:
    """exact | wrong (compared with the serialized run) | float noise (with a reference,
    ``mlm_verdict``) | ok (ran, nothing to compare with) | refused (by the hotfix, before its
    first iteration) | unsupported (refused before its first iteration by a check of the
    release) | crash."""
    stages = (capture or {}).get("stages", [])
    done = (capture or {}).get("iterations", 0)
    if rc == 0 and done == iterations:
        return comparison_outcome or "ok"
    if "training" not in stages and (error or "").startswith("UnsupportedConfiguration"):
        return "refused"  # by the hotfix, before training, naming the workaround
    refused = any(e in (error or "") for e in ("AssertionError", "ValueError",
                                                  "NotImplementedError"))
    if "training" not in stages and refused:
        return "unsupported"
    return "crash"


def run_case(c: dict[str, Any], paths: Paths, cycles_per_ms: float, timeout: float
             ) -> dict[str, Any]:
    folder = os.path.join(workdir.run_dir(), "cases", c["id"].replace("|", "_"))
    os.makedirs(folder)
    argv, env = command(c, paths, folder, cycles_per_ms)
    t0 = time.time()
    rc, log = _run(argv, env, folder, timeout)
    rec = dict(c, argv=argv, rc=rc, proc_s=round(time.time() - t0, 1))
    cap_json = os.path.join(folder, "capture.json")
    capture = None
    if os.path.exists(cap_json):
        with open(cap_json) as f:
            capture = json.load(f)
    rec["capture"] = capture
    rec["error"] = ((capture or {}).get("error") or {}).get("type")
    if rec["error"]:
        rec["error"] += ": " + capture["error"]["message"][:600]
    elif rc != 0 and not (c["variant"] in AUDITS and "(command exit status 0)" in log):
        rec["error"] = last_error(log) or f"exit status {rc}"
    if c["variant"] in AUDITS:
        # `mfsdp-hotfix audit` exits with its verdict's status when the command succeeded; the
        # training's own exit status is in its last line
        status = re.findall(r"\(command exit status (-?\d+)\)", log)
        rec["command_rc"] = int(status[-1]) if status else None
        rec["audit"] = audit_verdict(log)
        rec["audit_lines"] = [ln for ln in log.splitlines()
                              if "audit" in ln and ("unordered" in ln or ln.startswith("audit:"))][-6:]
    pt = os.path.join(folder, "capture.pt")
    outcome_cmp = None
    if os.path.exists(pt):
        if c.get("truth"):
            import torch

            if not os.path.exists(c["truth"]):
                rec["no_truth"] = ("its reference" if c.get("judge") else "its serialized run") \
                    + " left no capture"
            elif c.get("judge"):
                # against a reference that is not the code under test: the buffers too where
                # both sides have the same Megatron-FSDP layout (fused against unfused)
                rec["verdict"] = mlm_verdict.judge(torch.load(pt), torch.load(c["truth"]),
                                                   buffers=c["dp"] == 2)
                outcome_cmp = rec["verdict"]["verdict"]
            else:
                cmp = comparison.compare(torch.load(pt), torch.load(c["truth"])).to_dict()
                rec["comparison"] = cmp
                outcome_cmp = cmp["outcome"]
        if c.get("judge") or c.get("judged"):
            import torch

            rec["reported"] = reported_values(torch.load(pt))
        if c.get("serialized") or c.get("judged"):
            rec["capture_file"] = pt  # a truth: kept for the runs compared with it
        else:
            # compared: the buffers of every iteration are half a gigabyte a run, and a whole
            # matrix of them would fill the machine's disk
            os.remove(pt)
    rec["outcome"] = classify(rec.get("command_rc", rc), capture, c["iterations"], rec["error"],
                              outcome_cmp)
    if (capture or {}).get("capture_errors"):
        rec["outcome"] = "crash"
        rec["error"] = "harness: capture failed: " + capture["capture_errors"][0]
    loaded = (capture or {}).get("hotfix_loaded")
    if loaded is not None and loaded != (c["variant"] in ("hotfix",) + AUDITS):
        # the run is not what its label says: never report it as a result
        rec["outcome"] = "crash"
        rec["error"] = f"harness: hotfix loaded={loaded} in a {c['variant']} run"
    if rec["outcome"] == "ok" and c.get("truth"):
        rec["outcome"] = "ran, no truth"
    if rec["outcome"] not in ("exact", "ok"):
        rec["log_tail"] = log[-5000:]
    rec["log_head_versions"] = [ln for ln in log.splitlines()[:400]
                                if "version" in ln.lower() and ">" in ln][:4]
    return rec


def reported_values(steps: list[dict[str, Any]]) -> dict[str, list[float]]:
    """What Megatron reported each iteration (losses, grad norm), from a capture."""
    names = list(dict.fromkeys(k for step in steps for k in step
                               if k.startswith("loss/") or k == "grad_norm"))
    return {name: [mlm_verdict.reported(step[name]) if name in step else None
                   for step in steps] for name in names}


def unit_test_command(c: dict[str, Any], paths: Paths, *pytest_args: str
                      ) -> tuple[list[str], dict[str, str]]:
    """The unit tests' command line (through ``mfsdp_hotfix run`` for the hotfix) and
    environment; collecting them and running them differ only in ``pytest_args`` (the last
    ones: what to run, the release's folder unless given)."""
    if not any(not a.startswith("-") for a in pytest_args):
        pytest_args += (UNIT_TESTS[c["release"]],)
    argv = torchrun() + ["--nproc-per-node", "1", "--master-port", str(free_port()), "-m",
                         "pytest", "-p", "no:cacheprovider", "-p", "mfsdp_val_unit_probe",
                         *pytest_args]
    if c["variant"] == "hotfix":
        argv = [sys.executable, "-m", "mfsdp_hotfix", "run", "--"] + argv
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_MAX_CONNECTIONS",
                                                             "MFSDP_HOTFIX")}
    env["PYTHONPATH"] = os.pathsep.join([paths.src[c["release"]], paths.rel[c["release"]],
                                         REPO, PROBE] + te_paths(c, env))
    env["PYTHONUNBUFFERED"] = "1"
    return argv, env


COLLECTED_LINE = re.compile(r"^(tests/\S+\.py::\S+)$")
PYTEST_E_LINE = re.compile(r"^E\s+(\w+(?:Error|Exception)\b.*)$")


def collect_unit_tests(c: dict[str, Any], paths: Paths, timeout: float) -> dict[str, Any]:
    """``pytest --collect-only`` in the very environment the tests will run in: seconds, where a
    module the environment lacks (a file of the checkout left behind, a package the machine does
    not have) would otherwise cost a whole run that tests nothing. Returns the test ids, the
    probe's word on the hotfix, and the errors: where pytest could not import a module, and a
    run whose hotfix is loaded where it must not be, or not where it must."""
    argv, env = unit_test_command(c, paths, "--collect-only", "-q")
    rc, log = _run(argv, env, paths.src[c["release"]], timeout)
    ids = [m.group(1) for m in map(COLLECTED_LINE.match, log.splitlines()) if m]
    errors = list(dict.fromkeys(m.group(1).strip()[:300]
                                for m in map(PYTEST_E_LINE.match, log.splitlines()) if m))
    if rc != 0 and not errors:
        errors = [last_error(log) or f"exit status {rc}"]
    probe = unit_probe(log)
    if not errors and (probe or {}).get("loaded") != (c["variant"] == "hotfix"):
        errors = [f"harness: the hotfix loaded={(probe or {}).get('loaded')} in the "
                  f"{c['variant']} unit tests' process"]
    return {"ids": ids, "errors": errors, "hotfix": probe}


def unit_probe(log: str) -> dict[str, Any] | None:
    """The last line ``mfsdp_val_unit_probe`` printed (None: the plugin never ran)."""
    found = None
    for line in log.splitlines():
        if line.startswith(mfsdp_val_unit_probe.MARK):
            found = json.loads(line[len(mfsdp_val_unit_probe.MARK):])
    return found


def run_unit_tests(c: dict[str, Any], paths: Paths, timeout: float,
                   collected: list[str]) -> dict[str, Any]:
    """Megatron-LM's Megatron-FSDP unit tests on one GPU, as shipped or with the hotfix: each
    test file in its own ``torchrun`` (a fresh process, as when a user runs one file), the files
    side by side, each with its own temporary folder. Each test's end is read from pytest's
    reports as they come (``unit_test_ends``), so a file cut by the time budget keeps the tests
    it finished (and the run says it was cut)."""
    files = list(dict.fromkeys(test.split("::")[0] for test in collected))
    folder = os.path.join(workdir.run_dir(), "cases", c["id"].replace("|", "_"))

    def one_file(path: str) -> dict[str, Any]:
        argv, env = unit_test_command(c, paths, "-v", path)
        mine = os.path.join(folder, os.path.basename(path))
        env.update(TMPDIR=os.path.join(mine, "tmp"),
                   MFSDP_VAL_UNIT_ENDS=os.path.join(mine, "ends.jsonl"))
        os.makedirs(env["TMPDIR"])
        t0 = time.time()
        rc, log = _run(argv, env, paths.src[c["release"]], timeout)
        with open(os.path.join(mine, "output.txt"), "w") as f:
            f.write(log)
        return dict(file=path, argv=argv, rc=rc, proc_s=round(time.time() - t0, 1),
                    tests=unit_test_ends(env["MFSDP_VAL_UNIT_ENDS"]), hotfix=unit_probe(log),
                    log=log)

    with cf.ThreadPoolExecutor(len(files)) as ex:
        runs = list(ex.map(one_file, files))
    tests = {t: end for r in runs for t, end in r["tests"].items()}
    cut = [r["file"] for r in runs if r["rc"] == "timeout"]
    rec = dict(c, tests=tests, collected=len(collected), cut=bool(cut),
               hotfix=next((r["hotfix"] for r in runs if r["hotfix"]), None),
               files={r["file"]: {k: r[k] for k in ("argv", "rc", "proc_s")} | {
                   "tests": len(r["tests"])} for r in runs})
    # a file cut by the limit keeps what it finished; the table lists the tests it did not end
    rec["outcome"] = "ok" if tests else "not run" if cut else "crash"
    if cut:
        rec["error"] = f"cut after {timeout:.0f} s, {len(tests)} tests ended: {', '.join(cut)}"
    elif not tests:
        rec["error"] = "; ".join(dict.fromkeys(last_error(r["log"]) or f"exit status {r['rc']}"
                                               for r in runs))
    # pytest's own exits: 0 all passed, 1 some failed; else, or nothing ended, the end is told
    rec["log_tail"] = "".join(r["log"][-2500:] for r in runs
                              if r["rc"] not in (0, 1) or not r["tests"])
    return rec


def _run(argv: list[str], env: dict[str, str], cwd: str, timeout: float) -> tuple[Any, str]:
    """(exit status or "timeout", the output so far, stdout and stderr as they came). A run past
    ``timeout`` is killed with every process under it (``torchrun``'s workers, in sessions of
    their own, would hold the GPU, and the output's pipe, past the kill)."""
    with subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace") as p:
        try:
            out = p.communicate(timeout=timeout)[0]
            return p.returncode, out
        except subprocess.TimeoutExpired:
            from mfsdp_hotfix.selftest.processes import kill_tree

            kill_tree(p.pid)
            return "timeout", p.communicate()[0]


def unit_test_ends(path: str) -> dict[str, str]:
    """test id -> passed | failed: message | error: message | skipped: reason | xfail | xpass,
    from the lines ``mfsdp_val_unit_probe`` wrote (a test reported twice, e.g. passed then
    errored in teardown, keeps the worse)."""
    out: dict[str, str] = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break  # the line a killed run was writing
            end = json.loads(line)
            if out.get(end["id"], "").split(":")[0] not in ("failed", "error"):
                out[end["id"]] = end["end"]
    return out


# ------------------------------------------------------------------------- the driver
def pipelined(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The plan's order, but each set's truths (a configuration's serialized runs, or the
    reference of a ``set``) go one set ahead of its other runs (a run waiting for its truth
    holds a worker; a cut budget still leaves whole sets)."""
    def key(c: dict[str, Any]) -> str:
        return str(c.get("set") or c.get("config", c["id"]))

    def truth(c: dict[str, Any]) -> bool:
        return bool(c.get("serialized") or c.get("judged"))

    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # the runs of the set whose truths were queued
    current = None
    for c in cases:
        if key(c) != current:
            current = key(c)
            if truth(c):
                out += [x for x in cases if key(x) == current and truth(x)]
            out += pending
            pending = []
        if not truth(c) or c.get("config") is None:
            if c.get("config") is None or any(key(x) == current and truth(x) for x in cases):
                pending.append(c)
            else:
                out.append(c)
    out += pending
    assert sorted(x["id"] for x in out) == sorted(x["id"] for x in cases)
    return out


def te_last(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """While TE is being built, the runs that need it (and those judged by one that needs it)
    after those that do not, each part in its order: a run waiting for TE holds a worker that a
    run without TE could use. A truth stays before the runs compared with it."""
    by_id = {c["id"]: c for c in cases}

    def waits(c: dict[str, Any]) -> bool:
        return needs_te(c) or (bool(c.get("judge")) and needs_te(by_id.get(c["judge"], c)))

    return sorted(cases, key=waits)


FAIL_FAST = 8
COLLECT_TIMEOUT = 180.0  # importing megatron and TE, nothing run
MIN_START_S = 45  # a run started with less of the budget left would be cut
MIN_FREE_DISK = 8 * 2**30  # a run's capture is about half a gigabyte; truths are kept


class Driver:
    def __init__(self, paths: Paths, cycles_per_ms: float, deadline: float, workers: int,
                 case_timeout: float, unit_timeout: float) -> None:
        self.paths = paths
        self.cpm = cycles_per_ms
        self.deadline = deadline
        self.workers = workers
        self.case_timeout = case_timeout
        self.unit_timeout = unit_timeout
        self.truths: dict[str, cf.Future] = {}
        # runs without TE while TE is being built: a few, so that the build keeps its cores
        self.no_te_slots = threading.BoundedSemaphore(max(1, min(workers, 6)))
        self.lock = threading.Lock()
        self.trained: dict[str, list[bool]] = {}  # per route (impl): did each run train?
        self.stopped: dict[str, str] = {}  # route -> why its remaining runs are not started

    def one(self, c: dict[str, Any]) -> dict[str, Any]:
        route = c.get("impl", "te")
        if route in self.stopped:
            return dict(c, outcome="not run", error=self.stopped[route])
        r = self._one(c)
        if c["group"] != "unit" and r["outcome"] != "not run":
            self._count(route, r)
        return r

    def _count(self, route: str, r: dict[str, Any]) -> None:
        """The first ``FAIL_FAST`` runs of a route all stopped before training: an error of the
        harness (or of the machine) is likelier than of the release, and the device time is
        better kept for a fixed harness: the route's remaining runs are not started."""
        with self.lock:
            seen = self.trained.setdefault(route, [])
            seen.append(bool((r.get("capture") or {}).get("iterations")))
            if len(seen) == FAIL_FAST and not any(seen):
                self.stopped[route] = (f"not started: the first {FAIL_FAST} runs of this route "
                                       f"stopped before their first iteration (last: "
                                       f"{str(r.get('error'))[:200]})")

    def _one(self, c: dict[str, Any]) -> dict[str, Any]:
        if c["release"] not in self.paths.src:
            return dict(c, outcome="not run", error="no checkout of this release: none given, "
                        "its megatron/training is not the wheel's, or it lacks "
                        + ", ".join(SCRIPTS) + " (the record's checkouts say which)")
        if c.get("truth_of") in self.truths:
            if self.truths[c["truth_of"]].result()["outcome"] == "not run":
                return dict(c, outcome="not run", error="its serialized run was not run")
        if needs_te(c):
            import engine

            while engine.te_state() == "building" and time.time() < self.deadline - 30:
                time.sleep(2)
            if engine.te_state() == "failed":
                return dict(c, outcome="not run", error="TransformerEngine's setup failed")
        if c["group"] == "unit":
            left = self.deadline - time.time()
            if left < MIN_START_S:
                return dict(c, outcome="not run", error="time budget exhausted")
            missing = self.paths.unit_tests_missing.get(c["release"])
            if missing:
                return dict(c, outcome="not run", error="the checkout lacks modules the unit "
                            "tests import: " + ", ".join(missing))
            collected = collect_unit_tests(c, self.paths, min(COLLECT_TIMEOUT, left))
            if collected["errors"] or not collected["ids"]:
                # pytest runs no test where one module fails to import
                return dict(c, outcome="not run", hotfix=collected["hotfix"],
                            error="collecting the unit tests failed: "
                            + ("; ".join(collected["errors"]) or "none found"))
            left = self.deadline - time.time()
            return run_unit_tests(c, self.paths, min(self.unit_timeout, left), collected["ids"])
        if not needs_te(c) and self.te_building():
            with self.no_te_slots:  # bounded() reads the budget left after the wait
                return self.bounded(c)
        return self.bounded(c)

    def bounded(self, c: dict[str, Any]) -> dict[str, Any]:
        """A run under the case timeout or what is left of the budget; one that the budget cut
        is ``not run`` (a later call runs it), one that outlasted the case timeout a crash."""
        left = self.deadline - time.time()
        if left < MIN_START_S:
            return dict(c, outcome="not run", error="time budget exhausted")
        free = shutil.disk_usage(workdir.run_dir()).free
        if free < MIN_FREE_DISK:
            return dict(c, outcome="not run", error=f"only {free / 2**30:.1f} GiB of disk left")
        r = run_case(c, self.paths, self.cpm, min(self.case_timeout, left))
        if r.get("rc") == "timeout":
            if left < self.case_timeout:
                r.update(outcome="not run", error=f"cut by the time budget after {left:.0f} s")
            else:
                r.update(outcome="crash", error=f"no end within {self.case_timeout:.0f} s")
        return r

    @staticmethod
    def te_building() -> bool:
        import engine

        return bool(engine.te_state() == "building")

    def run_all(self, cases: list[dict[str, Any]], log=print,
                progress=None) -> list[dict[str, Any]]:
        cases = te_last(pipelined(cases)) if self.te_building() else pipelined(cases)
        truths = {}
        for c in cases:
            if c["group"] == "unit" or c.get("judged"):
                continue
            if c.get("judge"):  # judged against its reference (mlm_verdict), not a serialized run
                c["truth"] = os.path.join(workdir.run_dir(), "cases",
                                          c["judge"].replace("|", "_"), "capture.pt")
                c["truth_of"] = c["judge"]
                continue
            key = f"{c['config']}|{truth_variant(c)}"
            if c["serialized"]:
                truths[key] = os.path.join(workdir.run_dir(), "cases",
                                           c["id"].replace("|", "_"), "capture.pt")
            else:
                c["truth"], c["truth_of"] = truths.get(key), key
        out = []
        with cf.ThreadPoolExecutor(self.workers) as ex:
            futures = []
            for c in cases:
                f = ex.submit(self.one, c)
                futures.append(f)
                if c.get("judged"):
                    self.truths[c["id"]] = f
                elif c.get("serialized") and c["group"] != "unit":
                    self.truths[f"{c['config']}|{truth_variant(c)}"] = f
            for f in cf.as_completed(futures):
                r = f.result()
                out.append(r)
                log(short(r))
                if progress is not None:
                    progress(out)
        order = {c["id"]: i for i, c in enumerate(cases)}
        return sorted(out, key=lambda r: order[r["id"]])


def serialized_pairs(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration, the serialized runs of the hotfix and of the double buffer off against
    the serialized run as shipped: the hotfix changes no arithmetic of the double buffer, so at
    ZeRO-2/3 they are bit-identical (where a release defect outside the double buffer is repaired,
    e.g. ZeRO-1's lost microbatches, the hotfix's run differs from the shipped one)."""
    import torch

    truth = {(r["config"], r["variant"]): r.get("capture_file") for r in results
             if r.get("serialized") and r["group"] != "unit"}
    out = {}
    for (config, variant), path in sorted(truth.items()):
        shipped = truth.get((config, "shipped"))
        if variant == "shipped" or not (path and shipped):
            continue
        cmp = comparison.compare(torch.load(path), torch.load(shipped)).to_dict()
        out[f"{config}|{variant}"] = {k: cmp[k] for k in (
            "outcome", "rel_l2", "max_abs_diff", "first_bad_step", "differing")}
    return out


def short(r: dict[str, Any]) -> str:
    cmp = r.get("comparison") or {}
    extra = f" rel_l2={cmp.get('rel_l2')}" if cmp else ""
    if r.get("audit"):
        extra += f" audit={r['audit']}"
    if r.get("tests"):
        counts: dict[str, int] = {}
        for state in r["tests"].values():
            counts[state.split(":")[0]] = counts.get(state.split(":")[0], 0) + 1
        extra += f" tests={counts}"
    err = "" if r.get("outcome") in ("exact", "ok") else f" {str(r.get('error'))[:200]}"
    return f"{r.get('outcome', '?'):12s} {r['id']}{extra} ({r.get('proc_s', '-')} s){err}"


def row(r: dict[str, Any]) -> dict[str, Any]:
    """One summary row (``ROW_KEYS``) of a run's record."""
    cmp = r.get("comparison") or {}
    cap = r.get("capture") or {}
    pools = cap.get("pool_allocations") or {}
    grad_pools = [v for k, v in pools.items() if k.endswith("main_grad_alloc")]
    unit = r["group"] == "unit"
    return {"id": r["id"], "group": r["group"], "release": r["release"],
            "dp": None if unit else r["dp"], "launcher": None if unit else r["launcher"],
            "zero": None if unit else r["zero"], "dtype": None if unit else r["dtype"],
            "overlap_grad_reduce": None if unit else r["overlap_grad_reduce"],
            "overlap_param_gather": None if unit else r["overlap_param_gather"],
            "recompute": None if unit else r["recompute"], "moe": None if unit else r["moe"],
            "variant": r["variant"], "delay_ms": None if unit else r["delay_ms"],
            "serialized": r["serialized"], "outcome": r["outcome"],
            "rel_l2": cmp.get("rel_l2"), "max_abs": cmp.get("max_abs_diff"),
            "first_bad_step": cmp.get("first_bad_step"),
            "iterations": None if unit else cap.get("iterations", 0),
            # no gradient pool built (the release's own choice: no FSDP unit) is not the same as
            # a pool that never handed a slot out (one data-parallel rank)
            "grad_pool": None if unit or not pools else
            (grad_pools[0]["class"] if grad_pools else "none built"),
            "grad_pool_allocations": None if unit or not grad_pools else
            sum(v["calls"] for v in grad_pools),
            "audit": r.get("audit"),
            "error": None if r["outcome"] in ("exact", "ok") else (r.get("error") or "")[:300]}


def unit_test_table(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per release: each test's end as shipped and with the hotfix, the tests whose ends differ
    (of those that ended in both runs), those that ended in one run only (one run was cut, or
    its process died), which run was cut, and what the probe saw of the hotfix in each run's
    process."""
    out: dict[str, Any] = {}
    for r in results:
        if r["group"] != "unit" or not r.get("tests"):
            continue
        out.setdefault(r["release"], {})[r["variant"]] = r["tests"]
        out[r["release"]].setdefault("probe", {})[r["variant"]] = r.get("hotfix")
        out[r["release"]].setdefault("cut", {})[r["variant"]] = r.get("error") if r.get(
            "cut") else None
        out[r["release"]].setdefault("collected", {})[r["variant"]] = r.get("collected")
    for both in out.values():
        s, h = both.get("shipped") or {}, both.get("hotfix") or {}
        both["differ"] = sorted(t for t in set(s) & set(h)
                                if s[t].split(":")[0] != h[t].split(":")[0])
        both["one_run_only"] = sorted(set(s) ^ set(h))
    return out


def summary(report: dict[str, Any]) -> dict[str, Any]:
    results = report["results"]
    checkouts = {rel: {k: v for k, v in check.items() if k != "checkout"}  # no machine paths
                 for rel, check in (report.get("checkouts") or {}).items()}
    return {"gpu": report.get("env", {}).get("gpu"), "torch": report.get("env", {}).get("torch"),
            "te": te_versions(results), "checkouts": checkouts,
            "iterations": ITERS, "microbatches": MICROBATCHES, "size": SIZE,
            "rows": [row(r) for r in results], "unit_tests": unit_test_table(results),
            "serialized_vs_shipped": report.get("serialized_vs_shipped"),
            "replaced": report.get("replaced", [])}


REFERENCE_ROW_KEYS = ("id", "group", "release", "dp", "layers", "layout", "fusion", "moe",
                      "variant", "reference", "outcome", "iterations", "loss", "grad_norm",
                      "reference_loss", "reference_grad_norm", "grad_rel_l2", "max_rel", "worst",
                      "first_off", "status", "protected", "error")
LOSS = "loss/lm loss"


def reference_row(r: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One summary row (``REFERENCE_ROW_KEYS``) of a run of ``REFERENCE_GROUPS``: what it and
    its reference reported each iteration, and the verdict (``mlm_verdict``)."""
    verdict = r.get("verdict") or {}
    mine = r.get("reported") or {}
    # the reference's values as the verdict read them (its own call's reference), else as the
    # summary's reference run reported them
    theirs = {name: [it.get(name, [None, None])[1] for it in verdict["iterations"]]
              for name in (LOSS, "grad_norm")} if verdict.get("iterations") else \
        by_id.get(r.get("judge") or "", {}).get("reported") or {}
    cap = r.get("capture") or {}
    said = cap.get("hotfix_status") if isinstance(cap.get("hotfix_status"), dict) else {}
    status = (said.get("verdict") or {}) if said else {}
    outcome = r["outcome"]
    if outcome == "ran, no truth":
        outcome = "no reference"
    return {"id": r["id"], "group": r["group"], "release": r["release"], "dp": r["dp"],
            "layers": "local" if r["impl"] == "local" else "TE",
            "layout": f"ZeRO-{r['zero']}" if r["fsdp"] else "DDP", "fusion": r["fusion"],
            "moe": r["moe"], "variant": r["variant"], "reference": r.get("judge"),
            "outcome": outcome, "iterations": cap.get("iterations", 0),
            "loss": mine.get(LOSS), "grad_norm": mine.get("grad_norm"),
            "reference_loss": theirs.get(LOSS), "reference_grad_norm": theirs.get("grad_norm"),
            "grad_rel_l2": [it.get("grad_rel_l2") for it in verdict["iterations"]]
            if verdict and r["dp"] == 2 else None,
            "max_rel": verdict.get("max_rel"), "worst": verdict.get("worst"),
            "first_off": verdict.get("first_off"),
            "status": status.get("line"), "protected": status.get("protected"),
            "error": None if outcome in mlm_verdict.VERDICTS + ("ok",) else
            (r.get("error") or r.get("no_truth") or "")[:300]}


def reference_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The summary of the ``REFERENCE_GROUPS`` runs of a record (``--reference-summary``)."""
    results = [r for r in report["results"] if r.get("group") in REFERENCE_GROUPS]
    by_id = {r["id"]: r for r in results}
    return {"gpu": report.get("env", {}).get("gpu"), "torch": report.get("env", {}).get("torch"),
            "te": te_versions(results), "iterations": ITERS, "microbatches": MICROBATCHES,
            "size": SIZE, "float_noise": mlm_verdict.FLOAT_NOISE,
            "checkouts": {rel: {k: v for k, v in check.items() if k != "checkout"}
                          for rel, check in (report.get("checkouts") or {}).items()},
            "rows": [reference_row(r, by_id) for r in results],
            "replaced": report.get("replaced", [])}


def _values(xs: list[float | None] | None) -> str:
    return " / ".join("–" if x is None else f"{x:.4g}" for x in xs) if xs else "–"


def _verdict_cell(r: dict[str, Any]) -> str:
    o = r["outcome"]
    if o in ("wrong", "float noise"):
        return f"{o} ({r['max_rel']:.2g}, {r['worst'] or '?'})" if r["max_rel"] is not None \
            and math.isfinite(r["max_rel"]) else f"{o} ({r['worst'] or '?'} not finite)"
    if o in mlm_verdict.VERDICTS + ("ok",):
        return o
    why = (r.get("error") or "").split("\n")[0].replace("|", "/")[:90]
    return f"{o}: {why}" if why else o


def reference_tables(doc: dict[str, Any]) -> str:
    """Markdown tables of a reference summary (``--reference-report``): world size 1 against
    DDP; two ranks fused against unfused; then, where there are any, the references that did
    not run through, and the runs a later call replaced."""
    rows = doc["rows"]
    out = ["| release | layers | model | ZeRO | wgrad | variant | verdict (max. relative "
           "difference, where) | grad norm per iteration | DDP's | status says |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["dp"] != 1 or r["layout"] == "DDP":
            continue
        said = (r.get("status") or "").split(" — ")[-1].split(":")[0] or "–"
        out.append(f"| {r['release']} | {r['layers']} | {'MoE' if r['moe'] else 'GPT'} | "
                   f"{r['layout'].split('-')[1]} | {'fused' if r['fusion'] else 'apart'} | "
                   f"{r['variant']} | {_verdict_cell(r)} | {_values(r['grad_norm'])} | "
                   f"{_values(r['reference_grad_norm'])} | {said} |")
    out += ["", "| release | layers | model | ZeRO | variant | verdict (max. relative difference, "
            "where) | grad norm per iteration, fused | apart | reduced gradient, rel. L2 per "
            "iteration |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["dp"] != 2 or not r["fusion"]:
            continue
        l2 = _values(r["grad_rel_l2"]) if r["grad_rel_l2"] else "–"
        out.append(f"| {r['release']} | {r['layers']} | {'MoE' if r['moe'] else 'GPT'} | "
                   f"{r['layout'].split('-')[1]} | {r['variant']} | {_verdict_cell(r)} | "
                   f"{_values(r['grad_norm'])} | {_values(r['reference_grad_norm'])} | {l2} |")
    refs = [r for r in rows if (r["layout"] == "DDP" or (r["dp"] == 2 and not r["fusion"]))
            and r["outcome"] != "ok"]
    if refs:
        out += ["", "| reference | outcome |", "|---|---|"]
        out += [f"| {r['id'].replace('|', ' ')} | {_verdict_cell(r)} |" for r in refs]
    if doc.get("replaced"):
        out += ["", "| run | in record | its outcome there | replaced by the run in |",
                "|---|---|---|---|"]
        for r in doc["replaced"]:
            why = f": {r['error'][:80]}" if r.get("error") else ""
            out.append(f"| {r['id'].replace('|', ' ')} | {r['record']} | "
                       f"{r['outcome']}{why.replace('|', '/')} | {r['by_record']} |")
    return "\n".join(out)


TE_VERSION = re.compile(r"Transformer Engine version \.* ?(\S+)")


def te_versions(results: list[dict[str, Any]]) -> list[str]:
    """The TransformerEngine versions the runs with TE layers printed (Megatron's own
    ``Transformer Engine version`` line): what they ran, where the driver's environment probe,
    taken before TE's setup ends, cannot tell."""
    return sorted({m.group(1) for r in results if r.get("impl", "te") == "te"
                   for line in r.get("log_head_versions") or [] for m in [TE_VERSION.search(line)]
                   if m})


def joined(reports: list[dict[str, Any]], names: list[str] | None = None) -> dict[str, Any]:
    """Several raw records (one GPU call each, on one kind of machine) as one: their results in
    the order they first appear, each case once. A later call's run of a case replaces an
    earlier call's: a case a call did not start (``not run``), or one run again after a harness
    fix or so that its configuration's runs share one call (a run is compared only with a
    serialized run of its own call); of two ``not run``, the later reason stands. Each
    replaced run that did run is listed under ``replaced``, with its record's name (``names``,
    else its place in ``reports``); ``gpu`` and ``torch`` must be the same in every record."""
    names = names or [str(i + 1) for i in range(len(reports))]
    first = dict(reports[0])
    for report in reports[1:]:
        for key in ("gpu", "torch"):
            if report.get("env", {}).get(key) != first.get("env", {}).get(key):
                raise ValueError(f"records of different machines: {key} "
                                 f"{report.get('env', {}).get(key)} != {first['env'].get(key)}")
    results: dict[str, dict[str, Any]] = {}
    replaced = []
    for call, report in enumerate(reports):
        for r in report["results"]:
            before = results.get(r["id"])
            if before is not None and before["outcome"] != "not run":
                if r["outcome"] == "not run":
                    continue
                replaced.append({"id": r["id"], "record": names[before["_call"]],
                                 "outcome": before["outcome"], "by_record": names[call],
                                 "error": (before.get("error") or "")[:300] or None})
            results[r["id"]] = dict(r, _call=call)  # in its first place in the order
    first["results"] = [{k: v for k, v in r.items() if k != "_call"} for r in results.values()]
    first["replaced"] = replaced
    for key in ("checkouts", "serialized_vs_shipped"):
        first[key] = {name: value for report in reports
                      for name, value in (report.get(key) or {}).items()}
    return first


def read(path: str) -> dict[str, Any]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def cell(r: dict[str, Any]) -> str:
    """One run's outcome as a table cell."""
    o = r["outcome"]
    if o == "wrong":
        return f"wrong (rel. L2 {r['rel_l2']:.2g})" if r["rel_l2"] is not None else "wrong"
    if o in ("crash", "unsupported", "not run"):
        why = (r.get("error") or "").split("\n")[0].replace("|", "/")[:80]
        return f"{o}: {why}" if why else o
    return o


def report_tables(doc: dict[str, Any]) -> str:
    """Markdown tables of a summary (``--report``): DP=2 runs (one row per configuration and
    variant: its serialized run and each delay, each against the serialized run), the DP=1 and
    audit routes, and the unit tests."""
    rows = doc["rows"]
    out = ["| release | layers | ZeRO | dtype | also | variant | serialized | 0 ms | 20 ms |",
           "|---|---|---|---|---|---|---|---|---|"]
    seen: dict[tuple, dict[str, str]] = {}
    for r in rows:
        if r["group"] == "unit" or r["dp"] != 2 or r["variant"] in AUDITS:
            continue
        also = ", ".join(x for x, on in (("recompute", r["recompute"]), ("MoE", r["moe"]),
                                         ("no overlap", not r["overlap_grad_reduce"])) if on)
        layers = "local" if "|local|" in r["id"] else "TE"
        key = (r["release"], layers, r["zero"], r["dtype"], also or "–", r["variant"])
        col = "serialized" if r["serialized"] else f"{r['delay_ms']:g} ms"
        seen.setdefault(key, {})[col] = cell(r)
    not_run: dict[tuple, str] = {}
    for key, cols in seen.items():
        if all(v.startswith("not run") for v in cols.values()):
            reason = cols.get("serialized") or next(iter(cols.values()))
            not_run.setdefault(key[:5], reason.split(": ", 1)[-1])
            continue
        out.append("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(
            cols.get(c, "–") for c in ("serialized", "0 ms", "20 ms")) + " |")
    if not_run:
        out += ["", "| release | layers | ZeRO | dtype | also | not run (every variant) |",
                "|---|---|---|---|---|---|"]
        out += ["| " + " | ".join(str(k) for k in key) + f" | {why} |"
                for key, why in not_run.items()]
    out += ["", "| release | layers | world size | ZeRO | route | variant | delay ms | outcome | "
            "gradient-pool allocations (pool) | audit verdict |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["group"] == "unit" or (r["dp"] == 2 and r["variant"] not in AUDITS):
            continue
        route = "torchrun, NCCL" if r["launcher"] == "torchrun" else "--fake-process-group"
        run = "serialized" if r["serialized"] else f"{r['delay_ms']:g}"
        pools = r.get("grad_pool") or "–"
        if r["grad_pool_allocations"] is not None:
            pools = f"{r['grad_pool_allocations']} ({pools})"
        layers = "local" if "|local|" in r["id"] else "TE"
        out.append(f"| {r['release']} | {layers} | {r['dp']} | {r['zero']} | {route} | "
                   f"{r['variant']} | {run} | "
                   f"{cell(r)} | {pools} | {r['audit'] or '–'} |")
    pairs = doc.get("serialized_vs_shipped")
    if isinstance(pairs, dict) and pairs:
        out += ["", "| configuration | serialized run | against the serialized run as shipped |",
                "|---|---|---|"]
        for key, p in pairs.items():
            config, variant = key.rsplit("|", 1)
            # not "wrong": neither serialized run is the truth of the other (a fix of a release
            # defect outside the double buffer changes the arithmetic on purpose)
            said = "exact" if p["outcome"] == "exact" else "differs"
            rel = "" if p["rel_l2"] is None or said == "exact" else \
                f" (rel. L2 {p['rel_l2']:.2g}, from iteration {p['first_bad_step']})"
            out.append(f"| {config.replace('|', ' ')} | {variant} | {said}{rel} |")
    if doc.get("replaced"):
        out += ["", "| run | in record | its outcome there | replaced by the run in |",
                "|---|---|---|---|"]
        for r in doc["replaced"]:
            why = f": {r['error'][:80]}" if r.get("error") else ""
            out.append(f"| {r['id'].replace('|', ' ')} | {r['record']} | "
                       f"{r['outcome']}{why.replace('|', '/')} | {r['by_record']} |")
    out += unit_test_tables(doc.get("unit_tests") or {})
    return "\n".join(out)


ENDS = ("passed", "failed", "skipped", "xfail", "xpass", "error")


def unit_test_tables(units: dict[str, Any]) -> list[str]:
    """The unit tests, three tables: each run's count of each end (and of the collected tests
    it did not end), with the probe's word on the hotfix; the tests that neither passed nor
    skipped, by test function and end; the skipped ones, by reason."""
    if not units:
        return []
    out = ["", "| release | variant | the hotfix in the tests' process | collected | "
           + " | ".join(ENDS) + " | not ended | ends unlike as shipped | ended in one run only |",
           "|---|---|---|---|" + "---|" * len(ENDS) + "---|---|---|"]
    for rel, both in units.items():
        for variant in ("shipped", "hotfix"):
            tests = both.get(variant) or {}
            probe = (both.get("probe") or {}).get(variant) or {}
            seen = ("not loaded" if probe.get("loaded") is False else
                    f"{probe['state']}: {probe.get('verdict', '')}" if probe else "not seen")
            ends = [sum(e.split(":")[0] == end for e in tests.values()) for end in ENDS]
            collected = (both.get("collected") or {}).get(variant)
            apart = ("–", "–") if variant == "shipped" else (
                str(len(both["differ"])), str(len(both["one_run_only"])))
            out.append(f"| {rel} | {variant} | {seen.replace('|', '/')} | {collected} | "
                       + " | ".join(map(str, ends)) + f" | {(collected or 0) - len(tests)} | "
                       + " | ".join(apart) + " |")

    def grouped(keep) -> dict[tuple, int]:
        found: dict[tuple, int] = {}
        for rel, both in units.items():
            shipped, hotfix = both.get("shipped") or {}, both.get("hotfix") or {}
            for test in sorted(set(shipped) | set(hotfix)):
                ends = (shipped.get(test, "–"), hotfix.get(test, "–"))
                if keep(ends):
                    key = (rel, test.split("::")[-1].split("[")[0]) + ends
                    found[key] = found.get(key, 0) + 1
        return found

    def cell(end: str) -> str:
        return end.replace("|", "/")[:160]

    out += ["", "| release | test | cases | as shipped | with the hotfix |", "|---|---|---|---|---|"]
    out += [f"| {rel} | {test} | {n} | {cell(s)} | {cell(h)} |" for (rel, test, s, h), n in
            grouped(lambda e: any(x.split(":")[0] not in ("passed", "skipped")
                                  for x in e)).items()]
    reasons: dict[tuple, list[int]] = {}
    for (rel, _, s, h), n in grouped(lambda e: any(x.startswith("skipped") for x in e)).items():
        for i, end in enumerate((s, h)):
            if end.startswith("skipped"):
                reasons.setdefault((rel, end.split(":", 1)[1].strip()), [0, 0])[i] += n
    out += ["", "| release | skipped because | as shipped | with the hotfix |", "|---|---|---|---|"]
    out += [f"| {rel} | {cell(why)} | {n[0]} | {n[1]} |"
            for (rel, why), n in sorted(reasons.items(),
                                        key=lambda kv: (list(units).index(kv[0][0]), -kv[1][0]))]
    return out


def env_info() -> dict[str, Any]:
    # TE's version is read from the runs' own lines (te_versions): here, at the start, TE's
    # setup may not have ended
    code = ("import json,torch\nprint(json.dumps({'torch': torch.__version__, "
            "'gpu': torch.cuda.get_device_name(0)}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception:
        return {"error": (r.stdout + r.stderr)[-1500:]}


def driver_main(a: argparse.Namespace) -> None:
    t0 = time.time()
    import run_matrix

    rel_dirs = {k: v for k, v in run_matrix.unpack_releases(a.wheels).items() if k in a.releases}
    checkouts = dict(parse_checkouts(a.megatron_lm, a.releases))
    os.makedirs(os.path.join(workdir.run_dir(), "cases"))
    src, checks = stage_sources(checkouts, rel_dirs)
    report: dict[str, Any] = {"argv": sys.argv, "releases": rel_dirs, "checkouts": checks,
                              "t_start": t0}
    report["env"] = env_info()
    report["calibration"] = run_matrix.calibrate()
    cases = selected(a)
    missing = {rel: check.get("unit_tests_missing", []) for rel, check in checks.items()}
    drv = Driver(Paths(rel_dirs, src, missing), report["calibration"]["cycles_per_ms"],
                 t0 + a.budget_s, a.workers, a.case_timeout, a.unit_timeout)
    report["results"] = []

    def progress(done: list[dict[str, Any]]) -> None:  # a run cut short keeps what it had
        report["results"] = done
        report["wall_s"] = round(time.time() - t0, 1)
        write(a.out, report)

    report["results"] = drv.run_all(cases, progress=progress)
    try:
        report["serialized_vs_shipped"] = serialized_pairs(report["results"])
    except Exception as e:  # the runs are the record; this is a reading of them
        report["serialized_vs_shipped"] = f"{type(e).__name__}: {e}"
    report["wall_s"] = round(time.time() - t0, 1)
    write(a.out, report)
    write(a.out.replace(".json", "-summary.json"), summary(report))
    if any(c["group"] in REFERENCE_GROUPS for c in cases):
        write(a.out.replace(".json", "-reference-summary.json"), reference_summary(report))
    print(f"wrote {a.out} ({report['wall_s']} s)")


def selected(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The plan of ``--releases`` and ``--groups``, cut to the ids ``--only`` matches."""
    return [c for c in plan(a.releases, a.groups) if not a.only or re.search(a.only, c["id"])]


def write(path: str, doc: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump(doc, f, indent=1, default=str)


def parse_checkouts(items: list[str], releases) -> list[tuple[str, str]]:
    """``RELEASE=DIR`` pairs; a bare ``DIR`` stands for every release (each is checked)."""
    out = []
    for item in items:
        rel, sep, folder = item.partition("=")
        if sep:
            if rel not in RELEASES:
                raise SystemExit(f"--megatron-lm {item}: unknown release {rel!r} "
                                 f"(known: {', '.join(RELEASES)})")
            out.append((rel, folder))
        else:
            out.extend((r, item) for r in releases)
    return out


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--dry", action="store_true", help="print the plan (id and command line)")
    p.add_argument("--summary", metavar="JSON", nargs="+",
                   help="print the summary of raw records (one session's calls, in order)")
    p.add_argument("--report", metavar="JSON", help="print the markdown tables of a summary")
    p.add_argument("--reference-summary", metavar="JSON", nargs="+",
                   help="print the summary of the runs judged against a reference (raw records)")
    p.add_argument("--reference-report", metavar="JSON",
                   help="print the markdown tables of a reference summary")
    p.add_argument("--megatron-lm", action="append", default=[], metavar="[RELEASE=]DIR")
    p.add_argument("--releases", default=",".join(RELEASES))
    p.add_argument("--groups", default=",".join(GROUPS))
    p.add_argument("--only", default="", help="regular expression on the case ids")
    p.add_argument("--wheels", default=os.path.join(HERE, "wheels"))
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=520.0)
    p.add_argument("--case-timeout", type=float, default=240.0)
    p.add_argument("--unit-timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    a.releases = tuple(r for r in a.releases.split(",") if r)
    a.groups = tuple(g for g in a.groups.split(",") if g)
    return a


if __name__ == "__main__":
    args = parse()
    if args.dry:
        for planned in selected(args):
            line = (("mfsdp-hotfix run -- " if planned["variant"] == "hotfix" else "")
                    + "torchrun --nproc-per-node 1 -m pytest "
                    f"{UNIT_TESTS[planned['release']]}/FILE, each file in its own process"
                    if planned["group"] == "unit" else " ".join(pretrain_args(planned)))
            print(planned["id"], line)
    elif args.summary:
        print(json.dumps(summary(joined([read(path) for path in args.summary],
                                        [os.path.basename(path) for path in args.summary])),
                         indent=1))
    elif args.reference_summary:
        print(json.dumps(reference_summary(joined(
            [read(path) for path in args.reference_summary],
            [os.path.basename(path) for path in args.reference_summary])), indent=1))
    elif args.reference_report:
        with open(args.reference_report) as f:
            print(reference_tables(json.load(f)))
    elif args.report:
        with open(args.report) as f:
            print(report_tables(json.load(f)))
    elif not args.out:
        sys.exit("--out is required")
    else:
        driver_main(args)
