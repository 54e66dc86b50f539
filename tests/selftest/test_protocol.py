"""The accumulation protocols (``mfsdp_hotfix.selftest.protocol``), on a stand-in model that
records what the trainer did: Megatron-LM's is one no_sync() around all microbatches but the
last; auto-sync none; a release without the API is an error naming it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from mfsdp_hotfix.selftest import protocol


class Recorder:
    def __init__(self, auto_sync: bool = False) -> None:
        self.model_auto_sync = auto_sync
        self.events: list[str] = []
        self.in_no_sync = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.events.append("enter")
        self.in_no_sync = True
        yield
        self.in_no_sync = False
        self.events.append("exit")

    def step(self, index: int) -> None:
        self.events.append(f"mb{index}{'-nosync' if self.in_no_sync else ''}")

    def finish_grad_sync(self) -> None:
        self.events.append("finish")


@pytest.mark.parametrize("count", [1, 2, 4])
def test_megatron_lm_runs_all_but_the_last_microbatch_in_one_no_sync(count: int) -> None:
    model = Recorder()
    protocol.accumulate(model, "megatron-lm", count, model.step)
    assert model.events == (["enter"] + [f"mb{i}-nosync" for i in range(count - 1)] + ["exit"]
                            + [f"mb{count - 1}"])


def test_auto_sync_runs_every_microbatch_plainly() -> None:
    model = Recorder(auto_sync=True)
    protocol.accumulate(model, "auto-sync", 3, model.step)
    assert model.events == ["mb0", "mb1", "mb2"]


def test_a_release_without_no_sync_is_an_error_naming_it() -> None:
    class Old:
        model_auto_sync = False

    with pytest.raises(protocol.ProtocolError, match="has no no_sync"):
        protocol.accumulate(Old(), "megatron-lm", 2, lambda index: None)
    with pytest.raises(protocol.ProtocolError, match="has no model_auto_sync"):
        protocol.verify(object(), "megatron-lm")


def test_the_model_must_be_built_for_the_protocol() -> None:
    assert protocol.wrap_options("megatron-lm") == {"sync_model_each_microbatch": False}
    assert protocol.wrap_options("auto-sync") == {"sync_model_each_microbatch": True}
    protocol.verify(Recorder(auto_sync=True), "auto-sync")
    with pytest.raises(protocol.ProtocolError, match="needs False"):
        protocol.verify(Recorder(auto_sync=True), "megatron-lm")
    with pytest.raises(ValueError, match="unknown accumulation protocol"):
        protocol.check("no-sync")
    with pytest.raises(ValueError, match="at least 1"):
        protocol.accumulate(Recorder(), "megatron-lm", 0, lambda index: None)


def test_only_megatron_lm_unsharded_without_hsdp_reduces_once() -> None:
    assert protocol.reduces_once("megatron-lm", "optim")
    assert protocol.reduces_once("megatron-lm", "no_shard")
    assert not protocol.reduces_once("megatron-lm", "optim", outer=2)
    assert not protocol.reduces_once("megatron-lm", "optim_grads_params")
    assert not protocol.reduces_once("auto-sync", "optim")
    assert protocol.DEFAULT == "megatron-lm"


def test_only_megatron_lm_finishes_the_sync_itself() -> None:
    """Under auto-sync the release finished it after the last backward, and fully_shard's
    optimizer step does not call it again (a second call reduces unsharded gradients again
    without overlap_grad_reduce)."""
    model = Recorder()
    protocol.finish(model, "megatron-lm")
    assert model.events == ["finish"]
    auto = Recorder(auto_sync=True)
    protocol.finish(auto, "auto-sync")
    assert auto.events == []
