"""The package's layers look only down: no module imports one of a layer above its own
(``LAYERS``) or one that imports it back (directly or through others), at module level or inside
a function. The scripts of validation/ and benchmarks/, which import each other by bare name
(their folder on sys.path), have no import cycle either."""

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


def package_graph() -> dict[str, set[str]]:
    """Each module of the package -> the package modules it imports."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) for p in paths}


def test_no_import_cycle() -> None:
    graph = package_graph()
    assert graph["mfsdp_hotfix.installer"], "the graph must see relative imports"
    find_cycle(graph)


def script_modules() -> dict[str, Path]:
    """validation/ and benchmarks/ scripts by bare name, and the modules of their packages (a
    folder with an ``__init__.py``, run as ``python3 validation/NAME``) by dotted name: the
    package's ``__init__.py`` as ``NAME``, its other modules as ``NAME.MODULE``."""
    found: dict[str, Path] = {}
    for folder in (REPO / "validation", REPO / "benchmarks"):
        for path in sorted(folder.glob("*.py")):
            assert path.stem not in found, "two scripts of one name"
            found[path.stem] = path
        for init in sorted(folder.glob("*/__init__.py")):
            package = init.parent.name
            assert package not in found, "a script and a package of one name"
            for path in sorted(init.parent.glob("*.py")):
                found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def script_graph() -> dict[str, set[str]]:
    """validation/ and benchmarks/ scripts and package modules (``script_modules``) -> those
    each one imports (a relative import within its package counts; an import of a name from a
    module counts as importing that module)."""
    modules = script_modules()

    def known(dotted: str) -> str | None:  # the longest leading part that is a module here
        parts = dotted.split(".")
        return next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                     if ".".join(parts[:n]) in modules), None)

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = ".".join(x for x in (base if node.level else "", node.module) if x)
                found |= {known(f"{target}.{alias.name}") for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {known(alias.name) for alias in node.names}
        graph[name] = {m for m in found if m} - {name}
    return graph


def test_no_import_cycle_in_the_scripts() -> None:
    graph = script_graph()
    assert "engine" in graph["gpu_phases"], "the graph must see the scripts' imports"
    assert "megatron_lm.plan" in graph["megatron_lm.launch"], \
        "the graph must see a package's relative imports"
    assert "megatron_lm.record" in graph["megatron_lm.__main__"], \
        "the graph must see a package's imports by its own name"
    find_cycle(graph)


def test_the_megatron_lm_phases_look_only_down() -> None:
    """validation/megatron_lm/: each phase imports only the phases before it in a call's order
    (the plan at the bottom, the command line on top); a new module takes its place here."""
    order = ["megatron_lm", "megatron_lm.plan", "megatron_lm.arguments", "megatron_lm.stage",
             "megatron_lm.outcome", "megatron_lm.launch", "megatron_lm.unit_tests",
             "megatron_lm.driver", "megatron_lm.summary", "megatron_lm.record",
             "megatron_lm.tables", "megatron_lm.__main__"]
    assert_looks_only_down("megatron_lm", order)


def test_the_parity_gpu_phases_look_only_down() -> None:
    """validation/parity_gpu/: the plan at the bottom, then a case's command line, the reading of
    its JSON, the driver, the record of a GPU call, the tables and the command line on top."""
    order = ["parity_gpu", "parity_gpu.plan", "parity_gpu.command", "parity_gpu.reading",
             "parity_gpu.driver", "parity_gpu.record", "parity_gpu.tables",
             "parity_gpu.__main__"]
    assert_looks_only_down("parity_gpu", order)


def test_the_safe_choices_phases_look_only_down() -> None:
    """benchmarks/safe_choices/: the plan at the bottom, then the worker protocol, the driver,
    the model, one variant's build, the summary (whose step statistics the measure takes), the
    measure, the report, the record of a GPU call and the command line on top."""
    order = ["safe_choices", "safe_choices.plan", "safe_choices.worker", "safe_choices.driver",
             "safe_choices.model", "safe_choices.build", "safe_choices.summary",
             "safe_choices.measure", "safe_choices.report", "safe_choices.record",
             "safe_choices.__main__"]
    assert_looks_only_down("safe_choices", order)


def assert_looks_only_down(package: str, order: list[str]) -> None:
    """Every module of the script package ``package`` is in ``order`` and imports only the
    package's modules before it."""
    graph = script_graph()
    assert sorted(order) == sorted(m for m in graph if m.split(".")[0] == package)
    for i, module in enumerate(order):
        above = {m for m in graph[module] if m.split(".")[0] == package} - set(order[:i])
        assert not above, (module, above)


def test_the_audits_records_look_only_down() -> None:
    """mfsdp_hotfix/audit/: the rank files at the bottom, then the verdicts on a copy's counts,
    the job line logged at exit, and on top the audit command's summary of the rank files; each
    imports only the audit modules before it."""
    order = ["rank_files", "verdicts", "job_line", "summary"]
    graph = package_graph()
    for i, name in enumerate(order):
        audit = {m.rpartition(".")[2] for m in graph[f"mfsdp_hotfix.audit.{name}"]
                 if m.startswith("mfsdp_hotfix.audit.")}
        assert audit <= set(order[:i]), (name, audit - set(order[:i]))


def test_validation_phases_import_the_engine_not_each_other() -> None:
    """fuzz and te_matrix plan their phase on the engine and the shared helpers below it (workdir,
    release_wheels' release table); the driver above them (gpu_phases) puts the phases together."""
    graph = script_graph()
    phases = {"fuzz", "te_matrix", "gpu_phases", "core_gpt", "core_gpt_case", "run_matrix",
              "matrix_cases"}
    for phase in ("fuzz", "te_matrix"):
        assert not graph[phase] & phases, (phase, graph[phase])


# The package's layers, bottom first (docs/DEVELOPMENT.md describes them). A module may import
# modules of its own layer or of a layer below (the cycle test above keeps a layer free of
# circles), never one above: what the hotfix knows (the registry, the tables declared on it, the
# recognisers) imports nothing else of the package, the fixes know nothing of the installer, and
# only the commands and the entry point know the command line. A new module must be placed here.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("knowledge", ("errors", "states", "registry", "verified_releases", "eras", "limits",
                   "defects", "fix_type", "fix_catalogue_outside", "fix_catalogue",
                   "release_defects", "gradient_pools", "structure")),
    ("foundations", ("__about__", "variables", "settings", "versions", "fingerprints",
                     "patching", "incidents", "guard", "happens_before", "compare",
                     "verdict_text", "processes")),
    ("reading", ("detection", "v2", "built_configs", "coverage", "slot_reuse", "crossrank")),
    ("fixes", ("fixes",)),
    ("observing", ("audit",)),
    ("installing", ("installer", "trigger", "bootstrap", "sitecustomize")),
    ("reporting", ("reporting", "tree")),
    ("api", ("",)),
    ("proving", ("selftest", "parity")),
    ("commands", ("commands",)),
    ("entry", ("cli", "__main__")),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of ``module`` (a dotted package module), by its first name below the
    package: ``mfsdp_hotfix.fixes.getter_guard`` is in the layer that lists ``fixes``."""
    first = module.split(".")[1] if "." in module else ""
    for index, (_, names) in enumerate(LAYERS):
        if first in names:
            return index
    raise AssertionError(f"{module} is in no layer of LAYERS: place it")


def climbs(graph: dict[str, set[str]]) -> list[str]:
    """Each import in ``graph`` of a module from a layer above the importer's."""
    found = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(name):
                found.append(f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} "
                             f"({LAYERS[layer_of(target)][0]})")
    return found


def test_layers_look_only_down() -> None:
    graph = package_graph()
    assert set(graph) >= {"mfsdp_hotfix.cli", "mfsdp_hotfix.registry"}
    problems = climbs(graph)
    assert not problems, "\n".join(problems)


def test_a_climb_is_seen() -> None:
    """The check is not vacuous: the registry importing the installer is a climb."""
    assert climbs({"mfsdp_hotfix.registry": {"mfsdp_hotfix.installer"},
                   "mfsdp_hotfix.installer": {"mfsdp_hotfix.registry"}}) == [
        "mfsdp_hotfix.registry (knowledge) imports mfsdp_hotfix.installer (installing)"]
