"""The change proposed upstream (``upstream/``), applied to the copies the tests already have.

``upstream/main.patch`` is a unified diff against NVIDIA/Megatron-LM ``main`` (d98e8a64dd) and
``upstream/pr6316.patch`` the same change against the head of NVIDIA PR #6316 (f7b65d4a2e), whose
drain reads its pool size from ``fsdp_buffer_count``. Without a Megatron-LM clone they are
applied to the trees CI rebuilds: main's drain, getter and wait are the megatron-fsdp 0.6.1
wheel's (the same fingerprints, ``snapshots.MAIN_ERA_C``), so ``main.patch`` is applied to that
wheel's copy; ``pr6316.patch`` to the rebuilt PR #6316 (``snapshots.py``). With a clone
(``MFSDP_TEST_MEGATRON_LM``) they are applied to the real trees too.
``upstream/core_linear.patch``, a change of its own to megatron-core's fused linear against
``main``, has no rebuilt tree: it is applied (:func:`apply_at`) to main's real ``megatron/core``,
from a clone.

:func:`apply` is strict: every hunk's old lines (context and removed) must occur exactly once in
the target file, or the patch "does not apply"; nothing is fuzzed.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import releases
import snapshots

UPSTREAM = releases.REPO / "upstream"
MAIN_PATCH = UPSTREAM / "main.patch"
PR6316_PATCH = UPSTREAM / "pr6316.patch"
# The upstream-style regression test, in Megatron-LM's layout under upstream/.
UPSTREAM_TEST = (UPSTREAM / "tests" / "unit_tests" / "distributed" / "mfsdp_v1"
                 / "test_mfsdp_grad_reduce_ordering.py")
# Where the patches' file lives in Megatron-LM (the vendored package).
VENDORED = "megatron/core/distributed/fsdp/src/megatron_fsdp/"
# The change of its own to megatron-core's fused linear (tensor_parallel/layers.py), against
# main, and its upstream-style test.
CORE_LINEAR_PATCH = UPSTREAM / "core_linear.patch"
CORE_LINEAR_TEST = (UPSTREAM / "tests" / "unit_tests" / "tensor_parallel"
                    / "test_mfsdp_fused_wgrad_accumulation.py")


class DoesNotApply(Exception):
    """A hunk's old lines are not in the target file exactly once."""


@dataclass(frozen=True)
class Hunk:
    old: list[str]
    new: list[str]


def parse(patch: str) -> dict[str, list[Hunk]]:
    """The hunks of a unified diff, per file (the ``b/`` path)."""
    files: dict[str, list[Hunk]] = {}
    current: list[Hunk] | None = None
    hunk: Hunk | None = None
    for line in patch.splitlines(keepends=True):
        if line.startswith("+++ "):
            current = files.setdefault(re.sub(r"^b/", "", line[4:].strip()), [])
            hunk = None
        elif line.startswith("@@"):
            assert current is not None, "hunk before a file header"
            hunk = Hunk([], [])
            current.append(hunk)
        elif hunk is not None and line[:1] in (" ", "-", "+"):
            if line[0] != "+":
                hunk.old.append(line[1:])
            if line[0] != "-":
                hunk.new.append(line[1:])
    return files


def apply(patch: Path, package: Path) -> list[str]:
    """Apply ``patch`` to the Megatron-FSDP package folder ``package`` (its files named as in
    Megatron-LM, under :data:`VENDORED`); returns the files changed. Raises DoesNotApply."""
    changed = []
    for name, hunks in parse(patch.read_text()).items():
        if not name.startswith(VENDORED):
            raise DoesNotApply(f"{name} is outside {VENDORED}")
        _apply_hunks(patch, hunks, package / name[len(VENDORED):])
        changed.append(name)
    return changed


def apply_at(patch: Path, root: Path) -> list[str]:
    """Apply ``patch`` to a tree ``root`` that holds its files at their Megatron-LM paths
    (``megatron/core/...``), as strictly as :func:`apply`; returns the files changed."""
    changed = []
    for name, hunks in parse(patch.read_text()).items():
        _apply_hunks(patch, hunks, root / name)
        changed.append(name)
    return changed


def _apply_hunks(patch: Path, hunks: list[Hunk], target: Path) -> None:
    text = target.read_text()
    for number, hunk in enumerate(hunks, 1):
        old, new = "".join(hunk.old), "".join(hunk.new)
        found = text.count(old)
        if found != 1:
            raise DoesNotApply(f"{patch.name} hunk {number}: its old lines occur {found} "
                               f"times in {target}")
        text = text.replace(old, new)
    target.write_text(text)


@dataclass(frozen=True)
class Tree:
    """One patched copy: the tree it starts from, the patch, and the pool sizes it offers."""

    name: str
    source: str  # "0.6.1" (the megatron-fsdp wheel), "snapshot:pr6316" or "git:<ref>"
    patch: Path
    what: str

    def base(self) -> Path | None:
        """The unpatched tree (a ``sys.path`` folder holding ``megatron_fsdp``)."""
        if self.source.startswith("git:"):
            return releases.git_tree(self.source[4:])
        if self.source.startswith("snapshot:"):
            return snapshots.cached(self.source[9:])
        return releases.unpacked("megatron-fsdp", self.source)


TREES = {t.name: t for t in (
    Tree("main-on-0.6.1", "0.6.1", MAIN_PATCH,
         "upstream/main.patch on megatron-fsdp 0.6.1 (main's drain, getter and wait)"),
    Tree("pr6316-rebuilt", "snapshot:pr6316", PR6316_PATCH,
         "upstream/pr6316.patch on PR #6316 rebuilt from megatron-fsdp 0.6.1"),
    Tree("main", "git:main", MAIN_PATCH, "upstream/main.patch on NVIDIA main"),
    Tree("pr6316", "git:pull-request/6316", PR6316_PATCH, "upstream/pr6316.patch on PR #6316"),
)}


def patched(name: str) -> Path | None:
    """The patched copy ``name`` (standalone ``megatron_fsdp`` layout), built once per patch text
    into the test cache; None where its base needs a Megatron-LM clone that is not there."""
    tree = TREES[name]
    base = tree.base()
    if base is None:
        return None
    digest = hashlib.sha256(tree.patch.read_bytes()).hexdigest()[:12]
    target = releases.CACHE / "upstream-patched" / f"{name}-{digest}"
    if not (target / ".complete").exists():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(base, target, ignore=shutil.ignore_patterns(".complete"))
        apply(tree.patch, target / "megatron_fsdp")
        (target / ".complete").touch()
    return target


def vendored_layout(tree: Path, target: Path) -> Path:
    """``tree``'s ``megatron_fsdp`` copied to where Megatron-LM keeps it (the parent folders
    left as namespace packages, so nothing else of megatron-core is needed); returns the
    ``sys.path`` folder."""
    shutil.copytree(tree / "megatron_fsdp", target / VENDORED)
    return target
