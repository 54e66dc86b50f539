"""parity/capture, for real on CPU: a fresh interpreter with the capture's folder on PYTHONPATH
imports a stand-in ``megatron.training.training`` and runs a stand-in loop. The stand-in exists
because Megatron-LM's training loop needs GPUs; its ``training_log`` has the real signature, read
from each release's own ``megatron/training/training.py`` (the wheels from tests/releases.py), and
the loop calls it the way the releases' ``train()`` does (required arguments by position, the
rest by name). Checked: full-precision values, with ``MFSDP_HOTFIX=0``, with a user's
sitecustomize, under ``mfsdp-hotfix run``'s, and that no failure stops the run."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_python
from releases import unpacked

from mfsdp_hotfix import bootstrap
from mfsdp_hotfix.parity import capture
from mfsdp_hotfix.parity.log_lines import GRAD_NORM, read_log

# megatron-core 0.14.0 and 0.15.3 ship no megatron/training in their wheels; their signature,
# read from NVIDIA/Megatron-LM's tags core_v0.14.0 and core_v0.15.3 (the same in both):
OLDEST_SIGNATURE = ("loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, "
                    "iteration, loss_scale, report_memory_flag, skipped_iter, grad_norm, "
                    "params_norm, num_zeros_in_grad")
WHEELS_WITH_TRAINING = ["0.17.1", "0.18.2", "0.19.2"]
GRAD_NORMS = [2.2396705150604250, 0.0036091546062380075, float("nan")]
LOSSES = [9.132905960083008, 8.881336212158203, 8.65475845336914]


def real_signature(version: str) -> str:
    """The parameters of ``training_log`` in the release's own training.py, as source text."""
    source = (unpacked("megatron-core", version) / "megatron/training/training.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "training_log":
            return ast.unparse(node.args)
    raise AssertionError(f"megatron-core {version} has no training_log")


STAND_IN = '''
"""Stand-in for Megatron-LM's GPU-only training loop: training_log has the release's
signature; it prints a line in Megatron's format and returns report_memory_flag."""
import inspect
import torch


def training_log({signature}):
    b = inspect.signature(training_log).bind(**{{k: v for k, v in locals().items()}}).arguments
    print(" iteration {{:8d}}/{{:8d}} |".format(b["iteration"], 3)
          + "".join(" {{}}: {{:.6E}} |".format(k, v.item()) for k, v in b["loss_dict"].items())
          + " grad norm: {{:.3f}} |".format(b["grad_norm"])
          + " number of skipped iterations: {{:3d}} |".format(b["skipped_iter"])
          + " number of nan iterations: {{:3d}} |".format(0), flush=True)
    return b["report_memory_flag"]


def train(grad_norms, losses):
    parameters = inspect.signature(training_log).parameters.values()
    required = [p.name for p in parameters if p.default is inspect.Parameter.empty]
    optional = [p.name for p in parameters if p.default is not inspect.Parameter.empty]
    flag = True
    for iteration, (grad_norm, loss) in enumerate(zip(grad_norms, losses), start=1):
        values = dict.fromkeys(required + optional)
        values.update(loss_dict={{"lm loss": torch.tensor(loss)}}, total_loss_dict={{}},
                      iteration=iteration, report_memory_flag=flag, skipped_iter=0,
                      grad_norm=grad_norm)
        flag = training_log(*[values[n] for n in required], **{{n: values[n] for n in optional}})
    return flag
'''


def stand_in_megatron(folder: Path, signature: str, module: str | None = None) -> Path:
    package = folder / "megatron" / "training"
    package.mkdir(parents=True)
    (folder / "megatron" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "training.py").write_text(module or STAND_IN.format(signature=signature))
    return folder


# A training_log of a shape no release has (no ``iteration``): the capture cannot read it.
UNREADABLE = '''
def training_log(loss_dict, total_loss_dict, report_memory_flag, grad_norm, skipped_iter, **more):
    print("logged", more["step"])
    return report_memory_flag


def train(grad_norms, losses):
    for step, grad_norm in enumerate(grad_norms, start=1):
        flag = training_log({}, {}, True, grad_norm, 0, step=step)
    return flag
'''



LOOP = f"""
import megatron.training.training as t
assert t.train({GRAD_NORMS!r}, {LOSSES!r}) is True, "the run's own return value"
print("the run went on")
"""
LOOP = LOOP.replace("nan", "float('nan')")


def run_loop(tmp_path: Path, signature: str, *before: Path | str, after: tuple[Path, ...] = (),
             env: dict[str, str] | None = None, module: str | None = None,
             prelude: str = "") -> tuple[str, str, list[dict[str, object]]]:
    megatron = stand_in_megatron(tmp_path / "stand_in", signature, module)
    out = tmp_path / "capture"
    out.mkdir()
    added = capture.capture_environment(str(out), {})
    path = [*before, *added["PYTHONPATH"].split(os.pathsep), *after, megatron]
    result = run_python(prelude + LOOP, *path, env={capture.VARIABLE: added[capture.VARIABLE],
                                          "MFSDP_HOTFIX": "0", **(env or {})})
    assert result.returncode == 0, result.stderr
    assert "the run went on" in result.stdout
    records = [json.loads(line) for f in sorted(out.glob("*.jsonl"))
               for line in f.read_text().splitlines()]
    return result.stdout, result.stderr, records


def iterations(records: list[dict[str, object]]) -> list[dict[str, object]]:
    return [r for r in records if r["kind"] == "iteration"]


@pytest.mark.parametrize("version", WHEELS_WITH_TRAINING + ["0.14-0.15"])
def test_every_releases_signature_is_captured_at_full_precision(tmp_path: Path,
                                                                version: str) -> None:
    signature = OLDEST_SIGNATURE if version == "0.14-0.15" else real_signature(version)
    stdout, stderr, records = run_loop(tmp_path, signature)
    assert "mfsdp-hotfix parity" not in stderr, stderr
    got = iterations(records)
    assert [r["iteration"] for r in got] == [1, 2, 3]
    assert [r["grad_norm"] for r in got][:2] == GRAD_NORMS[:2]  # every bit: json writes repr
    assert got[2]["grad_norm"] != got[2]["grad_norm"]  # NaN
    # the loss as torch holds it (float32) and as Megatron sums it
    assert got[0]["losses"] == {"lm loss": 9.132905960083008} and got[0]["skipped"] == 0
    process = records[0]
    assert process["kind"] == "process" and process["hotfix"] == "not loaded"
    assert process["parameters"][:2] == ["loss_dict", "total_loss_dict"]
    run = read_log(stdout, str(tmp_path / "capture"))
    assert [it.grad_norm for it in run.iterations][:2] == GRAD_NORMS[:2]
    assert run.iterations[0].resolution[GRAD_NORM] == 0.0 and run.hotfix == "not loaded"


def test_a_users_sitecustomize_still_runs(tmp_path: Path) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("print('user sitecustomize ran')\n")
    stdout, _, records = run_loop(tmp_path, real_signature("0.19.2"), after=(user,))
    assert stdout.count("user sitecustomize ran") == 1 and len(iterations(records)) == 3


@pytest.mark.parametrize("order, switch, state", [("run first", "1", "armed"),
                                                  ("capture first", "0", "off"),
                                                  ("capture first", "1", "armed")])
def test_under_mfsdp_hotfix_runs_sitecustomize(tmp_path: Path, order: str, switch: str,
                                               state: str) -> None:
    """Whichever of the two is first on PYTHONPATH, both run once, then the user's."""
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("print('user sitecustomize ran')\n")
    run_site = Path(bootstrap.SITECUSTOMIZE_DIR)
    before = (run_site,) if order == "run first" else ()
    after = (user,) if order == "run first" else (run_site, user)
    stdout, stderr, records = run_loop(tmp_path, real_signature("0.19.2"), *before, after=after,
                                       env={"MFSDP_HOTFIX": switch})
    assert stdout.count("user sitecustomize ran") == 1, (stdout, stderr)
    assert records[0]["hotfix"] == state and records[0]["fixes_applied"] == []
    assert len(iterations(records)) == 3


def test_only_the_last_rank_of_a_real_group_records(tmp_path: Path) -> None:
    """Two gloo ranks (env://): the last one records, as it is the one Megatron prints from."""
    megatron = stand_in_megatron(tmp_path / "stand_in", real_signature("0.19.2"))
    out = tmp_path / "capture"
    out.mkdir()
    added = capture.capture_environment(str(out), {})
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
    env.update(added, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
               WORLD_SIZE="2", MFSDP_HOTFIX="0")
    env["PYTHONPATH"] += os.pathsep + os.pathsep.join([str(megatron), str(REPO)])
    code = "import torch.distributed as dist\ndist.init_process_group('gloo')\n" + LOOP
    ranks = [subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    for rank in ranks:
        _, stderr = rank.communicate(timeout=300)
        assert rank.returncode == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == ["training_log-rank1.jsonl"]
    records = [json.loads(line) for line in
               (out / "training_log-rank1.jsonl").read_text().splitlines()]
    assert (records[0]["rank"], records[0]["world_size"]) == (1, 2)
    assert len(iterations(records)) == 3


# torch's fake process group: the backend Megatron-LM's --fake-process-group uses
FAKE_GROUP = """
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", rank={rank}, world_size=2, store=FakeStore())
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_every_process_of_a_fake_group_prints_and_records(tmp_path: Path, rank: int) -> None:
    _, _, records = run_loop(tmp_path, real_signature("0.19.2"),
                             prelude=FAKE_GROUP.format(rank=rank))
    assert (records[0]["rank"], records[0]["world_size"]) == (rank, 2)
    assert len(iterations(records)) == 3


def test_no_failure_stops_the_run(tmp_path: Path) -> None:
    stdout, stderr, records = run_loop(tmp_path, "", module=UNREADABLE)
    assert stderr.count("mfsdp-hotfix parity: the capture stopped") == 1, stderr
    assert "KeyError: 'iteration'" in stderr
    assert stdout.count("logged") == 3 and iterations(records) == []


def test_an_unwritable_capture_file_is_one_warning(tmp_path: Path) -> None:
    megatron = stand_in_megatron(tmp_path / "stand_in", real_signature("0.19.2"))
    added = capture.capture_environment(str(tmp_path / "missing" / "folder"), {})
    result = run_python(LOOP, *added["PYTHONPATH"].split(os.pathsep), megatron,
                        env={capture.VARIABLE: added[capture.VARIABLE]})
    assert result.returncode == 0 and "the run went on" in result.stdout
    assert result.stderr.count("mfsdp-hotfix parity: the capture stopped") == 1


def test_without_the_variable_nothing_is_hooked(tmp_path: Path) -> None:
    megatron = stand_in_megatron(tmp_path / "stand_in", real_signature("0.19.2"))
    code = LOOP + "import megatron.training.training as t; print(type(t.training_log).__name__)"
    result = run_python(code, capture.SITE, megatron)
    assert result.returncode == 0 and result.stdout.strip().endswith("function")


def test_the_environment_puts_the_capture_first_and_keeps_the_runs_path() -> None:
    added = capture.capture_environment("/out", {"PYTHONPATH": f"/a{os.pathsep}/b"})
    assert added["PYTHONPATH"].split(os.pathsep) == [str(capture.SITE), "/a", "/b"]
    assert added[capture.VARIABLE] == "/out/training_log-rank{rank}.jsonl"


def test_the_site_folder_reads_the_variable_the_package_sets() -> None:
    """site/sitecustomize.py imports nothing of the package (importing it arms the hotfix), so
    it names the variable itself: the two names must be one."""
    tree = ast.parse((capture.SITE / "sitecustomize.py").read_text())
    names = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)}
    assert ast.literal_eval(names["VARIABLE"]) == capture.VARIABLE
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names
                if not isinstance(node, ast.ImportFrom) or node.module is None} | {
        node.module.split(".")[0] for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module}
    assert "mfsdp_hotfix" not in imported and imported <= {
        "importlib", "json", "os", "sys", "types", "inspect", "typing", "wrapt"}
    assert REPO / "mfsdp_hotfix" in capture.SITE.parents
