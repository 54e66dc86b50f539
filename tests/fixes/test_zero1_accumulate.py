"""``zero1-accumulate`` and the release defect it repairs, ``zero1-fused-wgrad-overwrite``.

The real-library cases run ``accumulation_job.py`` as two gloo ranks on CPU: Megatron-LM's
protocol (``no_sync()`` around every microbatch but the last), TransformerEngine's fused-wgrad
contract emulated by the selftest model (it honours ``overwrite_main_grad``), gradients compared
bit for bit with plain PyTorch (``mfsdp_hotfix.compare``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import rank_jobs
import releases

from mfsdp_hotfix import fix_catalogue, registry, release_defects
from mfsdp_hotfix.fixes import zero1_accumulate
from mfsdp_hotfix.structure import overwrite_setter

JOB = Path(__file__).with_name("accumulation_job.py")


def run_job(release: Path, hotfix: bool, **config: Any) -> dict[str, Any]:
    """Both ranks of one run; rank 0's report (a rank that died is a failure here)."""
    reports, _, logs = rank_jobs.run_ranks(JOB, release, config, hotfix=hotfix, timeout=240)
    assert all(r is not None for r in reports), logs
    report = reports[0]
    assert report is not None and "exception" not in report, (report or {}).get("traceback")
    return report


def fix_state(report: dict[str, Any]) -> str:
    (copy,) = [c for c in report["status"]["copies"] if c["package"] == "megatron_fsdp"]
    return str(copy["fixes"][fix_catalogue.ZERO1_ACCUMULATE.id]["state"])


def test_undoes_the_attribute_only_where_gradients_are_not_sharded() -> None:
    params = [SimpleNamespace(overwrite_main_grad=True), SimpleNamespace()]
    zero1 = SimpleNamespace(data_parallel_sharding_strategy="optim")
    assert zero1_accumulate.accumulates(zero1, params) == 1
    assert params[0].overwrite_main_grad is False and not hasattr(params[1], "overwrite_main_grad")
    assert zero1_accumulate.accumulates(zero1, params) == 0  # idempotent
    for strategy in ("optim_grads", "optim_grads_params"):
        param = SimpleNamespace(overwrite_main_grad=True)
        model = SimpleNamespace(data_parallel_sharding_strategy=strategy)
        assert zero1_accumulate.accumulates(model, [param]) == 0
        assert param.overwrite_main_grad is True


def test_a_failure_mid_run_stops_every_step_instead_of_switching_the_fix_off() -> None:
    """Switched off, the release would overwrite ZeRO-1 gradients again, silently."""
    from types import ModuleType

    from mfsdp_hotfix import UnsupportedConfiguration

    class MegatronFSDP:
        data_parallel_sharding_strategy = "optim"

        def all_gather_and_wait_parameters_ready(self, params: Any) -> str:
            return "gathered"

    module = ModuleType("fake_model_module")
    module.MegatronFSDP = MegatronFSDP  # type: ignore[attr-defined]
    undo = zero1_accumulate.apply(module)
    try:
        model = MegatronFSDP()
        param = SimpleNamespace(overwrite_main_grad=True)
        assert model.all_gather_and_wait_parameters_ready([param]) == "gathered"
        assert param.overwrite_main_grad is False
        for _ in range(2):  # not a single warning and then the shipped behaviour
            with pytest.raises(UnsupportedConfiguration, match="zero1-accumulate failed"):
                model.all_gather_and_wait_parameters_ready(params=object())
        param.overwrite_main_grad = True
        model.all_gather_and_wait_parameters_ready([param])
        assert param.overwrite_main_grad is False
    finally:
        undo()


ALWAYS = '''
def all_gather_and_wait_parameters_ready(self, params):
    for param in params:
        param.overwrite_main_grad = True
'''
DECIDES = '''
def all_gather_and_wait_parameters_ready(self, params):
    for param in params:
        param.overwrite_main_grad = self.data_parallel_sharding_strategy in ["optim_grads"]
'''
SILENT = '''
def all_gather_and_wait_parameters_ready(self, params):
    for param in params:
        param.__fsdp_param__ = True
'''


UPSTREAM = '''
def all_gather_and_wait_parameters_ready(self, params):
    for param in params:
        param.overwrite_main_grad = self.data_parallel_sharding_strategy in [
            "optim_grads",
            "optim_grads_params",
        ]
'''
NOT_NO_SHARD = DECIDES.replace('in ["optim_grads"]', '!= "no_shard"')
NOT_UNSHARDED = DECIDES.replace('in ["optim_grads"]', 'not in ("optim", "no_shard")')
PER_PARAMETER = DECIDES.replace('self.data_parallel_sharding_strategy in ["optim_grads"]',
                                "param._grad_sharded")
# An attribute the model does not hold, read with #6357's decision as its default: undecidable.
GETATTR_DEFAULT = UPSTREAM.replace(
    "= self.data_parallel_sharding_strategy in [", '= getattr(self, "shard_grads", '
    "self.data_parallel_sharding_strategy in [").replace("        ]\n", "        ])\n")
# One more write of overwrite_main_grad, in a form or a place the decision alone does not show.
ALSO_SETATTR = UPSTREAM + '        setattr(param, "overwrite_main_grad", True)\n'
ALSO_UNPACKED = UPSTREAM + "        param.overwrite_main_grad, _ = True, None\n"
ALSO_IN_A_BRANCH = UPSTREAM + ("        if self.ddp_config.overlap_grad_reduce:\n"
                               "            param.overwrite_main_grad = True\n")
SETS_THE_STRATEGY = UPSTREAM.replace(
    "    for param in params:\n",
    '    self.data_parallel_sharding_strategy = "optim_grads"\n    for param in params:\n')


@pytest.mark.parametrize(("source", "always", "decides"), [
    (ALWAYS, True, False), (UPSTREAM, False, True), (NOT_UNSHARDED, False, True),
    (DECIDES, False, False), (NOT_NO_SHARD, False, False), (PER_PARAMETER, False, False),
    (SILENT, False, False), (GETATTR_DEFAULT, False, False), (ALSO_SETATTR, False, False),
    (ALSO_UNPACKED, False, False), (ALSO_IN_A_BRANCH, False, False),
    (SETS_THE_STRATEGY, False, False)],
    ids=["always", "upstream", "other-words", "zero3-left-out", "true-for-zero1",
         "per-parameter", "silent", "getattr-default", "also-setattr", "also-unpacked",
         "also-in-a-branch", "sets-the-strategy"])
def test_fork_shapes(source: str, always: bool, decides: bool) -> None:
    assert overwrite_setter.always_overwrites_main_grad(source) is always
    assert overwrite_setter.decides_overwrite_main_grad(source) is decides


def test_a_getattr_default_in_the_setter_is_never_not_needed(tmp_path: Path) -> None:
    """megatron-fsdp 0.6.1 with #6357's decision read as the default of an attribute the
    model does not hold: the fix is unverified (a ZeRO-1 model is refused), not "not needed"."""
    import shutil

    from mfsdp_hotfix import tree

    root = tmp_path / "site"
    shutil.copytree(releases.unpacked("megatron-fsdp", "0.6.1"), root)
    model = root / "megatron_fsdp" / "megatron_fsdp.py"
    text = model.read_text()
    assert text.count("param.overwrite_main_grad = True") == 1
    model.write_text(text.replace(
        "param.overwrite_main_grad = True", 'param.overwrite_main_grad = getattr(self, "shard_'
        'grads", self.data_parallel_sharding_strategy in ["optim_grads", "optim_grads_params"])'))
    (copy,) = tree.judge(str(root))["copies"]
    assert copy["fixes"]["zero1-accumulate"]["state"] == "unverified"


def test_the_defect_is_the_fixs() -> None:
    defect = release_defects.ZERO1_FUSED_WGRAD_OVERWRITE
    assert defect in release_defects.RELEASE_DEFECTS
    assert defect.name == "zero1-fused-wgrad-overwrite" and defect.fix in fix_catalogue.FIX_IDS
    assert release_defects.defects_of({defect.fix: "off"}) == [defect]
    assert release_defects.defects_of({defect.fix: "not needed"}) == []


@pytest.mark.parametrize("version", ["0.4.0", "0.5.1", "0.6.1"])
def test_released_wheels_need_the_fix(version: str) -> None:
    from mfsdp_hotfix import detection

    copy = registry.COPIES[0]
    folder = releases.unpacked("megatron-fsdp", version)
    found = detection.detect_file(copy, folder / "megatron_fsdp" / "param_and_grad_buffer.py",
                                  installed=False)
    assert found.needs(fix_catalogue.ZERO1_ACCUMULATE), found.shapes


def fields(report: dict[str, Any]) -> tuple[str, set[Any]]:
    return report["comparison"]["outcome"], set(report["overwrite_main_grad"].values())


@pytest.mark.slow
def test_shipped_zero1_accumulation_is_wrong_and_fixed_exact() -> None:
    release = releases.unpacked("megatron-fsdp", "0.6.1")
    shipped = run_job(release, False, strategy="optim", microbatches=2)
    assert fields(shipped) == ("wrong", {True}), shipped["comparison"]
    assert fix_state(shipped) == "off"
    fixed = run_job(release, True, strategy="optim", microbatches=2)
    assert fields(fixed) == ("exact", {False}), fixed["comparison"]
    assert fix_state(fixed) == "applied"


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    {"strategy": "optim_grads", "microbatches": 2},
    {"strategy": "optim_grads_params", "microbatches": 2},
    {"strategy": "optim", "microbatches": 2, "linear": "unfused"},
    {"strategy": "optim", "microbatches": 1}], ids=["zero2", "zero3", "fusion-off", "one-mb"])
def test_each_workaround_avoids_it_as_shipped(config: dict[str, Any]) -> None:
    report = run_job(releases.unpacked("megatron-fsdp", "0.6.1"), False, **config)
    assert report["comparison"]["outcome"] == "exact", report["comparison"]


@pytest.mark.slow
def test_nvidia_main_is_not_patched_and_exact() -> None:
    tree = releases.git_tree("main")
    if tree is None:
        pytest.skip("NVIDIA main needs a Megatron-LM clone: set MFSDP_TEST_MEGATRON_LM")
    report = run_job(tree, True, strategy="optim", microbatches=2)
    assert fix_state(report) == "not needed"
    assert fields(report) == ("exact", {False}), report["comparison"]


@pytest.mark.slow
def test_an_unverified_fix_refuses_to_build_a_zero1_model(tmp_path: Path) -> None:
    """A copy whose overwrite_main_grad setter is a shape the hotfix does not know: the fix is
    unverified, and building a ZeRO-1 model raises instead of training with the defect."""
    import shutil

    from mfsdp_hotfix.selftest.runner import run_case
    from mfsdp_hotfix.selftest.spec import CaseSpec

    root = tmp_path / "site"
    shutil.copytree(releases.unpacked("megatron-fsdp", "0.6.1"), root)
    model = root / "megatron_fsdp" / "megatron_fsdp.py"
    text = model.read_text()
    assert text.count("param.overwrite_main_grad = True") == 1
    model.write_text(text.replace("param.overwrite_main_grad = True",
                                  "param.overwrite_main_grad = bool(param.requires_grad)"))
    spec = CaseSpec(flavour="standalone", path=str(root), double_buffer=False, units=3,
                    strategy="optim")
    result = run_case(spec)
    assert result.crashed and "UnsupportedConfiguration" in (result.exception or ""), (
        result.exception)
    assert "zero1-accumulate is unverified" in (result.exception or "")
    sharded = run_case(CaseSpec(**{**spec.__dict__, "strategy": "optim_grads"}))
    assert not sharded.crashed and sharded.max_abs_grad_error == 0.0, sharded.exception
