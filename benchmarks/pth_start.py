#!/usr/bin/env python3
"""What the installed ``mfsdp_hotfix.pth`` costs every Python process: ``python -c pass`` in an
environment with the ``.pth`` against the same environment without it, as paired ratios.

    python3 benchmarks/pth_start.py [--pairs 41] [--ref REF] --out FILE
    python3 benchmarks/pth_start.py --report FILE

Two virtual environments (``--without-pip``) hold this checkout's package in site-packages, as
the wheel installs it; one also holds ``mfsdp_hotfix.pth`` at the root of site-packages, where
``site`` executes it. ``--ref REF`` adds a third, with the package and ``.pth`` of a git
revision (e.g. the one before a change). Each round starts every environment's interpreter once,
in a rotating order, and divides each start's wall time by the same round's start without the
``.pth``: machine load that changes between rounds cancels in the ratio. The median ratio is the
figure; the record also holds every time and the modules the ``.pth`` adds to ``sys.modules``.

Not a test: nothing here asserts a time (tests/test_bootstrap.py holds the module list).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "mfsdp_hotfix"
WITHOUT = "without .pth"
WITH = "with .pth"
GOAL = 1.10  # median start with the .pth over without: "harmless to leave installed"


def _venv(root: str, name: str, package: str, pth: bool) -> str:
    """A venv holding ``package`` (a folder) in site-packages, and its .pth when ``pth``."""
    folder = os.path.join(root, name.replace(" ", "-").replace(".", ""))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder], check=True)
    python = os.path.join(folder, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    purelib = site.stdout.strip()
    shutil.copytree(package, os.path.join(purelib, PACKAGE),
                    ignore=shutil.ignore_patterns("__pycache__"))
    if pth:
        shutil.copy(os.path.join(package, f"{PACKAGE}.pth"), purelib)
    for _ in range(3):  # bytecode written, caches warm
        subprocess.run([python, "-c", "pass"], check=True, env=_env())
    return python


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("MFSDP_", "PYTHON", "VIRTUAL_ENV"))}


def _checkout(ref: str, root: str) -> str:
    """The package folder of git revision ``ref``."""
    archive = os.path.join(root, "ref.tar")
    subprocess.run(["git", "-C", REPO, "archive", "-o", archive, ref, PACKAGE], check=True)
    target = os.path.join(root, "ref")
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return os.path.join(target, PACKAGE)


def _start(python: str) -> float:
    env = _env()
    began = time.perf_counter()
    subprocess.run([python, "-c", "pass"], check=True, env=env)
    return time.perf_counter() - began


def _added_modules(python: str, bare: str) -> list[str]:
    code = "import sys; print(' '.join(sorted(sys.modules)))"
    run = [subprocess.run([p, "-c", code], capture_output=True, text=True, check=True,
                          env=_env()).stdout.split() for p in (python, bare)]
    return sorted(set(run[0]) - set(run[1]))


def measure(pairs: int, ref: str | None) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as root:
        here = os.path.join(REPO, PACKAGE)
        variants = {WITHOUT: _venv(root, WITHOUT, here, pth=False),
                    WITH: _venv(root, WITH, here, pth=True)}
        if ref:
            variants[f"with .pth at {ref}"] = _venv(root, "ref", _checkout(ref, root), pth=True)
        names = list(variants)
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(pairs):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(_start(variants[name]))
        modules = {name: _added_modules(variants[name], variants[WITHOUT]) for name in names
                   if name != WITHOUT}
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    return {"benchmark": "python -c pass, paired by round", "pairs": pairs,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M:%S"),
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
            "checkout": commit, "ref": ref, "seconds": times, "modules_added": modules}


def report(path: str) -> None:
    with open(path) as handle:
        data = json.load(handle)
    times = data["seconds"]
    base = times[WITHOUT]
    print(f"Python {data['python']}, {data['cpus']} CPUs, {data['pairs']} rounds, "
          f"{data['date_utc']} UTC\n")
    print("| environment | median start ms | start / without .pth, median [p10–p90] over "
          "rounds | modules the .pth adds |")
    print("|---|---|---|---|")
    for name, values in times.items():
        ratios = [t / b for t, b in zip(values, base, strict=True)]
        deciles = statistics.quantiles(ratios, n=10)
        added = data["modules_added"].get(name)
        print(f"| {name} | {statistics.median(values) * 1000:.1f} | "
              f"{statistics.median(ratios):.3f} [{deciles[0]:.3f}–{deciles[-1]:.3f}] | "
              + ("—" if added is None else f"{len(added)}: {', '.join(added)}") + " |")
    median = statistics.median(t / b for t, b in zip(times[WITH], base, strict=True))
    print(f"\nGoal: a median ratio of at most {GOAL:.2f} with the .pth: "
          + ("met" if median <= GOAL else "not met") + f" ({median:.3f}).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=41, help="rounds (default 41)")
    parser.add_argument("--ref", help="also measure the package of this git revision")
    parser.add_argument("--out", help="write the record here")
    parser.add_argument("--report", metavar="FILE", help="print the table of a record")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    if not args.out:
        parser.error("--out FILE (or --report FILE)")
    data = measure(args.pairs, args.ref)
    with open(args.out, "w") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")
    report(args.out)


if __name__ == "__main__":
    main()
