"""Megatron-FSDP copies that are not PyPI releases, rebuilt for the tests: the ROCm/Megatron-LM fork
before and after its PR #146, git snapshots of NVIDIA/Megatron-LM ``main`` between releases, and
NVIDIA PR #6316 (``fsdp_buffer_count``: gradient pools of N slots).

CI cannot reach GitHub and this project commits no upstream code, so each snapshot is kept as
facts: where its real code lives, the version label it installs with, and the fingerprints of the
three functions the hotfix judges, computed from the real files by ``snapshot_fingerprints.py``
(run by hand where GitHub is reachable). A test rebuilds the snapshot from the release wheel whose
three functions have the same shapes, applies the snapshot's own edit (ROCm PR #146's change, or
PR #6316's, written here as source transformations of what the PRs change), rewrites the version
label, and first asserts that the rebuilt copy reproduces the recorded fingerprints exactly.

What a rebuilt copy is not: the rest of the real files (ROCm's mori SDMA all-gather, the other
changes on main between releases, PR #6316's all-gather capacity check). Detection reads only the
three functions; a run on a rebuilt copy runs the release's code around them.

``python tests/snapshots.py build NAME DEST [--buffer-count N]`` writes one rebuilt copy into the
folder DEST, ready for ``PYTHONPATH`` (with its dist-info label), e.g. to run it where there is a
GPU; ``--buffer-count`` (PR #6316 only) makes N the default ``fsdp_buffer_count``, for harnesses
that cannot pass the option.
"""

from __future__ import annotations

import ast
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # run as a script: this checkout's package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import releases  # noqa: E402

from mfsdp_hotfix import registry  # noqa: E402

VENDORED = Path("megatron/core/distributed/fsdp/src/megatron_fsdp")

# fp_code of the three functions (getter, drain, wait) in the real files, as printed by
# snapshot_fingerprints.py; written out rather than taken from the registry, so that a registry
# edit cannot move them.
ROCM_146 = ("b992c40694c29476c06e9130a98839175f6792c6d127b5fea17e37e067219d75",
            "9b70f49286019d5cb6b84bb6e52df6025f9d3c118579eabc67a4aa062ffcb2bd",
            "18a7000ad753206566df235d409814de9319429954a1f2761717b20d53920b2e")
ROCM_BEFORE_146 = ("991107f2e75eaa6e2f5567049a45235be088a70697e281c937dd01ce2e69f495",
                   "cc2d1fa2642c351d39147350dafca5a1a00903f1269e5a7fd9308f62e9c1ee85",
                   "18a7000ad753206566df235d409814de9319429954a1f2761717b20d53920b2e")
MAIN_ERA_A = ("0480c5a8ac2347fe62a2103b10b13f88a227086cd017499eba3c1b10ae2f07ff",
              "cc2d1fa2642c351d39147350dafca5a1a00903f1269e5a7fd9308f62e9c1ee85",
              "274b821a5fb1391b53f2cc32f68e06300fb7fafb7429e5a54b1f3134b232653f")
MAIN_ERA_B = ("0480c5a8ac2347fe62a2103b10b13f88a227086cd017499eba3c1b10ae2f07ff",
              "a1783b8dc8f20c5e639262da00c959dcff7666e0132ad89868340b10cd3c3578",
              "274b821a5fb1391b53f2cc32f68e06300fb7fafb7429e5a54b1f3134b232653f")
MAIN_ERA_C = ("9536069f4985f747be30ef6fd5b73ba366d0325847d531a9af6629d46f4eb02a",
              "9b70f49286019d5cb6b84bb6e52df6025f9d3c118579eabc67a4aa062ffcb2bd",
              "274b821a5fb1391b53f2cc32f68e06300fb7fafb7429e5a54b1f3134b232653f")
PR_6316 = ("9536069f4985f747be30ef6fd5b73ba366d0325847d531a9af6629d46f4eb02a",
           "2905781ddb8192464df88bd9e17feda7b0be1474a7578bc2c1cfb06d4f862fba",
           "274b821a5fb1391b53f2cc32f68e06300fb7fafb7429e5a54b1f3134b232653f")


@dataclass(frozen=True)
class Snapshot:
    """One non-release copy: its real source, its label, the recorded fingerprints, and how it
    is rebuilt (``base`` release, plus PR #146's edit) and judged (``era``, ``fixes``)."""

    name: str
    repository: str
    commit: str  # of param_and_grad_buffer.py
    distribution: str  # of the label, and of the base release
    label: str | None  # None: no metadata (a source checkout on PYTHONPATH)
    base: str  # the release (of ``distribution``) with the same three shapes
    fingerprints: tuple[str, str, str]
    era: str
    fixes: tuple[str, ...]
    pr146: bool = False
    pr6316: bool = False

    @property
    def package(self) -> Path:
        """The Megatron-FSDP package folder, relative to the ``sys.path`` folder."""
        return VENDORED if self.distribution == "megatron-core" else Path("megatron_fsdp")

    @property
    def copy(self) -> registry.Copy:
        return next(c for c in registry.COPIES if c.distribution == self.distribution)


ROCM, NVIDIA = "ROCm/Megatron-LM", "NVIDIA/Megatron-LM"
ROCM_BUFFER = "5b976d2780f892c0ff24a93daea0ea97a7231974"
BOTH = ("getter-guard", "ordered-drain")
DRAIN_ONLY = ("ordered-drain",)
# trees of 0.16-0.18's hooks, whose parameter pool does not keep a bucket's slot (NVIDIA main
# before it pinned buckets, in July 2026; the ROCm fork on 0.16)
STALE = ("missed-post-backward",)

SNAPSHOTS = {s.name: s for s in (
    Snapshot("rocm-before-146", ROCM, ROCM_BUFFER, "megatron-core", None, "0.16.1",
             ROCM_BEFORE_146, "A", BOTH + STALE),
    Snapshot("rocm-146", ROCM, ROCM_BUFFER, "megatron-core", None, "0.16.1", ROCM_146, "C",
             DRAIN_ONLY + STALE, pr146=True),
    Snapshot("main-b969f764", NVIDIA, "b969f7642c786295adc833c76c56233e77c663bb",
             "megatron-core", "0.16.0rc0", "0.17.1", MAIN_ERA_A, "A", BOTH + STALE),
    Snapshot("main-606ac26e", NVIDIA, "606ac26eaae51ff1300533b7ff917dbddd9b1464",
             "megatron-core", "0.18.0rc0", "0.17.1", MAIN_ERA_A, "A", BOTH + STALE),
    Snapshot("main-fe5291fa", NVIDIA, "fe5291fa40a9f9ac56f4cf0918182d57435bd4bd",
             "megatron-core", "0.18.0rc0+fe5291f", "0.17.1", MAIN_ERA_A, "A", BOTH + STALE),
    Snapshot("main-97e36aab", NVIDIA, "97e36aaba37245e2fa23d4fda0e956ece21e6c9e",
             "megatron-core", "0.18.0rc0", "0.17.1", MAIN_ERA_A, "A", BOTH + STALE),
    Snapshot("main-d199bb9e", NVIDIA, "d199bb9e9f388d8f8136a0c9b25d2bcc53529ffe",
             "megatron-core", "0.19.0+d199bb9", "0.18.2", MAIN_ERA_B, "B", BOTH + STALE),
    Snapshot("main-d98e8a64", NVIDIA, "d98e8a64ddf34856e74b24714e3bedb2f5a39553",
             "megatron-core", "0.20.0+d98e8a6", "0.19.2", MAIN_ERA_C, "C", DRAIN_ONLY),
    # The head of PR #6316 (on dev); its megatron_fsdp/package_info.py says 0.6.0rc0.
    Snapshot("pr6316", NVIDIA, "f7b65d4a2ea145ce13497b4df37572f681c6ac4e", "megatron-fsdp",
             "0.6.0rc0", "0.6.1", PR_6316, "C", DRAIN_ONLY, pr6316=True),
)}


# NVIDIA pull requests with N-slot pools, read from a local clone (``releases.git_tree``): the
# fingerprints of their three functions (``PR_6316``'s for #6316 and the three built on it; #5657
# kept 0.19's drain) and the expression their gradient pool's size is read from.
_CONFIGURED = "self.ddp_config.fsdp_buffer_count"
PULL_REQUESTS = {
    "refs/pull/6316/head": (PR_6316, _CONFIGURED),
    "refs/pull/6317/head": (PR_6316, _CONFIGURED),
    "refs/pull/6318/head": (PR_6316, _CONFIGURED),
    "refs/pull/6665/head": (PR_6316, _CONFIGURED),
    "refs/pull/5657/head": (MAIN_ERA_C, "self.ddp_config.megatron_fsdp_max_pool_buffer_count if "
                                        "self.ddp_config.megatron_fsdp_max_pool_double_buffer "
                                        "else 2"),
}


def build(snapshot: Snapshot, target: Path, *, whole: bool = False) -> Path:
    """Rebuild ``snapshot`` under ``target`` (a ``sys.path`` folder) and return ``target``.

    ``whole``: copy the whole megatron-core release (needed to import it), else only its
    Megatron-FSDP package (enough to detect it).
    """
    source = releases.unpacked(snapshot.distribution, snapshot.base)
    if whole:
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".complete", "*.dist-info"))
    else:
        shutil.copytree(source / snapshot.package, target / snapshot.package)
    if snapshot.repository == ROCM:
        link_pipeline_to_buffer(target / snapshot.package / "megatron_fsdp.py")
    if snapshot.pr146:
        apply_pr146(target / snapshot.package / "param_and_grad_buffer.py")
    if snapshot.pr6316:
        apply_pr6316(target / snapshot.package)
    if snapshot.label is not None:
        write_label(target, snapshot.distribution, snapshot.label)
    return target


def cached(name: str) -> Path:
    """The whole rebuilt copy ``name``, built once into the test cache (``releases.CACHE``)."""
    target = releases.CACHE / "snapshots" / name
    if not (target / ".complete").exists():
        shutil.rmtree(target, ignore_errors=True)
        build(SNAPSHOTS[name], target, whole=True)
        (target / ".complete").touch()
    return target


def write_label(root: Path, distribution: str, version: str) -> None:
    """Minimal dist-info so that ``importlib.metadata`` reports ``distribution==version``."""
    info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")


def apply_pr146(buffer_file: Path) -> None:
    """ROCm/Megatron-LM PR #146's two edits to ``param_and_grad_buffer.py``, as its description
    states them: in ``main_grad_getter``, drain through the buffer's ``grad_reduce_pipeline``
    before ``fetch_bucket()`` and drop the premature fetch; in ``_enforce_double_buffer_limit``,
    run ``wait_for_previous_grad_reduce`` under ``torch.cuda.stream(self.rs_stream)``."""
    lines = buffer_file.read_text().splitlines(keepends=True)
    getter = _span(lines, registry.GETTER)
    premature = _only(lines, getter, "bucket = p._gbuf.fetch_bucket()")
    after = _only(lines, getter, "item_id = p._item_id")
    indent = _indent(lines[after])
    lines[after + 1:after + 1] = [
        f"{indent}self.grad_reduce_pipeline._enforce_double_buffer_limit([gbuf.bucket_id])\n",
        f"{indent}bucket = gbuf.fetch_bucket()\n"]
    del lines[premature]
    drain = _span(lines, registry.DRAIN)
    wait = _only(lines, drain, "self.wait_for_previous_grad_reduce(keep_n)")
    indent = _indent(lines[wait])
    lines[wait:wait + 1] = [f"{indent}with torch.cuda.stream(self.rs_stream):\n",
                            f"{indent}    self.wait_for_previous_grad_reduce(keep_n)\n"]
    buffer_file.write_text("".join(lines))


def apply_pr6316(package: Path) -> None:
    """NVIDIA PR #6316's change to a megatron-fsdp 0.6.x package, as far as the gradient pool
    goes: the config gets ``fsdp_buffer_count: int = 2`` and ``fully_shard_model`` passes it on;
    ``ParamAndGradBuffer`` sizes its pools with it instead of ``UB_BUFFER_NUM = 2``; and
    ``_enforce_double_buffer_limit`` reads it as ``buffer_count`` for its assert (with the PR's
    message) and its retire threshold, still draining under ``torch.cuda.stream(rs_stream)``.
    Not carried over: the PR's all-gather capacity check (``can_allocate``), which leaves the
    release's own limit of 2 units per all-gather, and its config validation."""
    config = package / "distributed_data_parallel_config.py"
    _replace_once(config, "\n    fsdp_all_gather_in_start_param_sync: bool = True\n",
                  '\n    fsdp_buffer_count: int = 2\n    """Number of persistent buffers allocated '
                  'for each Megatron FSDP communication pool."""\n\n'
                  "    fsdp_all_gather_in_start_param_sync: bool = True\n")
    shard = package / "fully_shard.py"
    text = shard.read_text()
    model = _node(ast.parse(text), "fully_shard_model")
    lines = text.splitlines(keepends=True)
    span = range(model.lineno - 1, model.end_lineno or model.lineno)
    passed = _only(lines, span, "fsdp_double_buffer=fsdp_double_buffer or nccl_ub,")
    lines.insert(passed + 1, f"{_indent(lines[passed])}fsdp_buffer_count=fsdp_buffer_count,\n")
    argument = _only(lines, span, "maxpool_double_buffer: bool = False,")
    lines.insert(argument + 1, f"{_indent(lines[argument])}fsdp_buffer_count: int = 2,\n")
    shard.write_text("".join(lines))
    buffer_file = package / "param_and_grad_buffer.py"
    _replace_once(buffer_file, "UB_BUFFER_NUM = 2\n",
                  "UB_BUFFER_NUM = self.ddp_config.fsdp_buffer_count\n")
    lines = buffer_file.read_text().splitlines(keepends=True)
    drain = _span(lines, registry.DRAIN)
    threshold = _only(lines, drain, "if len(double_buf_units) > 2:")
    lines[threshold] = lines[threshold].replace("> 2:", "> buffer_count:")
    check = _only(lines, drain, "assert (")
    assert [line.strip() for line in lines[check + 1:check + 3]] == [
        "len(double_buf_units) <= 2",
        '), f"Double buffer limit exceeded. Current double_buf_units: {double_buf_units}."']
    indent = _indent(lines[check])
    lines[check:check + 3] = [
        f"{indent}assert len(double_buf_units) <= buffer_count, (\n",
        f'{indent}    f"FSDP buffer pool limit ({{buffer_count}}) exceeded. "\n',
        f'{indent}    f"Current double_buf_units: {{double_buf_units}}."\n',
        f"{indent})\n"]
    groups = _only(lines, drain, "param_groups = self.buffer.parameter_groups")
    lines.insert(groups, f"{indent}buffer_count = self.buffer.ddp_config.fsdp_buffer_count\n")
    buffer_file.write_text("".join(lines))


def set_default_buffer_count(package: Path, count: int) -> None:
    """Make ``count`` the default ``fsdp_buffer_count`` of a copy rebuilt with PR #6316's change
    (config and ``fully_shard_model``); the three functions the hotfix judges are untouched."""
    _replace_once(package / "distributed_data_parallel_config.py",
                  "fsdp_buffer_count: int = 2\n", f"fsdp_buffer_count: int = {count}\n")
    _replace_once(package / "fully_shard.py",
                  "fsdp_buffer_count: int = 2,\n", f"fsdp_buffer_count: int = {count},\n")


def _replace_once(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"expected one {old!r} in {path.name}, found {text.count(old)}"
    path.write_text(text.replace(old, new))


def link_pipeline_to_buffer(model_file: Path) -> None:
    """ROCm's ``megatron_fsdp.py`` (@6c421f3840, PR #146's third edit): at the end of building the
    pipelines, ``param_and_grad_buffer.grad_reduce_pipeline`` points at the reduce pipeline."""
    text = model_file.read_text()
    lines = text.splitlines(keepends=True)
    method = _node(ast.parse(text), "MegatronFSDP._init_fsdp_param_and_grad_buffer")
    built = [s for s in method.body if isinstance(s, ast.Assign)
             and any(isinstance(t, ast.Attribute) and t.attr == "all_gather_pipeline"
                     for t in s.targets)]
    assert len(built) == 1, "expected one assignment of self.all_gather_pipeline"
    end = built[0].end_lineno
    assert end is not None
    indent = " " * built[0].col_offset
    lines.insert(end, f"{indent}self.param_and_grad_buffer.grad_reduce_pipeline = "
                      "self.grad_reduce_pipeline\n")
    model_file.write_text("".join(lines))


def _node(tree: ast.AST, qualname: str) -> ast.FunctionDef:
    def walk(node: ast.AST, prefix: str) -> ast.FunctionDef | None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef):
                name = prefix + child.name
                if name == qualname:
                    return child
                found = walk(child, name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                found = walk(child, prefix + child.name + ".")
            else:
                found = walk(child, prefix)
            if found is not None:
                return found
        return None

    found = walk(tree, "")
    assert found is not None, f"{qualname} not found"
    return found


def _span(lines: list[str], qualname: str) -> range:
    node = _node(ast.parse("".join(lines)), qualname)
    assert node.end_lineno is not None
    return range(node.lineno - 1, node.end_lineno)


def _only(lines: list[str], span: range, stripped: str) -> int:
    hits = [i for i in span if lines[i].strip() == stripped]
    assert len(hits) == 1, f"expected one {stripped!r} in lines {span}, found {len(hits)}"
    return hits[0]


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def main(argv: list[str]) -> int:
    """``build NAME DEST [--buffer-count N]``: write the rebuilt copy NAME into the folder DEST
    (created)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python tests/snapshots.py",
                                     description="Write a rebuilt copy into a new folder.")
    parser.add_argument("command", choices=["build"])
    parser.add_argument("name", choices=sorted(SNAPSHOTS))
    parser.add_argument("dest", type=Path, help="a folder that does not exist yet")
    parser.add_argument("--buffer-count", type=int, metavar="N",
                        help="PR #6316 only: the default fsdp_buffer_count (at least 2)")
    args = parser.parse_args(argv)
    snapshot = SNAPSHOTS[args.name]
    if args.dest.exists():
        parser.error(f"{args.dest} exists; give a new folder")
    if args.buffer_count is not None and (not snapshot.pr6316 or args.buffer_count < 2):
        parser.error("--buffer-count needs a PR #6316 copy and N >= 2")
    build(snapshot, args.dest, whole=True)
    if args.buffer_count is not None:
        set_default_buffer_count(args.dest / snapshot.package, args.buffer_count)
    print(f"{args.name} rebuilt in {args.dest}: PYTHONPATH={args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
