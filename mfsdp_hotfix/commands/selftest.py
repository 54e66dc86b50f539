"""``mfsdp-hotfix selftest``: the before/after proof on this install, on CPU (2 gloo ranks) or
with ``--gpu`` on this machine's GPU(s); its drivers turn :mod:`..selftest`'s runs into the
verdict line, the JSON and the exit status."""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import sys
from typing import Any

from .. import settings, tree
from ..selftest.gpu_spec import LAYERS as GPU_LAYERS
from ..selftest.protocol import DEFAULT as DEFAULT_PROTOCOL
from ..selftest.protocol import PROTOCOLS
from ..verdict_text import block, first_line
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
    mode = "gpu" if args.gpu else "cpu"
    if args.path is not None:  # a mistyped --path must not test the installed copy instead
        try:
            tree.readable_folder(args.path)
        except tree.TreeError as exc:
            return _selftest_cannot_run(f"--path {exc}", args.json, mode, "",
                                        [f"--path {exc}", "nothing was tested"])
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
            "no torch in this environment", as_json, "cpu",
            "use a fresh virtual environment (README, 'Try it')",
            ["the selftest runs on this environment's own torch and Megatron-FSDP and installs "
             "nothing; to try it on a machine without them, use a fresh virtual environment"])
    try:
        import numpy  # noqa: F401
    except ImportError:
        return _selftest_cannot_run(
            "no numpy in this environment", as_json, "cpu", "`pip install numpy`",
            ["torch.distributed's all_gather_object, which Megatron-FSDP calls, needs it on "
             "CPU (gloo); or use a fresh virtual environment (README, 'Try it')"])
    missing = _missing_copy(path, flavour)
    if missing is not None:  # known before any worker starts, as status knows it
        return _selftest_cannot_run(missing[0], as_json, "cpu", *missing[1:])
    from ..selftest.selftest import audit_phase, cannot_run, conclusion, run_selftest

    # With --json, stdout carries only the JSON; progress and the table go to stderr.
    runs = run_selftest(path=path, flavour=flavour, out=sys.stderr if as_json else sys.stdout,
                        audit=audit, protocol=protocol)
    blocked = cannot_run(runs)
    if blocked:  # said already, as the verdict
        if as_json:
            _cannot_run_json(blocked, "cpu", blocked.splitlines()[0].split(": ", 2)[2])
        return SELFTEST_CANNOT_RUN
    passed, told = conclusion(runs)
    if as_json:
        results = ({"phases": [audit_phase(name, result) for name, result in runs]} if audit
                   else {name: result.to_dict() for name, result in runs})
        print(json.dumps({"verdict": "PASS" if passed else "FAIL", **_verdict_fields(told),
                          **results}, default=str))
    return SELFTEST_PASS if passed else SELFTEST_FAIL


def _selftest_cannot_run(why: str, as_json: bool, mode: str, todo: str = "",
                         details: list[str] | None = None) -> int:
    """``selftest: CANNOT RUN: <why>; <todo>`` and its details on stderr (and with ``--json``
    as the JSON's verdict)."""
    first = first_line(f"selftest: {CANNOT_RUN}: {why}", todo)
    told = block(first, [detail for detail in details or [] if detail not in first])
    if as_json:
        _cannot_run_json(told, mode, why)
    print(told, file=sys.stderr)
    return SELFTEST_CANNOT_RUN


def _cannot_run_json(told: str, mode: str, why: str) -> None:
    """The JSON of a selftest that cannot run here: its verdict, the lines that say so, and
    why."""
    print(json.dumps({"verdict": CANNOT_RUN, **_verdict_fields(told), "mode": mode,
                      "cannot_run": why}))


def _verdict_fields(told: str) -> dict[str, Any]:
    """The verdict as printed, for the JSON: its first line, and the details below it."""
    first, *details = told.splitlines()
    return {"conclusion": first, "details": [line.strip() for line in details]}


# The top-level package each copy is imported from, and where megatron-core keeps its copy.
_STANDALONE, _CORE = "megatron_fsdp", "megatron"
_CORE_COPY = "core/distributed/fsdp/src/megatron_fsdp"


def _missing_copy(path: str | None, flavour: str) -> tuple[str, str, list[str]] | None:
    """Why the copy ``flavour`` asks for is not there, read from the import path without
    importing anything (``--path DIR``: in DIR only, which the selftest tests): the reason,
    the thing to do and the details for :func:`_selftest_cannot_run`; None when it is there."""
    core = _find(_CORE, path)
    has_core = core is not None and any(
        os.path.isfile(os.path.join(location, _CORE_COPY, "__init__.py"))
        for location in core.submodule_search_locations or [])
    has_standalone = _find(_STANDALONE, path) is not None
    where = f"in --path {path}" if path is not None else "installed here"
    instead = ("give --path a folder that holds it (e.g. an unpacked release)" if path is not None
               else "give --path a folder that holds it")
    nothing = ["nothing was started or tested"] + (
        [f"--path DIR tests the copy in DIR alone; {path} holds none"] if path is not None else [])
    if flavour == "core" and not has_core:
        if core is None:
            return f"megatron-core is not {where}", f"install megatron-core, or {instead}", nothing
        return (f"the megatron-core {where} has no Megatron-FSDP copy (megatron.core."
                "distributed.fsdp)", "install megatron-core 0.14 or later", nothing)
    if flavour == "standalone" and not has_standalone:
        return f"megatron-fsdp is not {where}", f"install megatron-fsdp, or {instead}", nothing
    if flavour == "auto" and not (has_core or has_standalone):
        return (f"no Megatron-FSDP copy {where}", instead if path is not None else
                f"install megatron-fsdp or megatron-core, or {instead}",
                ["neither megatron_fsdp nor megatron.core.distributed.fsdp is there", *nothing])
    return None


def _find(name: str, path: str | None) -> Any:
    """The spec of the top-level package ``name`` (None: not there), in ``path`` alone or
    where ``import`` looks, without the hotfix's own finder (a look-up would install it in
    this process)."""
    if path is not None:
        return importlib.machinery.PathFinder.find_spec(name, [path])
    for finder in sys.meta_path:
        if type(finder).__module__.startswith("mfsdp_hotfix") or not hasattr(finder,
                                                                             "find_spec"):
            continue
        found = finder.find_spec(name, None)
        if found is not None:
            return found
    return None


def _gpu_selftest(args: argparse.Namespace) -> int:
    """``selftest --gpu``: the runs, the table and the verdict line (the audit is always on)."""
    out = sys.stderr if args.json else sys.stdout

    def cannot_run(why: str) -> int:
        told = block(first_line(f"selftest: {CANNOT_RUN}: {why}",
                                "without a GPU, run `mfsdp-hotfix selftest` (CPU)"),
                     [f"the GPU selftest cannot run here: {why}", "it needs this environment's "
                      "torch with CUDA and at least one visible GPU; nothing was tested"])
        if args.json:
            _cannot_run_json(told, "gpu", why)
        print(told, file=out)
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
    missing = _missing_copy(args.path, args.flavour)
    if missing is not None:  # known before any worker starts, as status knows it
        return _selftest_cannot_run(missing[0], args.json, "gpu", *missing[1:])
    results = gpu.run_gpu_selftest(plan, path=args.path, out=out, progress=sys.stderr)
    data = gpu.to_json(plan, results)
    if args.json:
        print(json.dumps(data, default=str))
    return SELFTEST_PASS if data["verdict"] == "PASS" else SELFTEST_FAIL
