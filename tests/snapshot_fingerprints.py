"""Development-time check (not run in CI, which cannot reach GitHub): recompute the fingerprints
that ``snapshots.py`` records, from the real files.

    python tests/snapshot_fingerprints.py --nvidia NVIDIA-Megatron-LM.git [--rocm ROCM_PGB.py]

``--nvidia``: a git directory of NVIDIA/Megatron-LM holding the recorded commits (a clone or a
mirror); the file and the version label are read with ``git show COMMIT:PATH``.
``--rocm``: ROCm/Megatron-LM's ``param_and_grad_buffer.py`` at the recorded commit, saved from
GitHub (the ROCm #146 snapshot is that file with :func:`snapshots.apply_pr146` applied); without
it the ROCm rows are skipped (and said so).
The label of a megatron-fsdp snapshot (PR #6316) is read from its ``megatron_fsdp/package_info.py``.
Prints one row per snapshot and exits 1 if any recorded fingerprint or label differs.

``--run``: also run each NVIDIA snapshot's real Megatron-FSDP package (the ``megatron_fsdp`` folder
of the commit, laid out as the megatron-fsdp distribution with its own ``package_info`` label)
through the CPU happens-before harness, without and with the hotfix (about 20 s a snapshot).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import snapshots  # noqa: E402

from mfsdp_hotfix import fingerprints, registry  # noqa: E402

VENDORED = "megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py"


def three_fingerprints(buffer_file: Path) -> tuple[str, ...]:
    tree = fingerprints.parse_file(buffer_file)
    return tuple(fingerprints.fp_code(tree.source(name)) for name in registry.FUNCTIONS)


PACKAGE_INFO = {"megatron-core": "megatron/core/package_info.py",
                "megatron-fsdp": str(Path(VENDORED).parent / "package_info.py")}


def core_label(git_dir: str, commit: str, distribution: str = "megatron-core") -> str:
    """``distribution``'s version at ``commit`` as ``pip install`` would build it (no git hash)."""
    text = subprocess.run(["git", "--git-dir", git_dir, "show",
                           f"{commit}:{PACKAGE_INFO[distribution]}"],
                          check=True, capture_output=True, text=True).stdout
    parts = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE) = '?([^'\n]*)'?$", text, re.M))
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts['PRE_RELEASE']}"


def run_real_package(git_dir: str, commit: str, scratch: Path) -> str:
    """The real package at ``commit`` through the selftest harness: one line per hotfix mode."""
    from mfsdp_hotfix.selftest.runner import run_case
    from mfsdp_hotfix.selftest.spec import CaseSpec

    root = scratch / f"real-{commit[:10]}"
    root.mkdir()
    package = str(Path(VENDORED).parent)
    archive = subprocess.run(["git", "--git-dir", git_dir, "archive", commit, package],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / package).rename(root / "megatron_fsdp")
    shutil.rmtree(root / "megatron")
    info = (root / "megatron_fsdp" / "package_info.py").read_text()
    parts = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE) = '?([^'\n]*)'?$", info, re.M))
    label = f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts['PRE_RELEASE']}"
    snapshots.write_label(root, "megatron-fsdp", label)
    rows = []
    for hotfix in ("off", "on"):
        result = run_case(CaseSpec(flavour="standalone", path=str(root), hotfix=hotfix))
        status = result.hotfix_status if isinstance(result.hotfix_status, dict) else {}
        copies = status.get("copies") or [{}]
        fixes = {k: v["state"] for k, v in copies[0].get("fixes", {}).items()}
        outcome = ("CRASH " + (result.exception or "").splitlines()[0][:60] if result.crashed
                   else f"max|err| {result.max_abs_grad_error} unordered "
                        f"{result.ordering_violations}/{result.ordering_checks}")
        rows.append(f"    megatron-fsdp {label} hotfix={hotfix}: era {copies[0].get('era')}, "
                    f"{outcome}, fixes {fixes}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvidia", required=True, help="git dir of NVIDIA/Megatron-LM")
    parser.add_argument("--rocm", type=Path,
                        help=f"ROCm param_and_grad_buffer.py @{snapshots.ROCM_BUFFER}")
    parser.add_argument("--run", action="store_true",
                        help="also run each NVIDIA snapshot's real package, hotfix off and on")
    args = parser.parse_args()
    failed = False
    with tempfile.TemporaryDirectory() as scratch:
        for snapshot in snapshots.SNAPSHOTS.values():
            real = Path(scratch) / f"{snapshot.name}.py"
            label_note = ""
            if snapshot.repository == snapshots.ROCM and args.rocm is None:
                print(f"{snapshot.name:16} skipped: no --rocm file")
                continue
            if snapshot.repository == snapshots.ROCM:
                shutil.copyfile(args.rocm, real)
                if snapshot.pr146:
                    snapshots.apply_pr146(real)
            else:
                real.write_bytes(subprocess.run(
                    ["git", "--git-dir", args.nvidia, "show", f"{snapshot.commit}:{VENDORED}"],
                    check=True, capture_output=True).stdout)
                label = core_label(args.nvidia, snapshot.commit, snapshot.distribution)
                recorded = (snapshot.label or "").split("+")[0]
                label_note = f" label {label}" + ("" if label == recorded else " MISMATCH")
                failed |= label != recorded
            found = three_fingerprints(real)
            same = found == snapshot.fingerprints
            failed |= not same
            print(f"{snapshot.name:16} {snapshot.repository}@{snapshot.commit[:10]} "
                  f"{'matches' if same else 'DIFFERS'}{label_note}: "
                  + " ".join(f[:12] for f in found))
            if args.run and snapshot.repository == snapshots.NVIDIA:
                print(run_real_package(args.nvidia, snapshot.commit, Path(scratch)), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
