"""``inert-warm-up`` and the release defect it repairs, ``optimizer-warm-up-step``: the real
releases' ``fully_shard_optimizer`` against plain PyTorch (same model, seed, data and optimizer;
the forward outputs, the gradient norm and the parameters after each of 2 steps compared bit for
bit, ``optimizer_job.py``), and the undo on plain torch optimizers."""

from __future__ import annotations

from typing import Any

import pytest
from optimizer_job import OPTIMIZERS, assert_exact, fsdp, optimizer_for, run_job

from mfsdp_hotfix.fixes import inert_warm_up

# What the test asserts, and docs/RELEASE_DEFECTS.md reports, of Adam as shipped: its step count
# after two real steps (the warm-up counted), and its first update over plain PyTorch's.
SHIPPED_STEP_COUNT = 3
FIRST_UPDATE_RATIO = 0.744


def warmed_up(name: str, fix: bool) -> tuple[Any, list[Any]]:
    """A torch optimizer after the release's warm-up (zero gradients, one step), undone or not."""
    import torch

    params = [torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6).reshape(2, 3) + i)
              for i in range(2)]
    optimizer = optimizer_for(params, name)
    before = inert_warm_up.snapshot(optimizer)
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()
    if fix:
        assert inert_warm_up.undo_warm_up(optimizer, before)
    return optimizer, params


def two_steps(optimizer: Any, params: list[Any]) -> list[Any]:
    import torch

    for step in range(2):
        for i, param in enumerate(params):
            param.grad = torch.full_like(param, 0.3 * (step + 1)) - 0.1 * i * param.detach()
        optimizer.step()
    return [param.detach().clone() for param in params]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_undone_warm_up_steps_as_a_fresh_optimizer_bit_for_bit(name: str) -> None:
    import torch

    fresh = [torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6).reshape(2, 3) + i)
             for i in range(2)]
    want = two_steps(optimizer_for(fresh, name), fresh)
    got = two_steps(*warmed_up(name, fix=True))
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    shipped = two_steps(*warmed_up(name, fix=False))
    if name in ("sgd", "sgd-momentum"):  # no decay, no dampening: that warm-up is inert
        assert all(torch.equal(s, w) for s, w in zip(shipped, want, strict=True))
    else:
        assert not all(torch.equal(s, w) for s, w in zip(shipped, want, strict=True))


def test_another_optimizers_parameters_are_restored_and_its_state_left() -> None:
    import torch

    params = [torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.Adagrad(params, lr=0.1, weight_decay=0.5)
    before = inert_warm_up.snapshot(optimizer)
    params[0].grad = torch.zeros(3)
    optimizer.step()
    assert not torch.equal(params[0].detach(), torch.ones(3))
    assert inert_warm_up.undo_warm_up(optimizer, before) is False
    assert torch.equal(params[0].detach(), torch.ones(3))


@pytest.mark.slow
@pytest.mark.parametrize(("release", "world", "optimizer"), [
    ("0.4.0", 2, "adamw"), ("0.5.1", 2, "sgd-dampened"), ("0.6.1", 1, "adam")],
    ids=["0.4.0-adamw", "0.5.1-sgd-dampened", "0.6.1-one-rank-adam"])
def test_the_warm_up_is_a_step_as_shipped_and_inert_with_the_fix(release: str, world: int,
                                                                  optimizer: str) -> None:
    shipped = run_job(fsdp(release), False, world, optimizer=optimizer)
    assert "exception" not in shipped and "died" not in shipped, shipped
    assert shipped["params"]["outcome"] == "wrong", shipped["params"]
    if optimizer.startswith("adam"):
        assert shipped["step_count"] == SHIPPED_STEP_COUNT  # the warm-up counted as a step
        assert shipped["first_update_ratio"] == pytest.approx(FIRST_UPDATE_RATIO, abs=0.005)
    fixed = run_job(fsdp(release), True, world, optimizer=optimizer)
    assert_exact(fixed)
    assert fixed["step_count"] == (2.0 if optimizer.startswith("adam") else None)


@pytest.mark.slow
def test_an_inert_warm_up_stays_bit_for_bit_as_shipped() -> None:
    """SGD with momentum, no dampening and no decay: the shipped warm-up changes nothing, and
    neither does the fix (both bit-identical to plain PyTorch)."""
    assert_exact(run_job(fsdp("0.6.1"), False, 2, optimizer="sgd-momentum"))
    assert_exact(run_job(fsdp("0.6.1"), True, 2, optimizer="sgd-momentum"))
