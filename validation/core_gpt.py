#!/usr/bin/env python3
"""megatron-core's own stack on one GPU: ``GPTModel`` (TE layer spec) through the Megatron-FSDP
adapter, as Megatron-LM / Megatron-Bridge users run it.

The configuration is the users' one: ``TransformerConfig(gradient_accumulation_fusion=True)``,
``get_gpt_layer_with_transformer_engine_spec``, megatron-core's ``FullyShardedDataParallel``
adapter with ``DistributedDataParallelConfig(use_megatron_fsdp=True,
data_parallel_sharding_strategy="optim_grads_params", fsdp_double_buffer=True)``, built on
``parallel_state.initialize_model_parallel`` over a fake 2-rank world (one process, one GPU,
NCCL work semantics from ``fakepg_shims``).  A dense model and an MoE model (TE grouped experts,
``moe_grouped_gemm=True``) are run on megatron-core 0.18.2 and 0.19.2, as shipped and with
``mfsdp_hotfix`` imported first, each against the same run serialized
(``CUDA_LAUNCH_BLOCKING=1``), with and without a slow reduce-scatter; the ``main_grad`` buffers
are compared bit for bit after every ``finish_grad_sync``. Microbatches are driven as
Megatron-LM's schedule drives them: ``no_sync()`` around every microbatch but the last (records
before this was added called no ``no_sync()``; for ZeRO-3 the release reduces the same way).

Each case is its own process (core_gpt_case.py) and records every stage it reaches (imports,
parallel_state, model_build, fsdp_wrap, forward, backward, finish_grad_sync, steps) with the
exception and traceback of the one that failed, so a single GPU run shows where the stack stops.

    python3 validation/core_gpt.py --out core_gpt.json             # driver (GPU)
    python3 validation/core_gpt.py --device cpu --out cpu.json     # adapter path on CPU

``--device cpu`` runs the same adapter path without TE (megatron-core's local spec, whose
``ColumnParallelLinear``/``RowParallelLinear`` take the same fused-wgrad route) on the CPU
``torch.cuda`` stand-in of ``mfsdp_hotfix.selftest``: it checks the build and wrap, orders
nothing, and its gradients say nothing about the race.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import comparison
import core_gpt_case
import workdir
from side_by_side import run_side_by_side

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RELEASES = ("core-0.18.2", "core-0.19.2")


# --------------------------------------------------------------------------------------- driver

def make_cases(a, cpm):
    """Per release, the probe without the APEX stub (stops after model_build); per (release,
    model), the serialized truth of shipped and hotfix, then the asynchronous runs at each
    delay."""
    cases = []
    model_env = {"moe-opfuser": {"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"}}
    base = dict(device=a.device, spec="local" if a.device == "cpu" else "te",
                db=not a.no_double_buffer,
                size="tiny" if a.device == "cpu" else "gpu",
                steps=a.steps, microbatches=a.microbatches, cycles_per_ms=cpm, delay_ms=0.0)
    for rel in a.releases:
        for model in a.models:
            tag = f"{rel}|{model}" + ("|no-double-buffer" if a.no_double_buffer else "")
            if model == a.models[0]:  # the APEX check does not depend on the model
                cases.append(dict(base, label=f"{tag}|probe-no-apex-stub", release=rel,
                                  model=model, fix="none", apex_stub=False,
                                  stop_after="model_build", wave=0,
                                  env=model_env.get(model, {})))
            for fix in ("none", "hotfix"):
                variant = "shipped" if fix == "none" else "hotfix"
                tpath = os.path.join(workdir.run_dir(), "truth", f"{rel}_{model}_{variant}.pt")
                cases.append(dict(base, label=f"{tag}|{variant}|serialized", release=rel,
                                  model=model, fix=fix, apex_stub=True, save_grads=tpath,
                                  wave=0, variant=variant,
                                  env=dict(model_env.get(model, {}), CUDA_LAUNCH_BLOCKING="1")))
                for d in (a.delays if model != "moe-opfuser" else a.delays[-1:]):
                    cases.append(dict(base, label=f"{tag}|{variant}|d{d:g}", release=rel,
                                      model=model, fix=fix, apex_stub=True, delay_ms=d,
                                      truth=tpath, wave=1, env=model_env.get(model, {}),
                                      variant=variant))
    # most informative first, so that a cut budget drops the op-fuser variant first
    return sorted(cases, key=lambda c: (c["wave"], a.models.index(c["model"])))


class Driver:
    def __init__(self, a, rel_paths, deadline):
        self.a = a
        self.rel_paths = rel_paths
        self.deadline = deadline
        for sub in ("cases", "truth"):
            os.makedirs(os.path.join(workdir.run_dir(), sub), exist_ok=True)
        self.truth_runs = {}

    def run(self, c):
        if time.time() > self.deadline:
            return dict(c, skipped="time budget exhausted")
        if c["release"] not in self.rel_paths:
            return dict(c, skipped="release wheel not found")
        if c.get("truth") and c["truth"] in self.truth_runs:
            self.truth_runs[c["truth"]].result()  # its serialized run first
        if c.get("truth") and not os.path.exists(c["truth"]):
            # still run it: where it stops is the result; nothing to compare with
            c = dict(c, truth=None, no_truth="the serialized run crashed or was skipped")
        name = c["label"].replace("|", "_")
        cpath = os.path.join(workdir.run_dir(), "cases", name + ".case.json")
        jout = os.path.join(workdir.run_dir(), "cases", name + ".json")
        with open(cpath, "w") as f:
            json.dump(c, f)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [REPO, self.rel_paths[c["release"]]] + [p for p in [env.get("PYTHONPATH")] if p])
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        env["PYTHONUNBUFFERED"] = "1"
        env["MFSDP_HOTFIX_CROSS_RANK_CHECK"] = "off"  # FakeStore has no set/get
        env.setdefault("OMP_NUM_THREADS", "2")
        env.update(c.get("env", {}))
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", cpath,
                                "--out", jout], env=env, capture_output=True, text=True,
                               timeout=self.a.case_timeout)
            rc, log = p.returncode, (p.stdout + p.stderr)
        except subprocess.TimeoutExpired as e:
            rc, log = "timeout", str(e)
        rec = dict(c, rc=rc, proc_s=round(time.time() - t0, 1))
        if os.path.exists(jout):
            with open(jout) as f:
                rec["result"] = json.load(f)
        else:
            rec["result"] = None
        if rc != 0 or rec["result"] is None or rec["result"].get("crashed"):
            rec["log_tail"] = log[-4000:]
        return rec

    def run_all(self, cases):
        """Serialized runs are submitted first; each asynchronous run starts once its own
        serialized run is done (no wave barrier: the GPU stays busy)."""
        self.truth_runs = {}
        return run_side_by_side(cases, self.run, max(1, self.a.workers), self.register,
                                lambda r: print(short(r), flush=True), "label")

    def register(self, c, f):
        """A serialized run, which the asynchronous run of the same case waits for."""
        if c.get("save_grads"):
            self.truth_runs[c["save_grads"]] = f


def outcome(r):
    res = r.get("result") or {}
    if r.get("skipped"):
        return "skipped"
    if not res:
        return "no-result"
    if res.get("crashed"):
        return "crash"
    if r.get("truth"):
        if "comparison" in res:
            return res["comparison"]["outcome"]
        # recorded before the bit comparison: the values were compared, not the bits
        largest = res.get("max_abs")
        same_values = largest is not None and not largest and "nonfinite_step" not in res
        return "equal values" if same_values else "wrong"
    if r.get("no_truth"):
        return "ran-no-truth"
    return "ok"


def short(r):
    res = r.get("result") or {}
    o = outcome(r)
    if o == "skipped":
        return f"SKIP  {r['label']}: {r['skipped']}"
    if o == "no-result":
        return f"FAIL  {r['label']} rc={r.get('rc')}: {r.get('log_tail', '')[-400:]}"
    stages = ",".join(s["stage"] for s in res.get("stages", []) if s["ok"])
    if o == "crash":
        return f"CRASH {r['label']} at {res.get('stopped_at')}: {res.get('error')} (ok: {stages})"
    return (f"{o:5s} {r['label']}: rel_l2={res.get('rel_l2')} max_abs={res.get('max_abs')} "
            f"step={res.get('step_ms_median')}ms proc={r.get('proc_s')}s")


def summary(results):
    rows = []
    for r in results:
        res = r.get("result") or {}
        rows.append({"release": r["release"], "model": r["model"], "db": r["db"],
                     "variant": r.get("variant", "probe"), "delay_ms": r["delay_ms"],
                     "serialized": bool(r.get("save_grads")), "outcome": outcome(r),
                     "rel_l2": res.get("rel_l2"), "max_abs": res.get("max_abs"),
                     "stopped_at": res.get("stopped_at"), "error": res.get("error"),
                     "where": next((s.get("where") for s in res.get("stages", [])
                                    if not s["ok"]), None),
                     "te_version": res.get("te_version"), "label": r["label"]})
    return rows


def report_table(path):
    """Markdown table of a driver's JSON (``--report``): one row per case, as recorded; the
    outcome is decided again from each case's record (older records compared values only)."""
    with open(path) as f:
        doc = json.load(f)
    decided = {case["label"]: outcome(case) for case in doc.get("cases", [])}
    out = ["| release | model | variant | RS delay ms | run | outcome | rel. L2 vs serialized | "
           "stopped at | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["summary"]:
        rel = "–" if r["rel_l2"] is None else f"{r['rel_l2']:.3g}"
        err = (r["error"] or "").split("\n")[0][:90].replace("|", "/")
        model = r["model"] + ("" if r.get("db", True) else ", fsdp_double_buffer=False")
        out.append(f"| {r['release']} | {model} | {r['variant']} | {r['delay_ms']:g} | "
                   f"{'serialized' if r['serialized'] else 'asynchronous'} | "
                   f"{decided.get(r['label'], r['outcome'])} | "
                   f"{rel} | {r['stopped_at'] or '–'} | {err or '–'} |")
    out.append("")
    if "serialized_shipped_vs_hotfix" in doc:
        out.append("Serialized shipped vs serialized hotfix: "
                   f"{doc['serialized_shipped_vs_hotfix']}")
    else:  # recorded before the bit comparison
        out.append("Serialized shipped vs serialized hotfix, max abs difference (values, bits "
                   f"not compared): {doc.get('serialized_shipped_vs_hotfix_max_abs')}")
    return "\n".join(out)


def truth_pairs(results):
    """Serialized shipped vs serialized hotfix grads of each configuration: must be identical."""
    import torch
    out = {}
    for r in results:
        if r.get("variant") != "shipped" or not r.get("save_grads"):
            continue
        other = r["save_grads"].replace("_shipped.pt", "_hotfix.pt")
        if os.path.exists(r["save_grads"]) and os.path.exists(other):
            both = comparison.compare(torch.load(r["save_grads"]), torch.load(other))
            out[f"{r['release']}|{r['model']}"] = {
                k: both.to_dict()[k] for k in ("outcome", "max_abs_diff", "steps_compared",
                                               "tensors_compared")}
    return out


def driver_main(a):
    t0 = time.time()
    sys.path.insert(0, HERE)
    from release_wheels import unpack_releases
    from run_matrix import calibrate
    rel_paths = {k: v for k, v in unpack_releases(os.path.join(HERE, "wheels")).items()
                 if k in a.releases}
    rel_paths.update(kv.split("=", 1) for kv in a.release_path)
    report = {"argv": sys.argv, "releases": rel_paths, "t_start": t0}
    cpm = 0.0
    if a.device != "cpu":
        report["calibration"] = calibrate()
        cpm = report["calibration"]["cycles_per_ms"]
    cases = make_cases(a, cpm)
    drv = Driver(a, rel_paths, t0 + a.budget_s)
    results = drv.run_all(cases)
    report["summary"] = summary(results)
    try:
        report["serialized_shipped_vs_hotfix"] = truth_pairs(results)
    except Exception as e:
        report["serialized_shipped_vs_hotfix"] = f"{type(e).__name__}: {e}"
    report["cases"] = results
    report["wall_s"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {a.out} ({report['wall_s']} s)")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--dry", action="store_true", help="print the planned cases and exit")
    p.add_argument("--case", help="internal: run one case described by this JSON file")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--releases", default=",".join(RELEASES))
    p.add_argument("--release-path", action="append", default=[],
                   help="NAME=FOLDER: use an unpacked release from this folder")
    p.add_argument("--models", default="dense,moe,moe-opfuser")
    p.add_argument("--delays", default="0,20", help="reduce-scatter delays in ms")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=170.0)
    p.add_argument("--case-timeout", type=float, default=150.0)
    p.add_argument("--no-double-buffer", action="store_true",
                   help="fsdp_double_buffer=False (to see whether a crash needs the pool)")
    p.add_argument("--report", metavar="JSON", help="print the markdown table of a result")
    a = p.parse_args(argv)
    a.releases = [r for r in a.releases.split(",") if r]
    a.models = [m for m in a.models.split(",") if m]
    a.delays = [float(d) for d in a.delays.split(",") if d]
    if a.device == "cpu":
        a.delays = [0.0]
    return a


if __name__ == "__main__":
    args = parse()
    if args.report:
        print(report_table(args.report))
    elif args.dry:
        for case in make_cases(args, 0.0):
            print(case["label"], json.dumps(case["env"]))
    elif not args.out:
        sys.exit("--out is required")
    elif args.case:
        core_gpt_case.case_main(args.case, args.out)
    else:
        driver_main(args)
