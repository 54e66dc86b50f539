"""The installed wheel: the ``.pth`` bootstrap in a fresh virtual environment, the switches, and
the ``mfsdp-hotfix run`` sitecustomize route with and without a user ``sitecustomize``. The
scripts run here never import mfsdp_hotfix themselves."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO, run_python

CHECK = """
import json, sys
from megatron_fsdp import param_and_grad_buffer as pgb
drain = pgb.GradReducePipeline.__dict__["_enforce_double_buffer_limit"]
hotfix = sys.modules.get("mfsdp_hotfix")
print("REPORT" + json.dumps({
    "patched": getattr(drain, "_mfsdp_hotfix_fix", None) == "ordered-drain",
    "loaded_via": hotfix.status()["loaded_via"] if hotfix else None,
    "user_sitecustomize": getattr(sys.modules.get("sitecustomize"), "USER_MARK", None)}))
"""


def report(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT"))
    return json.loads(line[len("REPORT"):])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out),
                    str(REPO)], check=True)
    return next(out.glob("mfsdp_hotfix-*.whl"))


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> str:
    """A new venv with only the wheel installed; torch and wrapt come from this environment."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
                    "--no-deps", str(wheel)], check=True)
    site_dir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                               "['purelib'])"], capture_output=True, text=True, check=True)
    purelib = Path(site_dir.stdout.strip())
    assert (purelib / "mfsdp_hotfix.pth").is_file()
    (purelib / "zz_parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_pth_applies_the_fix(venv_python: str, fsdp_release) -> None:
    data = report(run_python(CHECK, fsdp_release("0.5.1"), python=venv_python, repo=False))
    assert data == {"patched": True, "loaded_via": "pth", "user_sitecustomize": None}


@pytest.mark.parametrize("env", [{"MFSDP_HOTFIX": "0"}, {"MFSDP_HOTFIX_BOOTSTRAP": "0"}])
def test_pth_is_switched_off(venv_python: str, fsdp_release, env: dict[str, str]) -> None:
    data = report(run_python(CHECK, fsdp_release("0.5.1"), python=venv_python, repo=False,
                             env=env))
    assert data["patched"] is False


def test_bootstrap_opt_out_loads_nothing(venv_python: str) -> None:
    code = "import sys; print('REPORT' + str(int('mfsdp_hotfix' in sys.modules)))"
    assert report(run_python(code, python=venv_python, repo=False)) == 1
    assert report(run_python(code, python=venv_python, repo=False,
                             env={"MFSDP_HOTFIX_BOOTSTRAP": "off"})) == 0


def test_pth_garbage_bootstrap_value_warns_and_stays_on(venv_python: str, fsdp_release) -> None:
    proc = run_python(CHECK, fsdp_release("0.5.1"), python=venv_python, repo=False,
                      env={"MFSDP_HOTFIX_BOOTSTRAP": "perhaps"})
    assert report(proc)["patched"] is True
    assert "MFSDP_HOTFIX_BOOTSTRAP='perhaps' is not understood" in proc.stderr


def test_pth_bootstrap_imports_no_heavy_module(venv_python: str) -> None:
    code = ("import sys, json; print('REPORT' + json.dumps(sorted(m for m in sys.modules if "
            "m.split('.')[0] in ('torch', 'megatron', 'megatron_fsdp', 'wrapt', 'packaging'))))")
    assert report(run_python(code, python=venv_python, repo=False)) == []


# What the .pth adds to a process's modules: the package's own small modules, nothing of the
# standard library beyond what ``site`` imported already (pathlib, re and typing cost 20-50 ms of
# every interpreter start on a loaded machine).
BOOTSTRAP_MODULES = ["mfsdp_hotfix", "mfsdp_hotfix.bootstrap", "mfsdp_hotfix.trigger",
                     "mfsdp_hotfix.variables"]


def test_the_pth_imports_a_fixed_short_list(venv_python: str) -> None:
    code = "import sys, json; print('REPORT' + json.dumps(sorted(sys.modules)))"
    bare = report(run_python(code, python=venv_python, repo=False,
                             env={"MFSDP_HOTFIX_BOOTSTRAP": "0"}))
    loaded = report(run_python(code, python=venv_python, repo=False))
    assert sorted(set(loaded) - set(bare)) == BOOTSTRAP_MODULES
    assert set(bare) <= set(loaded)


def test_a_misspelt_switch_is_told_in_every_process(venv_python: str, fsdp_release) -> None:
    """``MFSDP_HOTFX=0``: a plain ``python`` says it at start, and a process that imports
    Megatron-FSDP (the hotfix is installed there, armed) says it once, not twice."""
    warning = ("mfsdp_hotfix: warning: MFSDP_HOTFX is not a variable mfsdp_hotfix reads (did "
               "you mean MFSDP_HOTFIX?); it is ignored\n")
    plain = run_python("pass", python=venv_python, repo=False, env={"MFSDP_HOTFX": "0"})
    assert (plain.returncode, plain.stderr) == (0, warning)
    proc = run_python(CHECK, fsdp_release("0.5.1"), python=venv_python, repo=False,
                      env={"MFSDP_HOTFX": "0"})
    assert report(proc)["patched"] is True and proc.stderr.count("MFSDP_HOTFX") == 1, proc.stderr


def _user_sitecustomize(root: Path, package: bool) -> Path:
    target = root / ("sitecustomize" if package else "")
    target.mkdir(parents=True, exist_ok=True)
    (target / ("__init__.py" if package else "sitecustomize.py")).write_text(
        "USER_MARK = 'package' if __file__.endswith('__init__.py') else 'module'\n")
    return root


@pytest.mark.parametrize("user", [None, "module", "package"])
def test_run_uses_sitecustomize_and_chains_to_the_users(tmp_path: Path, fsdp_release,
                                                        user: str | None) -> None:
    path = [fsdp_release("0.5.1")]
    if user:
        path.append(_user_sitecustomize(tmp_path, user == "package"))
    proc = run_python("", *path, args=("-m", "mfsdp_hotfix", "run", "--", sys.executable, "-c",
                                       CHECK))
    assert report(proc) == {"patched": True, "loaded_via": "sitecustomize",
                            "user_sitecustomize": user}


def test_run_without_a_command_is_a_usage_error() -> None:
    proc = run_python("", args=("-m", "mfsdp_hotfix", "run"))
    assert proc.returncode == 2 and "run needs a command" in proc.stderr


def test_run_with_a_missing_program_says_so() -> None:
    proc = run_python("", args=("-m", "mfsdp_hotfix", "run", "--", "no-such-program-xyz"))
    assert proc.returncode == 127 and "cannot start 'no-such-program-xyz'" in proc.stderr


def test_bootstrap_path_prints_the_sitecustomize_folder() -> None:
    proc = run_python("", args=("-m", "mfsdp_hotfix", "bootstrap-path"))
    folder = Path(proc.stdout.strip())
    assert (folder / "sitecustomize.py").is_file()


@pytest.mark.slow
def test_two_ranks_get_the_fix_from_the_pth(venv_python: str, fsdp_release,
                                            tmp_path: Path) -> None:
    """Both gloo ranks of an era-A release (which crashes as shipped) are fixed, and the hotfix
    was loaded by the ``.pth`` before anything imported it (the harness worker itself imports
    the package later, for its torch.cuda stand-in)."""
    from conftest import launch_ranks

    reports = launch_ranks({"flavour": "standalone", "timeout_s": 120.0}, [{}, {}], tmp_path,
                           python=venv_python, path=(fsdp_release("0.4.0"),))
    for report in reports:
        assert report is not None and not report["crashed"], report
        assert report["hotfix_status"]["loaded_via"] == "pth"
    assert reports[0]["max_abs_grad_error"] == 0.0
