"""``mfsdp-hotfix selftest``: the before/after proof on this install, on CPU (2 gloo ranks) or
with ``--gpu`` on this machine's GPU(s); its drivers turn :mod:`..selftest`'s runs into the
verdict line, the JSON and the exit status."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import settings, tree
from ..selftest.gpu_spec import LAYERS as GPU_LAYERS
from ..selftest.protocol import DEFAULT as DEFAULT_PROTOCOL
from ..selftest.protocol import PROTOCOLS
from .exits import SELFTEST_CANNOT_RUN, SELFTEST_FAIL, SELFTEST_PASS

NAME = "selftest"
HELP = "prove the fix on this install (CPU, 2 ranks)"
USAGE: str | None = None
DESCRIPTION = ("Train a small model with this environment's torch and Megatron-FSDP on CPU (2 "
               "gloo ranks, fused wgrad, fsdp_double_buffer=True), once with MFSDP_HOTFIX=0 and "
               "once with the hotfix; installs nothing. The last line is 'selftest: PASS: ...' "
               "(exit 0), 'selftest: FAIL: ...' (exit 1: a fix failed) or 'selftest: CANNOT "
               "RUN: ...' (exit 2: no torch or numpy here, or the copy asked for cannot be "
               "imported).")
CANNOT_RUN = "CANNOT RUN"
GPU_ONLY = ("gpus", "layer", "delay_ms", "zero", "dtype", "timeout")


def add_arguments(test: argparse.ArgumentParser) -> None:
    test.add_argument("--path", help="folder put first on sys.path of the test processes, "
                                     "e.g. an unpacked release (default: as installed); "
                                     "refused if it is not a folder")
    test.add_argument("--flavour", choices=["auto", "standalone", "core"], default="auto",
                      help="which Megatron-FSDP copy to test: 'standalone' (megatron_fsdp), "
                           "'core' (the copy vendored in megatron-core) or 'auto' (megatron-"
                           "core's when importable, else megatron_fsdp; default)")
    test.add_argument("--json", action="store_true",
                      help="print the results as one JSON object on stdout (progress, table "
                           "and the verdict line go to stderr)")
    test.add_argument("--protocol", choices=list(PROTOCOLS), default=DEFAULT_PROTOCOL,
                      help="how the 2 microbatches of each step are driven: 'megatron-lm' "
                           "(no_sync() around every microbatch but the last, as Megatron-LM and "
                           "Megatron-Bridge do; default) or 'auto-sync' (fully_shard's default "
                           "sync_model_each_microbatch=True); also with --gpu")
    test.add_argument("--audit", action="store_true",
                      help="run both phases with the on-the-job audit on and check that its "
                           "counts equal the stand-in's; with --json, print {\"phases\": [...]} "
                           "(with --gpu the audit is always on)")
    _add_gpu_options(test)


def _add_gpu_options(test: argparse.ArgumentParser) -> None:
    gpu = test.add_argument_group(
        "GPU mode", "--gpu runs the same before/after on this machine's GPU(s): 1 GPU as a fake "
        "2-rank group with NCCL work semantics, several as NCCL ranks (torchrun); real "
        "TransformerEngine layers when transformer_engine is importable; each reduce-scatter "
        "made slow; every run compared bit for bit with the same run under "
        "CUDA_LAUNCH_BLOCKING=1, and the on-the-job audit on. PASS: with the hotfix the "
        "gradients are bit-identical and the audit saw >0 slot reuses, none unordered. Exit 2 "
        "when it cannot run here (no CUDA GPU).")
    gpu.add_argument("--gpu", action="store_true", help="run on the GPU(s) instead of the CPU")
    gpu.add_argument("--gpus", type=int, metavar="N",
                     help="how many GPUs to use (default: all visible; 1: fake 2-rank group)")
    gpu.add_argument("--layer", choices=list(GPU_LAYERS), default="auto", metavar="LAYER",
                     help="'te-layernorm-mlp' (te.LayerNormMLP), 'te-linear' (te.Linear), "
                          "'emulated' (TransformerEngine's fused-wgrad contract in PyTorch) or "
                          "'auto' (te-layernorm-mlp when transformer_engine is importable, else "
                          "emulated; default)")
    gpu.add_argument("--delay-ms", type=float, default=20.0, metavar="MS",
                     help="slow-reduce-scatter fault: GPU sleep enqueued before each "
                          "reduce-scatter, calibrated with CUDA events (default 20; 0: none)")
    gpu.add_argument("--zero", type=int, choices=[2, 3], default=3,
                     help="ZeRO stage: 3 shards parameters too, 2 gradients only (default 3)")
    gpu.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                     help="parameter dtype (default fp32)")
    gpu.add_argument("--timeout", type=float, default=300.0, metavar="S",
                     help="seconds each run may take before it is killed (default 300)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _note_audit_not_passed_on(args.json)
    if args.path is not None:  # a mistyped --path must not test the installed copy instead
        try:
            tree.readable_folder(args.path)
        except tree.TreeError as exc:
            return _selftest_cannot_run(f"--path {exc}. Nothing was tested", args.json,
                                        "gpu" if args.gpu else "cpu")
    if args.gpu:
        return _gpu_selftest(args)
    given = [f"--{name.replace('_', '-')}" for name in GPU_ONLY
             if getattr(args, name) != parser.get_default(name)]
    if given:
        parser.error(f"{', '.join(given)} only apply with --gpu")
    return _cpu_selftest(args.path, args.flavour, args.json, args.audit, args.protocol)


def _note_audit_not_passed_on(as_json: bool) -> None:
    """``mfsdp-hotfix audit -- mfsdp-hotfix selftest`` ends NO DATA: say why, before it runs."""
    if os.environ.get(settings.AUDIT, "").strip():
        print(f"selftest: note: {settings.AUDIT} is set (as 'mfsdp-hotfix audit' sets it), but "
              "the selftest does not pass it to its workers: it runs the same ranks without and "
              "with the hotfix, whose rank files would overwrite each other, so an audit around "
              "the selftest finds no rank file (NO DATA). 'mfsdp-hotfix selftest --audit' audits "
              "each run in a folder of its own and checks the audit's counts against the "
              "selftest's own.", file=sys.stderr if as_json else sys.stdout, flush=True)


def _cpu_selftest(path: str | None, flavour: str, as_json: bool, audit: bool,
                  protocol: str = DEFAULT_PROTOCOL) -> int:
    """``selftest`` (and ``--audit``: both phases with the audit on, and PASS also needs the
    audit's counts to equal the stand-in's in each phase)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return _selftest_cannot_run(
            "no torch in this environment. The selftest runs on this environment's own torch "
            "and Megatron-FSDP and installs nothing; to try it on a machine without them, use a "
            "fresh virtual environment (README, 'Try it').", as_json, "cpu")
    try:
        import numpy  # noqa: F401
    except ImportError:
        return _selftest_cannot_run(
            "no numpy in this environment. torch.distributed's all_gather_object, which "
            "Megatron-FSDP calls, needs it on CPU (gloo); `pip install numpy`, or use a fresh "
            "virtual environment (README, 'Try it').", as_json, "cpu")
    from ..selftest.selftest import audit_phase, cannot_run, conclusion, run_selftest

    # With --json, stdout carries only the JSON; progress and the table go to stderr.
    runs = run_selftest(path=path, flavour=flavour, out=sys.stderr if as_json else sys.stdout,
                        audit=audit, protocol=protocol)
    blocked = cannot_run(runs)
    if blocked:  # said already, as the last line
        if as_json:
            _cannot_run_json(blocked, "cpu", blocked.split(": ", 2)[2])
        return SELFTEST_CANNOT_RUN
    passed, line = conclusion(runs)
    if as_json:
        results = ({"phases": [audit_phase(name, result) for name, result in runs]} if audit
                   else {name: result.to_dict() for name, result in runs})
        print(json.dumps({"verdict": "PASS" if passed else "FAIL", "conclusion": line,
                          **results}, default=str))
    return SELFTEST_PASS if passed else SELFTEST_FAIL


def _selftest_cannot_run(why: str, as_json: bool, mode: str) -> int:
    """``selftest: CANNOT RUN: <why>`` on stderr (and with ``--json`` as the JSON's verdict)."""
    line = f"selftest: {CANNOT_RUN}: {why}"
    if as_json:
        _cannot_run_json(line, mode, why)
    print(line, file=sys.stderr)
    return SELFTEST_CANNOT_RUN


def _cannot_run_json(line: str, mode: str, why: str) -> None:
    """The JSON of a selftest that cannot run here: its verdict, the line that says so, and
    why."""
    print(json.dumps({"verdict": CANNOT_RUN, "conclusion": line, "mode": mode,
                      "cannot_run": why}))


def _gpu_selftest(args: argparse.Namespace) -> int:
    """``selftest --gpu``: the runs, the table and the verdict line (the audit is always on)."""
    out = sys.stderr if args.json else sys.stdout

    def cannot_run(why: str) -> int:
        line = (f"selftest: {CANNOT_RUN}: the GPU selftest cannot run here: {why}. It needs this "
                "environment's torch with CUDA and at least one visible GPU; without a GPU, "
                "run `mfsdp-hotfix selftest` (CPU)")
        if args.json:
            _cannot_run_json(line, "gpu", why)
        print(line, file=out)
        return SELFTEST_CANNOT_RUN

    try:
        import torch  # noqa: F401
    except ImportError:
        return cannot_run("no torch in this environment")
    from ..selftest import gpu

    try:
        visible = gpu.probe_cuda()
        plan = gpu.build_plan(visible, args.gpus, args.layer, gpu.te_importable(),
                              flavour=args.flavour, zero=args.zero, delay_ms=args.delay_ms,
                              dtype=args.dtype, timeout_s=args.timeout,
                              protocol=args.protocol)
    except gpu.CannotRun as exc:
        return cannot_run(str(exc))
    results = gpu.run_gpu_selftest(plan, path=args.path, out=out, progress=sys.stderr)
    data = gpu.to_json(plan, results)
    if args.json:
        print(json.dumps(data, default=str))
    return SELFTEST_PASS if data["verdict"] == "PASS" else SELFTEST_FAIL
