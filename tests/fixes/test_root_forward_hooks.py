"""``root-forward-hooks`` and the release defect it repairs, ``root-hooks-skipped``: which
releases' ``MegatronFSDP.forward`` calls the root module past its hooks (read from every
release), and on the real releases, against plain PyTorch, the models it strikes: one whose
module registered last is not the last to run (no parameter-free head), parameters outside
every FSDP unit (a root-level linear before the units, a final norm), a parameter the root
owns itself (a scale on the output: ZeRO-3 dies as shipped, ZeRO-1 is silently wrong; the forward
outputs, the gradient norm and the parameters after each of 2 SGD steps compared bit for bit,
``optimizer_job.py``); and what the fix leaves alone (a model with a head, bit for bit)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import releases
import torch
from optimizer_job import assert_exact, fsdp, run_job

from mfsdp_hotfix import detection, fix_catalogue_outside, registry, release_defects
from mfsdp_hotfix.selftest.runner import run_case
from mfsdp_hotfix.selftest.spec import CaseResult, CaseSpec

FIX = fix_catalogue_outside.ROOT_FORWARD_HOOKS
# A root that owns a scale on its output, for optimizer_job.py.
ROOT = {"optimizer": "sgd", "layout": "root-parameter"}
STANDALONE, VENDORED = registry.COPIES
# Which releases call self.module.forward(...): every one before megatron-fsdp 0.6.0 /
# megatron-core 0.19.0 (NVIDIA/Megatron-LM#5808).
PAST_THE_HOOKS = {**{("megatron-fsdp", v): "0.14" for v in releases.MEGATRON_FSDP
                     if v < "0.6"},
                  **{("megatron-fsdp", v): "0.19" for v in releases.MEGATRON_FSDP
                     if v >= "0.6"},
                  **{("megatron-core", v): "0.14" for v in releases.MEGATRON_CORE
                     if "0.14" <= v < "0.19"},
                  **{("megatron-core", v): "0.19" for v in releases.MEGATRON_CORE
                     if v >= "0.19"}}


@pytest.mark.parametrize(("dist", "version"), sorted(PAST_THE_HOOKS))
def test_every_release_has_its_shape(dist: str, version: str) -> None:
    copy = STANDALONE if dist == "megatron-fsdp" else VENDORED
    found = detection.find_installed(copy, [str(releases.unpacked(dist, version))])
    assert found is not None
    shapes = detection.detect_file(copy, found, installed=False).shapes
    shape = shapes[fix_catalogue_outside.ROOT_FORWARD]
    assert shape is not None and shape.name == PAST_THE_HOOKS[dist, version]
    assert (FIX.id in shape.needs) is (shape.name == "0.14")
    assert FIX.defect is not None and FIX.defect in release_defects.RELEASE_DEFECTS


def _model(root: torch.nn.Module) -> Any:
    return SimpleNamespace(module=root)


def test_which_models_an_unrepaired_copy_refuses() -> None:
    """Where the fix cannot apply: a root that owns parameters, or whose module registered last
    has parameters; not a model whose last registered module is parameter-free."""
    with_head = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Identity())
    ending_in_a_linear = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(2, 2))
    owner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Identity())
    owner.gain = torch.nn.Parameter(torch.ones(2))  # type: ignore[attr-defined]
    assert not fix_catalogue_outside.root_hooks_matter(_model(with_head))
    assert fix_catalogue_outside.root_hooks_matter(_model(ending_in_a_linear))
    assert fix_catalogue_outside.root_hooks_matter(_model(owner))
    scale_only = torch.nn.Module()
    scale_only.scale = torch.nn.Parameter(torch.ones(2))
    assert fix_catalogue_outside.root_hooks_matter(_model(scale_only))


_results: dict[str, CaseResult] = {}


def _case(release: str, hotfix: str, **fields: Any) -> CaseResult:
    """Two gloo ranks, ZeRO-3, 2 units, one microbatch, no double buffer, unless ``fields``
    say otherwise."""
    spec: dict[str, Any] = {"strategy": "optim_grads_params", "units": 2, "microbatches": 1,
                            "double_buffer": False, "linear": "unfused", **fields}
    case = CaseSpec(flavour="standalone", path=str(releases.unpacked("megatron-fsdp", release)),
                    hotfix=hotfix, **spec)
    if case.to_json() not in _results:
        _results[case.to_json()] = run_case(case)
    return _results[case.to_json()]


def describe(result: CaseResult) -> str:
    return (f"{result.spec.label()}: crashed={result.crashed} {result.exception!r} "
            f"max_abs_grad_error={result.max_abs_grad_error}\n{result.log_tail[-2000:]}")


@pytest.mark.slow
@pytest.mark.parametrize(("release", "fields"), [
    ("0.4.0", {"head": False}),
    ("0.4.0", {"head": False, "outside": "child-before", "linear": "emulated",
               "double_buffer": True, "microbatches": 2, "units": 3}),
    ("0.5.1", {"outside": "root-before"})],
    ids=["0.4.0-no-head", "0.4.0-outside-double-buffer",
         "0.5.1-root-parameter"])
def test_wrong_or_crashing_as_shipped_and_without_the_fix_exact_with_it(
        release: str, fields: dict[str, Any]) -> None:
    shipped = _case(release, "off", **fields)
    assert shipped.crashed or (shipped.max_abs_grad_error or 0) > 0.01, describe(shipped)
    without = _case(release, "on", disabled_fixes=FIX.id, **fields)
    assert without.crashed or (without.max_abs_grad_error or 0) > 0.01, describe(without)
    fixed = _case(release, "on", **fields)
    assert not fixed.crashed and fixed.max_abs_grad_error == 0.0, describe(fixed)
    assert "'root-forward-hooks': {'state': 'applied'" in str(fixed.hotfix_status)


@pytest.mark.slow
def test_a_model_with_a_head_is_left_bit_for_bit_as_it_was() -> None:
    fields = {"outside": "child-before+final-norm", "linear": "emulated", "microbatches": 2}
    with_fix = _case("0.4.0", "on", **fields)
    without = _case("0.4.0", "on", disabled_fixes=FIX.id, **fields)
    assert not with_fix.crashed and not without.crashed, (with_fix.exception, without.exception)
    assert with_fix.grad_digest == without.grad_digest and with_fix.grad_digest
    assert with_fix.max_abs_grad_error == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("release", ["0.4.0", "0.5.1"])
def test_zero3_crashes_as_shipped_and_is_exact_with_the_fix(release: str) -> None:
    shipped = run_job(fsdp(release), False, **ROOT)
    assert shipped.get("died") == [-11, -11], shipped  # SIGSEGV: freed storage read
    assert_exact(run_job(fsdp(release), True, **ROOT))


@pytest.mark.slow
def test_zero1_is_silently_wrong_as_shipped_and_exact_with_the_fix() -> None:
    shipped = run_job(fsdp("0.5.1"), False, strategy="optim", **ROOT)
    assert "died" not in shipped and "exception" not in shipped, shipped
    assert shipped["params"]["outcome"] == "wrong", shipped["params"]
    assert_exact(run_job(fsdp("0.5.1"), True, strategy="optim", **ROOT))


@pytest.mark.slow
def test_fixed_releases_need_nothing() -> None:
    report = run_job(fsdp("0.6.1"), True, **ROOT)
    assert_exact(report)
