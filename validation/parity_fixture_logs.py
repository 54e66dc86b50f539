"""Real ``training_log`` output of the release families no committed record holds yet, for the
parity reader's fixtures (tests/parity/fixtures/): Megatron-LM's own ``pretrain_gpt.py`` at each
release's tag, Megatron's own DDP, a small GPT on mock data, 2 iterations, one GPU, with the
parity capture in the run (so each family's capture is exercised on the real loop too).

Two steps, because the GPU machine reaches no network:

    # here: each tag's megatron/ and scripts from a Megatron-LM clone (git archive), ~8 MB
    python3 validation/parity_fixture_logs.py pack GIT_DIR validation/parity_logs_stage
    # on the GPU machine, from the repository root (the stage travels with the tree)
    python3 validation/parity_fixture_logs.py run validation/parity_logs_stage $OUT
    # here again: each family's excerpt and capture into the fixtures
    python3 validation/parity_fixture_logs.py cut $OUT tests/parity/fixtures

``run`` writes ``$OUT/<family>.log`` (the run's whole output), ``$OUT/<family>/`` (the capture)
and ``$OUT/runs.json`` (tag, commit, command, exit status, seconds per family). The dataset
helpers (C++, which Megatron builds with ``make`` and ``pybind11`` at start): a tag whose
``helpers.cpp`` is the megatron-core 0.17.1 wheel's gets that wheel's compiled module
(``MFSDP_TEST_CACHE``'s unpacked wheel); with ``--helpers-python PY`` (a Python of the GPU
machine's version with ``pybind11`` importable) ``pack`` compiles the others' (0.14, 0.15) here;
``validation/mlm_inject`` then imports the module instead of running ``make``. A tag left
without one runs ``make`` on the machine (``runs.json`` and its log say when that failed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

from megatron_lm.arguments import pretrain_args

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FAMILIES = {"core-0.14.0": "core_v0.14.0", "core-0.15.3": "core_v0.15.3",
            "core-0.16.1": "core_v0.16.1", "core-0.17.1": "core_v0.17.1", "main": "HEAD"}
SCRIPTS = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")
HELPERS = "megatron/core/datasets/helpers.cpp"
# the released build of the dataset helpers the tags may share (cp312)
HELPERS_WHEEL = "megatron-core-0.17.1"
CASE = {"dp": 1, "iterations": 2, "fsdp": False, "impl": "local", "fusion": False,
        "deterministic": False, "db": False, "overlap_grad_reduce": False,
        "overlap_param_gather": False, "dtype": "fp32", "recompute": False, "moe": False,
        "launcher": "torchrun"}
TIMEOUT_S = 240  # each family; they run side by side


def _git(git_dir: str, *args: str) -> bytes:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True,
                          capture_output=True).stdout


def _build_helpers(git_dir: str, ref: str, python: str, target: str) -> None:
    """The tag's ``helpers.cpp`` compiled for ``python`` (as its Makefile does)."""
    source = target + ".cpp"
    with open(source, "wb") as f:
        f.write(_git(git_dir, "show", f"{ref}:{HELPERS}"))
    includes = subprocess.run([python, "-m", "pybind11", "--includes"], check=True,
                              capture_output=True, text=True).stdout.split()
    subprocess.run(["g++", "-O3", "-shared", "-std=c++11", "-fPIC", *includes, source, "-o",
                    target], check=True)
    os.remove(source)


def pack(git_dir: str, stage: str, helpers_python: str | None) -> None:
    """Each family's tree (git archive of megatron/ and the scripts) and its dataset helpers
    compiled: the wheel's where its helpers.cpp is the wheel's, else built with
    ``helpers_python``."""
    os.makedirs(stage, exist_ok=True)
    wheel = os.path.join(os.environ.get("MFSDP_TEST_CACHE", ".cache/releases"), "unpacked",
                         HELPERS_WHEEL)
    wheel_blob = _git(git_dir, "hash-object", os.path.join(wheel, HELPERS)).decode().strip()
    (built,) = glob.glob(os.path.join(wheel, "megatron/core/datasets/helpers_cpp*.so"))
    suffix = os.path.basename(built)[len("helpers_cpp"):]
    meta = {}
    for family, ref in FAMILIES.items():
        present = [s for s in SCRIPTS if subprocess.run(
            ["git", "--git-dir", git_dir, "cat-file", "-e", f"{ref}:{s}"],
            capture_output=True).returncode == 0]
        with open(os.path.join(stage, f"{family}.tar.gz"), "wb") as f:
            f.write(_git(git_dir, "archive", "--format=tar.gz", ref, "megatron", *present))
        helpers = os.path.join(stage, f"{family}-helpers_cpp{suffix}")
        if _git(git_dir, "rev-parse", f"{ref}:{HELPERS}").decode().strip() == wheel_blob:
            shutil.copyfile(built, helpers)
            origin = f"the {HELPERS_WHEEL} wheel's"
        elif helpers_python:
            _build_helpers(git_dir, ref, helpers_python, helpers)
            origin = f"compiled for {helpers_python}"
        else:
            origin = "make on the machine"
        meta[family] = {"ref": ref, "commit": _git(git_dir, "rev-parse", ref).decode().strip(),
                        "helpers": origin}
    with open(os.path.join(stage, "families.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta, indent=1))


def _stage_tree(stage: str, family: str, work: str) -> tuple[str, bool]:
    """(the family's tree unpacked under ``work``, whether it has compiled helpers)."""
    tree = os.path.join(work, family)
    os.makedirs(tree, exist_ok=True)
    with tarfile.open(os.path.join(stage, f"{family}.tar.gz")) as archive:
        archive.extractall(tree, filter="data")
    helpers = glob.glob(os.path.join(stage, f"{family}-helpers_cpp*.so"))
    for path in helpers:
        shutil.copyfile(path, os.path.join(tree, "megatron/core/datasets",
                                           os.path.basename(path)[len(family) + 1:]))
    return tree, bool(helpers)


def run_family(stage: str, family: str, info: dict[str, object], out: str, port: int) -> dict:
    from mfsdp_hotfix.parity.capture import capture_environment

    tree, helpers = _stage_tree(stage, family, "/tmp/parity_fixture_logs")
    capture_dir = os.path.join(out, family)
    os.makedirs(capture_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
    # mlm_inject imports the shipped dataset helpers instead of running `make`
    inject = [os.path.join(HERE, "mlm_inject")] if helpers else []
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", MFSDP_HOTFIX="0",
               PYTHONPATH=os.pathsep.join([*inject, tree]))
    env.update(capture_environment(capture_dir, env))  # the capture first, as parity puts it
    if inject:
        env["MFSDP_VAL_MLM_CAPTURE"] = capture_dir
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
            "--master-port", str(port), "pretrain_gpt.py", *pretrain_args(CASE)]
    start = time.time()
    with open(os.path.join(out, f"{family}.log"), "w") as log:
        try:
            rc = subprocess.run(argv, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {**info, "argv": argv, "rc": rc, "seconds": round(time.time() - start, 1)}


def cut(out: str, fixtures: str) -> None:
    """Each family that ran: its lines from the one before the first iteration line to the one
    after the last (as the fixtures' README says), and its capture, as ``<family>-ddp``."""
    with open(os.path.join(out, "runs.json")) as f:
        runs = json.load(f)
    for family, run in runs.items():
        with open(os.path.join(out, f"{family}.log"), errors="replace") as f:
            lines = f.read().splitlines()
        at = [i for i, line in enumerate(lines) if " iteration " in line and "grad norm" in line]
        if run["rc"] != 0 or not at:
            print(f"{family}: no excerpt (exit {run['rc']}, {len(at)} iteration lines)")
            continue
        name = os.path.join(fixtures, f"{family}-ddp")
        with open(f"{name}.log", "w") as f:
            f.write("\n".join(lines[max(0, at[0] - 1):at[-1] + 2]) + "\n")
        os.makedirs(f"{name}.capture", exist_ok=True)
        for path in glob.glob(os.path.join(out, family, "training_log-rank*.jsonl")):
            with open(path) as src, open(os.path.join(f"{name}.capture",
                                                      os.path.basename(path)), "w") as dst:
                dst.write(src.read())
        print(f"{family}: {name}.log ({len(at)} iterations, {run['ref']} {run['commit']})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("pack")
    p.add_argument("git_dir")
    p.add_argument("stage")
    p.add_argument("--helpers-python", help="a Python with pybind11, of the GPU machine's version")
    r = sub.add_parser("run")
    r.add_argument("stage")
    r.add_argument("out")
    r.add_argument("--families", nargs="*", default=list(FAMILIES))
    c = sub.add_parser("cut")
    c.add_argument("out")
    c.add_argument("fixtures")
    args = parser.parse_args()
    if args.step == "pack":
        pack(args.git_dir, args.stage, args.helpers_python)
        return 0
    if args.step == "cut":
        cut(args.out, args.fixtures)
        return 0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.stage, "families.json")) as f:
        families = json.load(f)
    sys.path.insert(0, REPO)  # the capture comes from this checkout
    runs = {}
    # side by side (a small GPT each: the start, not the GPU, is most of a run's time)
    with concurrent.futures.ThreadPoolExecutor(len(args.families)) as pool:
        started = {pool.submit(run_family, args.stage, family, families[family], args.out,
                               29600 + i): family for i, family in enumerate(args.families)}
        for done in concurrent.futures.as_completed(started):
            family = started[done]
            runs[family] = done.result()
            print(family, runs[family]["rc"], runs[family]["seconds"], flush=True)
            with open(os.path.join(args.out, "runs.json"), "w") as f:
                json.dump(runs, f, indent=1)
    return 0 if all(run["rc"] == 0 for run in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
