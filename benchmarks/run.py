#!/usr/bin/env python3
"""CPU micro-benchmarks of mfsdp_hotfix's hot path and of its import cost. Prints a table.

    python3 benchmarks/run.py [--quick]

1. ns per ``param.get_main_grad()`` call: the release's getter as bound by Megatron-FSDP versus
   the same getter rebound by ``mfsdp_hotfix.fixes.getter_guard.link`` (weak reference to the
   pipeline, then ``_enforce_double_buffer_limit``), with the release's own drain and with the
   hotfix's ``ordered-drain`` replacement (a wrapt wrapper). Torch is not needed: the objects are
   minimal stand-ins with the release's attribute layout (``_gbuf``, ``_item_id``,
   ``parameter_groups[*].fsdp_unit_id``, ``grad_reduce_queue`` of ``(event, free, bucket_id)``,
   ``double_buf_units``); the drain logic is the 0.18 release's, the getter does the release's
   attribute work with a no-op fetch. What is measured is the Python overhead the hotfix adds per
   call, in the steady state of backward (two units live, nothing to retire).
2. Interpreter start: ``python -X importtime -c "import mfsdp_hotfix"`` versus a bare interpreter,
   median wall time of repeated starts, and the cumulative import time importtime reports.

Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import timeit
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


# --- minimal stand-ins with the release's attribute layout ------------------------------------
class Event:
    def wait(self):
        pass


class Group:
    def __init__(self, unit):
        self.fsdp_unit_id = unit
        self.params = []


class GBuf:
    def __init__(self, bucket_id):
        self.bucket_id = bucket_id
        self.is_data_distributed = True
        self._bucket = object()

    def fetch_bucket(self, dtype=None):
        return self._bucket

    def get_item_from_bucket(self, bucket, item_id):
        return bucket


class Param:
    """A plain object with a __dict__, like an nn.Parameter's instance attributes."""


class DDPConfig:
    fsdp_double_buffer = True


class Buffer:
    def __init__(self, n_units):
        self.ddp_config = DDPConfig()
        self.parameter_groups = [Group(u) for u in range(n_units)]
        self.double_buf_units = list(range(n_units))


class GradReducePipeline:
    """The release's drain (0.18 body: threshold ``> 1``, drain under the rs_stream context;
    the stream context is a no-op stand-in here)."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.grad_reduce_queue = []

    def wait_for_previous_grad_reduce(self, suggested_queue_size=1, suggested_queue_capacity=None):
        suggested_queue_size = max(0, min(suggested_queue_size, len(self.buffer.parameter_groups) - 1))
        while len(self.grad_reduce_queue) > suggested_queue_size:
            ev, free, _ = self.grad_reduce_queue.pop(0)
            ev.wait()
            free()

    def _enforce_double_buffer_limit(self, add_buckets):
        if not self.buffer.ddp_config.fsdp_double_buffer:
            return
        groups = self.buffer.parameter_groups
        units = set()
        for b in add_buckets:
            u = groups[b].fsdp_unit_id
            if u in self.buffer.double_buf_units:
                units.add(u)
        assert len(units) <= 2
        keep_n = len(self.grad_reduce_queue)
        for _, _, b in reversed(self.grad_reduce_queue):
            units.add(groups[b].fsdp_unit_id)
            if len(units) > 2:
                keep_n -= 1
        self.wait_for_previous_grad_reduce(keep_n)


class Model:
    def __init__(self, buffer, pipeline):
        self.param_and_grad_buffer = buffer
        self.grad_reduce_pipeline = pipeline


def build(n_units=8):
    buffer = Buffer(n_units)
    pipeline = GradReducePipeline(buffer)

    def main_grad_getter(p):  # the release's attribute work, no tensor ops
        bucket = p._gbuf.fetch_bucket(dtype=None if p._gbuf.is_data_distributed else None)
        gbuf = p._gbuf
        item_id = p._item_id
        return gbuf.get_item_from_bucket(bucket, item_id)

    params = []
    for u, group in enumerate(buffer.parameter_groups):
        p = Param()
        p._gbuf = GBuf(u)
        p._item_id = 0
        p.get_main_grad = main_grad_getter.__get__(p)
        group.params.append(p)
        params.append(p)
    # steady state of backward: unit 5's bucket is being filled, unit 6's reduce-scatter is in
    # flight; the getter for unit 5 must retire nothing
    pipeline.grad_reduce_queue = [(Event(), lambda: None, 6)]
    return Model(buffer, pipeline), params[5]


def ns_per_call(fn, number):
    best = min(timeit.repeat(fn, number=number, repeat=7))
    return best / number * 1e9


def getter_rows(number):
    from mfsdp_hotfix.fixes import getter_guard, ordered_drain

    rows = []
    model, p = build()
    rows.append(("release getter (as bound by Megatron-FSDP)", ns_per_call(p.get_main_grad, number)))
    getter_guard.link(model)
    assert getter_guard.is_guarded(p)
    rows.append(("+ getter-guard (release drain)", ns_per_call(p.get_main_grad, number)))
    module = types.ModuleType("standin_pgb")
    module.GradReducePipeline = GradReducePipeline
    undo = ordered_drain.apply(module)
    try:
        rows.append(("+ getter-guard + ordered-drain",
                     ns_per_call(p.get_main_grad, number)))
        enforce = model.grad_reduce_pipeline._enforce_double_buffer_limit
        rows.append(("ordered-drain alone: _enforce_double_buffer_limit([5])",
                     ns_per_call(lambda: enforce([5]), number)))
    finally:
        undo()
    enforce = model.grad_reduce_pipeline._enforce_double_buffer_limit
    rows.append(("release drain alone: _enforce_double_buffer_limit([5])",
                 ns_per_call(lambda: enforce([5]), number)))
    getter_guard.unlink(model)
    return rows


def start_rows(starts):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MFSDP_HOTFIX", None)
    # Measure what an installed wheel costs: pip compiles bytecode at install time, so compile
    # first and let the interpreter use it (PYTHONDONTWRITEBYTECODE would force a recompile).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(REPO, "mfsdp_hotfix")],
                   env=env, check=True, stdout=subprocess.DEVNULL)

    def wall(code):
        times = []
        for _ in range(starts):
            t = timeit.default_timer()
            subprocess.run([sys.executable, "-c", code], env=env, check=True)
            times.append(timeit.default_timer() - t)
        return statistics.median(times) * 1e3, min(times) * 1e3, max(times) * 1e3

    def importtime(code):
        r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env,
                           capture_output=True, text=True, check=True)
        mods = {}
        for line in r.stderr.splitlines():
            m = re.match(r"import time:\s+(\d+)\s*\|\s*(\d+)\s*\|(\s*)(\S+)", line)
            if m:
                mods[m.group(4)] = (int(m.group(1)), int(m.group(2)), len(m.group(3)))
        return mods

    bare = wall("pass")
    hot = wall("import mfsdp_hotfix")
    mods = importtime("import mfsdp_hotfix")
    base = importtime("pass")
    mods = {k: v for k, v in mods.items() if k not in base}  # what the import adds
    top = mods.get("mfsdp_hotfix", (0, 0, 0))
    ours = {k: v for k, v in mods.items() if k.startswith("mfsdp_hotfix")}
    heavy = [k for k in mods if k.split(".")[0] in ("torch", "megatron", "megatron_fsdp", "numpy")]
    return bare, hot, top, ours, heavy, mods


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    number = 20_000 if a.quick else 200_000
    starts = 5 if a.quick else 21
    print(f"python {sys.version.split()[0]} on {sys.platform}; best of 7 x {number} calls\n")
    print("| getter path (steady state, nothing to retire) | ns per call |")
    print("|---|---|")
    for name, ns in getter_rows(number):
        print(f"| {name} | {ns:.0f} |")
    bare, hot, top, ours, heavy, mods = start_rows(starts)
    print(f"\n| interpreter start ({starts} starts each) | median ms | min ms | max ms |")
    print("|---|---|---|---|")
    print(f"| `python -c pass` | {bare[0]:.1f} | {bare[1]:.1f} | {bare[2]:.1f} |")
    print(f"| `python -c 'import mfsdp_hotfix'` | {hot[0]:.1f} | {hot[1]:.1f} | {hot[2]:.1f} |")
    print(f"| difference of medians | {hot[0] - bare[0]:.1f} | | |")
    print(f"\n`-X importtime`: mfsdp_hotfix cumulative {top[1]} us (self {top[0]} us); "
          f"{len(ours)} mfsdp_hotfix modules imported: {', '.join(sorted(ours))}; "
          f"heavy packages imported at `import mfsdp_hotfix`: {', '.join(heavy) or 'none'}")
    new = sorted(((v[1], k) for k, v in mods.items() if not k.startswith("mfsdp")), reverse=True)
    print("other modules that `import mfsdp_hotfix` adds to a bare interpreter (cumulative us): "
          + (", ".join(f"{k} {t}" for t, k in new) or "none"))


if __name__ == "__main__":
    main()
