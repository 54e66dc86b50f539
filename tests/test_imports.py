"""The package's layers look only down: no module imports one that imports it back (directly or
through others), at module level or inside a function. The same holds for the scripts of
validation/ and benchmarks/, which import each other by bare name (their folder on sys.path)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "mfsdp_hotfix"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports (``from . import x`` counts as importing ``x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (
                node.module or "")
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    found.add(f"{target}.{alias.name}")
                elif target in modules:
                    found.add(target)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
    found.discard(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> None:
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            raise AssertionError(" -> ".join(trail[trail.index(node):] + [node]))
        if node in done:
            return
        for child in sorted(graph[node]):
            visit(child, trail + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


def test_no_import_cycle() -> None:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports(p, modules) for p in paths}
    assert graph["mfsdp_hotfix.installer"], "the graph must see relative imports"
    find_cycle(graph)


def test_the_registry_family_and_the_recognisers_import_nothing_above_them() -> None:
    """What the hotfix knows (the registry and the tables declared on it) and the structural
    recognisers sit at the bottom: detection and everything above it read them, never the other
    way round."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports(p, modules) for p in paths}
    registry_family = {f"mfsdp_hotfix.{name}" for name in (
        "registry", "verified_releases", "eras", "fix_catalogue", "release_defects",
        "gradient_pools")}
    recognisers = {name for name in modules if name.startswith("mfsdp_hotfix.structure")}
    assert len(recognisers) > 1, "the graph must see the structure package"
    for layer in (registry_family, recognisers):
        for name in layer:
            assert graph[name] <= layer, (name, graph[name] - layer)


def script_graph() -> dict[str, set[str]]:
    """validation/ and benchmarks/ scripts by bare name -> the scripts each one imports."""
    paths = sorted([*(REPO / "validation").glob("*.py"), *(REPO / "benchmarks").glob("*.py")])
    names = {p.stem for p in paths}
    assert len(names) == len(paths), "two scripts of one name"
    graph = {}
    for path in paths:
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level:
                found.add((node.module or "").split(".")[0])
            elif isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
        graph[path.stem] = (found & names) - {path.stem}
    return graph


def test_no_import_cycle_in_the_scripts() -> None:
    graph = script_graph()
    assert "engine" in graph["gpu_phases"], "the graph must see the scripts' imports"
    find_cycle(graph)


def test_validation_phases_import_the_engine_not_each_other() -> None:
    """fuzz and te_matrix plan their phase on the engine and the shared helpers below it (workdir,
    run_matrix's release table); the driver above them (gpu_phases) puts the phases together."""
    graph = script_graph()
    phases = {"fuzz", "te_matrix", "gpu_phases", "core_gpt"}
    for phase in ("fuzz", "te_matrix"):
        assert not graph[phase] & phases, (phase, graph[phase])
