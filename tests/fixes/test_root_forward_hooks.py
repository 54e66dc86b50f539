"""``root-forward-hooks`` and the release defect it repairs, ``root-parameters-not-gathered``: a
model whose root module owns a parameter it uses in ``forward`` (a scale on the output), on the
real releases against plain PyTorch (the forward outputs, the gradient norm and the parameters
after each of 2 SGD steps compared bit for bit, ``optimizer_job.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import releases
from optimizer_job import run_job

from mfsdp_hotfix.fixes import root_forward_hooks

ROOT = {"optimizer": "sgd", "layout": "root-parameter"}


def test_only_a_root_module_that_owns_a_parameter_goes_through_its_hooks() -> None:
    import torch

    owner = torch.nn.Module()
    owner.scale = torch.nn.Parameter(torch.ones(2))
    parent = torch.nn.Module()
    parent.child = torch.nn.Linear(2, 2)
    assert root_forward_hooks.needs_hooks(SimpleNamespace(module=owner))
    assert not root_forward_hooks.needs_hooks(SimpleNamespace(module=parent))


def fsdp(release: str) -> Any:
    return releases.unpacked("megatron-fsdp", release)


def assert_exact(report: dict[str, Any]) -> None:
    assert "exception" not in report and "died" not in report, report
    for key in ("wrapped", "out", "grad_norm", "params"):
        assert report[key]["outcome"] == "exact", (key, report[key])


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
