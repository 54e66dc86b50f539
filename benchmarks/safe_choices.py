#!/usr/bin/env python3
"""What the safe choices cost: step time and peak memory with real TransformerEngine, one GPU.

    python3 benchmarks/safe_choices.py --out $OUT/safe_choices.json   # GPU, TE importable
    python3 benchmarks/safe_choices.py --smoke --out $OUT/smoke.json   # tiny, every code path
    python3 benchmarks/safe_choices.py --dry                           # the plan; no GPU
    python3 benchmarks/safe_choices.py --report safe_choices.json      # docs/PERFORMANCE.md

Four variants of one model, each in its own worker process (the hotfix
patches at import, so it is per process):

* ``hotfix``: ``import mfsdp_hotfix`` first, TE fused wgrad accumulation, ``fsdp_double_buffer``;
* ``no-db``: as shipped, fused wgrad, ``fsdp_double_buffer=False`` (safe);
* ``fuse-off``: as shipped, ``fuse_wgrad_accumulation=False`` beside the double buffer, the
  workaround Megatron-Bridge and ROCm users run today (unsafe: the slot race remains);
* ``shipped``: as shipped, fused wgrad and double buffer (the unsafe default), for reference.

Model: identical FSDP units of real TE layers in bf16, the parameter GEMMs of a transformer
layer: ``te.LayerNormLinear(h, 3h)`` (QKV), ``te.Linear(h, h)`` (attention output projection;
the attention core, which has no parameters, is replaced by an elementwise gate of V by Q and K)
and ``te.LayerNormMLP(h, ffn)``. Default 6 units at h 4096, ffn 16384: 1.21 B parameters, so the
GEMMs dominate a step (at 8 x hidden 2048 fp32 it was launch-bound). One step: zero the gradient
buffer, forward and backward of every microbatch, ``finish_grad_sync()``; no optimizer step
(the same work in every variant). Timed with CUDA events, one event pair per step.

Megatron-FSDP runs on a fake process group of world size 2 on one GPU, with NCCL work semantics
(``validation/fakepg_shims.py``), a (2, 1) dp/tp mesh, exactly as ``validation/harness.py`` does.
Its collectives are local copies: what is measured is the GPU work of each variant and the
ordering the hotfix adds, not the network.

Order: groups (release, ZeRO level) one after another. A group starts its four workers in
parallel (imports, model build and a first warm-up, about 25 s with TE; nothing is timed then),
then gives them turns one at a time, repetition by repetition, the variants in the same order
(A B C D A B C D ...): in its turn a worker runs ``--warmup`` steps and ``--steps`` timed steps
while the others wait idle on their stdin, so only one process uses the GPU while timing. Each
turn's peak memory is ``torch.cuda.max_memory_allocated()`` over its timed steps. A group
starts only if it fits in what is left of ``--budget-s`` at the longest group time seen so far
(the first group always runs). Ratios are taken within one repetition (each variant's median
step time over the hotfix's median in the same repetition), then summarized over repetitions
(median, min, max). Workers' logs go to /tmp/safe_choices_logs; the results to the one JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
VALIDATION = os.path.join(REPO, "validation")
sys.path.insert(0, VALIDATION)

from harness_process import release_version  # noqa: E402 - stdlib-only at import
from release_wheels import REL, unpack_releases  # noqa: E402 - stdlib-only at import
from step_timing import pct  # noqa: E402 - stdlib-only at import

REFERENCE = "hotfix"
VARIANTS = [  # key, hotfix imported, fuse_wgrad_accumulation, fsdp_double_buffer, title
    dict(key="hotfix", hotfix=True, fuse=True, db=True,
         title="hotfix: fused wgrad + double buffer (safe)"),
    dict(key="no-db", hotfix=False, fuse=True, db=False,
         title="as shipped, fsdp_double_buffer=False (safe)"),
    dict(key="fuse-off", hotfix=False, fuse=False, db=True,
         title="as shipped, fusion off + double buffer (the workaround; unsafe)"),
    dict(key="shipped", hotfix=False, fuse=True, db=True,
         title="as shipped, fused wgrad + double buffer (default; unsafe)"),
]
SIZES = {
    "full": dict(units=6, hidden=4096, ffn=16384, tokens=4096, microbatches=2, warmup=3,
                 steps=30),
    "smoke": dict(units=2, hidden=256, ffn=1024, tokens=256, microbatches=2, warmup=1, steps=3),
}
GROUPS = {  # release:ZeRO level, in the order they run
    "full": ["fsdp-0.6.1:3", "fsdp-0.6.1:2", "core-0.19.2:3", "core-0.19.2:2"],
    "smoke": ["fsdp-0.6.1:3", "core-0.19.2:2"],
}
STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}


def unit_params(hidden, ffn):
    """Parameters of one unit: LayerNormLinear(h, 3h), Linear(h, h), LayerNormMLP(h, ffn)."""
    qkv = 2 * hidden + 3 * hidden * hidden + 3 * hidden
    proj = hidden * hidden + hidden
    mlp = 2 * hidden + hidden * ffn + ffn + ffn * hidden + hidden
    return qkv + proj + mlp


def gemm_flop(size):
    """FLOPs of one step's weight GEMMs (forward, dgrad, wgrad: 3 x 2 per weight and token), to
    see from the achieved rate that the GEMMs dominate the step."""
    weights = 4 * size["hidden"] ** 2 + 2 * size["hidden"] * size["ffn"]
    return 6 * size["units"] * weights * size["tokens"] * size["microbatches"]


# --- plan ---------------------------------------------------------------------------------------
def plan(groups, reps, size):
    """The groups in run order; each has one worker spec per variant and is measured ``reps``
    times, the variants in the same order inside each repetition."""
    out = []
    for group in groups:
        release, zero = group.split(":")
        if release not in REL:
            raise SystemExit(f"unknown release {release!r} (known: {', '.join(REL)})")
        if int(zero) not in STRATEGY:
            raise SystemExit(f"ZeRO level must be 2 or 3, not {zero}")
        workers = [dict(group=group, release=release, pkg=REL[release][2], zero=int(zero),
                        variant=v["key"], hotfix=v["hotfix"], fuse=v["fuse"], db=v["db"], **size)
                   for v in VARIANTS]
        out.append(dict(group=group, release=release, zero=int(zero), reps=reps,
                        workers=workers))
    return out


def turns(group):
    """(rep, worker index) in run order: A B C D A B C D ..."""
    return [(rep, i) for rep in range(group["reps"]) for i in range(len(group["workers"]))]


def drive(groups, start_worker, budget_s, hard_limit_s, after_each=None, clock=time.monotonic):
    """Measure every group: start its workers (one process per variant, built once, in
    parallel; nothing is timed then), then give them turns one at a time, and stop them.

    A group starts only if it fits in what is left of ``budget_s`` at the longest group time
    seen so far (the first group always runs); no turn starts that could end past
    ``hard_limit_s``. Returns one record per turn, the workers' start-up reports, and what was
    not run, with why."""
    t0 = clock()
    records, started, skipped, group_s, turn_s = [], [], [], [], [0.0]
    for group in groups:
        left = budget_s - (clock() - t0)
        if records and max(group_s, default=0.0) > left:
            skipped.append(dict(group=group["group"], turns=len(turns(group)),
                                reason=f"a group took {max(group_s):.0f} s; {left:.0f} s were "
                                       f"left of --budget-s {budget_s:.0f}"))
            continue
        g0 = clock()
        workers = [start_worker(spec) for spec in group["workers"]]
        try:
            ready = [w.ready() for w in workers]
            started.extend(ready)
            for spec, info in zip(group["workers"], ready, strict=True):
                print(short_start(spec, info), flush=True)
            for n, (rep, i) in enumerate(turns(group)):
                spec = group["workers"][i]
                if clock() - t0 + max(turn_s) > hard_limit_s:
                    skipped.append(dict(group=group["group"], turns=len(turns(group)) - n,
                                        reason=f"stopped before rep{rep} {spec['variant']}: "
                                               f"--hard-limit-s {hard_limit_s:.0f}"))
                    break
                if ready[i].get("ok"):
                    start = clock()
                    result = dict(workers[i].turn(rep))
                    turn_s.append(clock() - start)
                    result["turn_s"] = round(turn_s[-1], 2)
                else:
                    why = ready[i].get("error") or ready[i].get("invalid") or "?"
                    result = dict(ok=False, error=f"start-up failed: {why}")
                rec = dict(group=group["group"], release=group["release"], zero=group["zero"],
                           variant=spec["variant"], rep=rep,
                           result={**{k: ready[i].get(k) for k in IDENTITY}, **result})
                records.append(rec)
                print(short(rec), flush=True)
                if after_each is not None:
                    after_each(records, started, skipped)
        finally:
            for w in workers:
                w.close()
        group_s.append(clock() - g0)
    return records, started, skipped


IDENTITY = ("gpu", "torch", "te", "release_version", "n_params")  # copied into each turn


# --- the worker processes -------------------------------------------------------------------------
MARK = "@@safe_choices@@ "  # prefixes the worker's answers; anything else on its stdout is noise


class Worker:
    """The driver's handle on one worker process: it answers with one line per request."""

    def __init__(self, argv, env, log_path, ready_timeout_s, turn_timeout_s):
        self.log_path = log_path
        self.ready_timeout_s, self.turn_timeout_s = ready_timeout_s, turn_timeout_s
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.answers = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.answers.put(json.loads(line[len(MARK):]))
        self.answers.put(None)  # end of file: the process is gone

    def _answer(self, timeout_s):
        try:
            answer = self.answers.get(timeout=timeout_s)
        except queue.Empty:
            return dict(ok=False, error=f"no answer within {timeout_s:.0f} s")
        if answer is None:
            self.answers.put(None)
            try:
                rc = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rc = "?"
            return dict(ok=False, error=f"worker exited (rc {rc}): {self.log_tail(600)}")
        return answer

    def log_tail(self, n):
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def ready(self):
        return self._answer(self.ready_timeout_s)

    def turn(self, rep):
        try:
            self.proc.stdin.write(json.dumps(dict(op="turn", rep=rep)) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            return dict(ok=False, error=f"worker gone: {e}")
        return self._answer(self.turn_timeout_s)

    def close(self):
        try:
            self.proc.stdin.write(json.dumps(dict(op="exit")) + "\n")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def worker_env(spec, rel_paths):
    env = dict(os.environ)
    # keep what /tmp/te-env.sh put on PYTHONPATH (TransformerEngine) after the release
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO, rel_paths[spec["release"]], os.environ.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    # FakeStore implements no set/get: the hotfix's cross-rank check cannot run in a fake world
    env["MFSDP_HOTFIX_CROSS_RANK_CHECK"] = "off"
    if spec["hotfix"]:
        env.pop("MFSDP_HOTFIX", None)
    else:
        env["MFSDP_HOTFIX"] = "0"  # as shipped even if something imports mfsdp_hotfix
    env.pop("MFSDP_HOTFIX_AUDIT", None)
    return env


def serve(start):
    """The worker's side: ``start(info)`` sets up (filling ``info``) and returns
    ``turn(rep, out)``; answer the start-up, then one answer per turn until told to exit."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what libraries print goes to the log, not into the answers

    def say(msg):
        answers.write(MARK + json.dumps(msg, default=str) + "\n")
        answers.flush()

    info = dict(ok=False, phases_s={})
    t0 = time.time()
    turn = None
    try:
        turn = start(info)
        info["ok"] = not info.get("invalid")
    except BaseException as e:  # the answer says what broke; the driver goes on
        info.update(failure(e))
    info["start_s"] = round(time.time() - t0, 2)
    say(info)
    if info["ok"]:
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] != "turn":
                break
            out = dict(rep=request["rep"], ok=False)
            try:
                turn(request["rep"], out)
                out["ok"] = True
            except BaseException as e:
                out.update(failure(e))
            say(out)
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (about 10 s with TE loaded); all is said


def failure(e):
    lines = str(e).strip().splitlines()
    return dict(error=f"{type(e).__name__}: {' | '.join(lines[:3])[:600]}",
                traceback=traceback.format_exc()[-3000:])


def setup(spec, info):
    """Import, build and warm up one variant; return the function that measures one turn."""
    info["spec"] = spec
    t = time.time()

    def phase(name):
        nonlocal t
        now = time.time()
        info["phases_s"][name] = round(now - t, 2)
        t = now

    hotfix = None
    if spec["hotfix"]:
        import mfsdp_hotfix as hotfix  # before anything imports Megatron-FSDP
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    import fakepg_shims  # validation/ is on sys.path; binds before Megatron-FSDP is imported

    fakepg_shims.install_nccl_semantics()
    phase("import_torch")
    import transformer_engine
    import transformer_engine.pytorch as te

    phase("import_te")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cuda", (2, 1), mesh_dim_names=("dp", "tp"))
    import importlib

    mfpkg = importlib.import_module(spec["pkg"])
    mfmod = importlib.import_module(spec["pkg"] + ".megatron_fsdp")
    phase("import_megatron")
    info.update(torch=torch.__version__, gpu=torch.cuda.get_device_name(0),
                te=transformer_engine.__version__, release_version=release_version(spec["pkg"]),
                release_file=mfpkg.__file__)

    Block, Model = build_classes(torch, te)
    torch.manual_seed(1234)
    module = Model(spec["units"], spec["hidden"], spec["ffn"], spec["fuse"])
    info["n_params"] = sum(p.numel() for p in module.parameters())
    cfg = mfmod.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=STRATEGY[spec["zero"]],
        outer_dp_sharding_strategy="no_shard", overlap_grad_reduce=True,
        overlap_param_gather=True, average_in_collective=False,
        fsdp_double_buffer=spec["db"], check_for_nan_in_grad=False)
    dist_index = mfpkg.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp")
    model = mfpkg.MegatronFSDP(module, dist_index, ddp_config=cfg,
                               mixed_precision_policy=mfpkg.MixedPrecisionPolicy(),
                               fsdp_unit_modules=[Block], device=dev)
    phase("build")
    pgb = model.param_and_grad_buffer
    info["double_buffer"] = bool(model.ddp_config.fsdp_double_buffer)
    info["double_buf_units"] = len(getattr(pgb, "double_buf_units", []) or [])
    info["fuse_wgrad"] = sorted({m.fuse_wgrad_accumulation for b in module.units
                                 for m in (b.qkv, b.proj, b.mlp)})
    check_variant(spec, hotfix, info)
    if info.get("invalid"):
        return None  # no number for a variant that is not what it says

    inputs = []  # made before timing; two sets, alternated, so no step reuses the last's input
    gen = torch.Generator(device=dev)
    for i in range(2 * spec["microbatches"]):
        gen.manual_seed(10_000 + i)
        inputs.append(torch.randn(spec["tokens"], spec["hidden"], device=dev,
                                  dtype=torch.bfloat16, generator=gen))

    def step(n):
        model.zero_grad_buffer()
        for mb in range(spec["microbatches"]):
            x = inputs[(n % 2) * spec["microbatches"] + mb].detach().requires_grad_()
            loss = model(x).float().square().mean()
            loss.backward()
        model.finish_grad_sync()
        return loss.detach()

    for n in range(spec["warmup"]):  # first use: kernel loading, TE's torch.compile
        step(n)
    torch.cuda.synchronize()
    phase("first_warmup")
    info["peak_mem_mb_first_warmup"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if hotfix is not None:
        info["hotfix_summary"] = hotfix.summary()

    def turn(rep, out):
        """Warm-up, then the timed steps, one CUDA event pair each; peak memory over them."""
        for n in range(spec["warmup"]):
            step(n)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        events, losses = [], []
        for n in range(spec["steps"]):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step(n))
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        out["peak_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        out["peak_reserved_mb"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
        out["step_ms"] = [round(s.elapsed_time(e), 3) for s, e in events]
        out.update(step_stats(out["step_ms"]))
        out["gemm_tflops"] = round(gemm_flop(spec) / out["step_ms_median"] / 1e9, 1)
        out["loss_finite"] = bool(torch.isfinite(torch.stack(losses)).all())

    return turn


def check_variant(spec, hotfix, res):
    """Refuse to report a number for a variant that is not what it says it is."""
    problems = []
    if res["double_buffer"] != spec["db"]:
        problems.append(f"fsdp_double_buffer is {res['double_buffer']}, expected {spec['db']}")
    if res["fuse_wgrad"] != [spec["fuse"]]:
        problems.append(f"TE fuse_wgrad_accumulation {res['fuse_wgrad']}, expected {spec['fuse']}")
    loaded = sys.modules.get("mfsdp_hotfix")
    res["hotfix_loaded"] = loaded is not None
    if hotfix is not None:
        st = hotfix.status()
        copies = [c for c in st["copies"] if c.get("imported") and c["package"] == spec["pkg"]]
        applied = sorted({k for c in copies for k, f in c["fixes"].items()
                          if f["state"] == "applied"})
        res["hotfix_state"], res["hotfix_applied"] = st["hotfix"], applied
        if st["hotfix"] != "active" or not applied:
            problems.append(f"hotfix {st['hotfix']}, fixes applied to {spec['pkg']}: {applied}")
    elif loaded is not None:
        state = loaded.status()["hotfix"]
        res["hotfix_state"] = state
        if state != "off":
            problems.append(f"mfsdp_hotfix was imported and is {state} in a shipped variant")
    if problems:
        res["invalid"] = "; ".join(problems)


def build_classes(torch, te):
    nn = torch.nn
    bf16 = torch.bfloat16

    class Block(nn.Module):
        """The parameter GEMMs of a transformer layer, as TE layers (one FSDP unit)."""

        def __init__(self, hidden, ffn, fuse):
            super().__init__()
            kw = dict(params_dtype=bf16, fuse_wgrad_accumulation=fuse, device="cuda")
            self.qkv = te.LayerNormLinear(hidden, 3 * hidden, **kw)
            self.proj = te.Linear(hidden, hidden, **kw)
            self.mlp = te.LayerNormMLP(hidden, ffn, **kw)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            x = x + self.proj(v * torch.sigmoid(q + k))  # stands in for attention
            return x + self.mlp(x)

    class Model(nn.Module):
        def __init__(self, units, hidden, ffn, fuse):
            super().__init__()
            self.units = nn.ModuleList(Block(hidden, ffn, fuse) for _ in range(units))

        def forward(self, x):
            for unit in self.units:
                x = unit(x)
            return x

    return Block, Model


def step_stats(step_ms):
    s = sorted(step_ms)
    if not s:
        return {}
    return dict(step_ms_median=round(pct(s, 50), 3), step_ms_p10=round(pct(s, 10), 3),
                step_ms_p90=round(pct(s, 90), 3), step_ms_min=s[0], step_ms_max=s[-1])


# --- summary and report --------------------------------------------------------------------------
def summarize(records):
    """Per group and variant: every repetition's numbers, and the ratios to the hotfix taken
    within each repetition, summarized over repetitions."""
    out = []
    for group, items in itertools.groupby(records, key=lambda r: r["group"]):
        items = list(items)
        good = {(r["variant"], r["rep"]): r["result"] for r in items
                if (r.get("result") or {}).get("ok")}
        rows = []
        for v in VARIANTS:
            runs, time_ratios, mem_ratios = [], [], []
            for r in items:
                if r["variant"] != v["key"]:
                    continue
                res = r.get("result") or {}
                run = dict(rep=r["rep"], ok=bool(res.get("ok")), turn_s=res.get("turn_s"))
                if run["ok"]:
                    run.update({k: res[k] for k in ("step_ms_median", "step_ms_p10",
                                                    "step_ms_p90", "peak_mem_mb")})
                    ref = good.get((REFERENCE, r["rep"]))
                    if ref is not None:
                        time_ratios.append(res["step_ms_median"] / ref["step_ms_median"])
                        mem_ratios.append(res["peak_mem_mb"] / ref["peak_mem_mb"])
                else:
                    run["error"] = res.get("error") or "?"
                runs.append(run)
            ok = [run for run in runs if run["ok"]]
            all_steps = sorted(s for r in items if r["variant"] == v["key"]
                               for s in (r.get("result") or {}).get("step_ms", [])
                               if (r.get("result") or {}).get("ok"))
            rows.append(dict(variant=v["key"], title=v["title"], runs=runs, n_ok=len(ok),
                             pooled=step_stats(all_steps),
                             time_ratio=spread(time_ratios), mem_ratio=spread(mem_ratios)))
        release, zero = group.split(":")
        out.append(dict(group=group, release=release, zero=int(zero), rows=rows))
    return out


def spread(values):
    if not values:
        return None
    return dict(median=round(statistics.median(values), 4), min=round(min(values), 4),
                max=round(max(values), 4), n=len(values))


def describe(doc):
    """One paragraph: what was measured, on what."""
    size = doc["size"]
    first = next((r["result"] for r in doc["records"] if (r.get("result") or {}).get("ok")), {})
    n_params = first.get("n_params") or size["units"] * unit_params(size["hidden"], size["ffn"])
    return (f"{size['units']} units of TE LayerNormLinear(h, 3h) + Linear(h, h) + "
            f"LayerNormMLP(h, ffn), h {size['hidden']}, ffn {size['ffn']}: "
            f"{count(n_params)} parameters, bf16; {size['tokens']} tokens x "
            f"{size['microbatches']} microbatches per step; {size['warmup']} warm-up + "
            f"{size['steps']} timed steps (CUDA events) per run; one process per variant, "
            f"runs taken in turn (A B C D A B C D ...), one at a time on the GPU. "
            f"{first.get('gpu', '?')}, torch {first.get('torch', '?')}, TransformerEngine "
            f"{first.get('te', '?')}; fake 2-rank group with NCCL work semantics; "
            f"{doc.get('date_utc', '?')} UTC.")


def count(n):
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def fmt_ratio(r):
    if r is None:
        return ""
    if r["n"] == 1:
        return f"{r['median']:.3f}"
    return f"{r['median']:.3f} [{r['min']:.3f}–{r['max']:.3f}]"


def render_markdown(doc):
    """The README table: one row per release, ZeRO level and variant."""
    lines = [describe(doc), "",
             "| release | ZeRO | variant | runs | median step ms (each run) | p10–p90 ms (each run)"
             " | peak allocated MB | step time / hotfix, median [min–max] over runs"
             " | peak memory / hotfix |",
             "|---|---|---|---|---|---|---|---|---|"]
    for g in doc["summary"]:
        for row in g["rows"]:
            ok = [run for run in row["runs"] if run["ok"]]
            failed = [run for run in row["runs"] if not run["ok"]]
            meds = ", ".join(f"{run['step_ms_median']:.1f}" for run in ok)
            p1090 = ", ".join(f"{run['step_ms_p10']:.1f}–{run['step_ms_p90']:.1f}" for run in ok)
            peaks = ", ".join(sorted({f"{run['peak_mem_mb']:.0f}" for run in ok}))
            if failed:
                meds += ("; " if meds else "") + f"{len(failed)} failed: {failed[0]['error'][:80]}"
            lines.append(f"| {g['release']} | {g['zero']} | {row['title']} | {len(ok)} | {meds} "
                         f"| {p1090} | {peaks} | {fmt_ratio(row['time_ratio'])} "
                         f"| {fmt_ratio(row['mem_ratio'])} |")
    for s in doc.get("skipped", []):
        lines.append(f"\nNot run: {s['group']} ({s['reason']}).")
    return "\n".join(lines)


def compact_table(doc):
    flop = gemm_flop(doc["size"])
    lines = [f"{'group':<15} {'variant':<9} {'ok':>2} {'median ms':>9} {'p10':>7} {'p90':>7} "
             f"{'TFLOP/s':>7} {'t/hotfix [min-max]':>22} {'peak MB':>8} {'m/hotfix':>8}"]
    nan = float("nan")
    for g in doc["summary"]:
        for row in g["rows"]:
            p = row["pooled"]
            peaks = [run["peak_mem_mb"] for run in row["runs"] if run["ok"]]
            median = p.get("step_ms_median", nan)
            lines.append(
                f"{g['group']:<15} {row['variant']:<9} {row['n_ok']:>2} {median:>9.2f} "
                f"{p.get('step_ms_p10', nan):>7.2f} {p.get('step_ms_p90', nan):>7.2f} "
                f"{flop / median / 1e9:>7.1f} {fmt_ratio(row['time_ratio']):>22} "
                f"{(max(peaks) if peaks else nan):>8.0f} "
                f"{(row['mem_ratio'] or {}).get('median', nan):>8.3f}")
    for s in doc.get("skipped", []):
        lines.append(f"skipped {s['group']}: {s['reason']}")
    return "\n".join(lines)


def short(rec):
    res = rec["result"]
    head = f"{rec['group']} rep{rec['rep']} {rec['variant']:<8}"
    if res.get("ok"):
        return (f"ok   {head} median {res['step_ms_median']:.2f} ms [p10 {res['step_ms_p10']:.2f}"
                f" p90 {res['step_ms_p90']:.2f}] {res.get('gemm_tflops')} TFLOP/s peak "
                f"{res['peak_mem_mb']:.0f} MB turn {res.get('turn_s')} s")
    return f"FAIL {head}: {res.get('error')}"


def short_start(spec, info):
    head = f"{spec['group']} {spec['variant']:<8}"
    if info.get("ok"):
        return (f"up   {head} in {info.get('start_s')} s {info.get('phases_s')} "
                f"hotfix {info.get('hotfix_state', 'not loaded')} {info.get('hotfix_applied', '')}")
    return f"DOWN {head}: {info.get('error') or info.get('invalid')}"


def gpu_state():
    """Clocks, temperature and power as nvidia-smi reads them (settings are left alone)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,"
                               "clocks.max.sm,temperature.gpu,power.draw,memory.used",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi unavailable: {e}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="the one JSON to write")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repetition")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; smoke 1)")
    ap.add_argument("--groups", default=None,
                    help="comma list of release:ZeRO, in run order (default: "
                         + ",".join(GROUPS["full"]) + ")")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=220.0,
                    help="no group starts that would not finish within this many seconds")
    ap.add_argument("--hard-limit-s", type=float, default=300.0,
                    help="no turn starts that could end later than this (the machine's "
                         "limit, less TransformerEngine's setup)")
    ap.add_argument("--ready-timeout-s", type=float, default=150.0,
                    help="per worker start-up (imports, build, first warm-up)")
    ap.add_argument("--turn-timeout-s", type=float, default=120.0)
    ap.add_argument("--wheels", default=os.path.join(VALIDATION, "wheels"))
    ap.add_argument("--dry", action="store_true", help="print the plan and exit (no GPU)")
    ap.add_argument("--report", metavar="JSON", help="print the markdown table of a result")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # a worker: its spec as JSON
    a = ap.parse_args(argv)
    if a.serve:
        spec = json.loads(a.serve)
        serve(lambda info: setup(spec, info))
    if a.report:
        with open(a.report) as f:
            print(render_markdown(json.load(f)))
        return 0
    mode = "smoke" if a.smoke else "full"
    size = dict(SIZES[mode])
    size.update({k: v for k, v in (("steps", a.steps), ("warmup", a.warmup)) if v is not None})
    reps = a.reps if a.reps is not None else (1 if a.smoke else 3)
    groups = plan(a.groups.split(",") if a.groups else GROUPS[mode], reps, size)
    if a.dry:
        print(f"{len(groups)} groups, {sum(len(turns(g)) for g in groups)} turns, "
              f"{size['units'] * unit_params(size['hidden'], size['ffn'])} parameters")
        for g in groups:
            for rep, i in turns(g):
                print(f"{g['group']} rep{rep} {g['workers'][i]['variant']}")
        return 0
    if not a.out:
        ap.error("--out is required")
    t0 = time.time()
    rel_paths = unpack_releases(a.wheels)
    missing = sorted({g["release"] for g in groups} - set(rel_paths))
    if missing:
        raise SystemExit(f"no wheel for {missing} in {a.wheels}")
    logdir = "/tmp/safe_choices_logs"  # not under $OUT, which keeps only the results
    os.makedirs(logdir, exist_ok=True)

    def start_worker(spec):
        name = f"{spec['release']}_z{spec['zero']}_{spec['variant']}"
        return Worker([sys.executable, os.path.abspath(__file__), "--serve", json.dumps(spec)],
                      worker_env(spec, rel_paths), os.path.join(logdir, name + ".log"),
                      a.ready_timeout_s, a.turn_timeout_s)

    doc = dict(date_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()), mode=mode, size=size,
               reps=reps, groups=[g["group"] for g in groups], budget_s=a.budget_s,
               hard_limit_s=a.hard_limit_s, gpu_before=gpu_state(), variants=VARIANTS)

    def write(records, started, skipped, final=False):
        """Written after every turn, so a call cut short still returns what it measured."""
        doc.update(records=records, workers=started, skipped=skipped,
                   summary=summarize(records), complete=final,
                   wall_s=round(time.time() - t0, 1))
        if final:
            doc["gpu_after"] = gpu_state()
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    records, started, skipped = drive(groups, start_worker, a.budget_s, a.hard_limit_s,
                                      after_each=write)
    write(records, started, skipped, final=True)
    print(compact_table(doc))
    ok = sum(1 for r in records if r["result"].get("ok"))
    print(f"wall {doc['wall_s']} s; {ok} of {len(records)} turns ok; JSON: {a.out}")
    return 0 if records and ok == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
