"""A Megatron-LM checkout staged for a call: its ``megatron/training`` checked against the
wheel's by content, and its scripts, pytest options and ``tests/`` copied into the run's own
folder (so the checkout's ``megatron/`` never shadows the wheel)."""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any

import workdir

from .plan import RELEASES, UNIT_TESTS

# the Megatron-LM revision each wheel's megatron/training was found identical to (the check is
# by content, training_differences; these names are what the docs tell users to check out)
REVISIONS = {"core-0.19.2": "core_r0.19.0", "core-0.18.2": "core_v0.18.2"}
SCRIPTS = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")


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
