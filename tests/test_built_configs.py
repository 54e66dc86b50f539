"""Whether a built model's config changed since the gate judged it (``built_configs``); the
real route (a ``fully_shard`` model whose config is changed after it was built, stopped at its
first gradient synchronisation) is tests/real_library/test_oldest_releases.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from mfsdp_hotfix import built_configs


@dataclass
class Config:
    gradient_reduce_div_fusion: bool = True
    overlap_grad_reduce: bool = True
    scale: torch.Tensor = field(default_factory=lambda: torch.ones(2))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ddp_config = Config()


def test_a_model_the_gate_never_judged_is_not_changed() -> None:
    assert not built_configs.changed(Model())


def test_an_unchanged_config_and_one_set_to_the_same_value_are_not_changed() -> None:
    model = Model()
    built_configs.remember(model)
    assert not built_configs.changed(model)
    model.ddp_config.overlap_grad_reduce = True
    assert not built_configs.changed(model)


def test_a_value_changed_after_the_gate_judged_it() -> None:
    model = Model()
    built_configs.remember(model)
    model.ddp_config.gradient_reduce_div_fusion = False
    assert built_configs.changed(model)
    built_configs.remember(model)  # judged again
    assert not built_configs.changed(model)


def test_an_added_attribute_and_a_value_without_plain_equality() -> None:
    model = Model()
    built_configs.remember(model)
    model.ddp_config.new_option = 1
    assert built_configs.changed(model)
    other = Model()
    built_configs.remember(other)
    other.ddp_config.scale = torch.zeros(2)  # != gives a tensor: compared by identity
    assert built_configs.changed(other)


def test_a_config_without_attributes_or_a_model_without_weak_references_is_not_remembered(
        ) -> None:
    """Remembering runs while the model is built: it must never raise there."""

    class SlotsConfig:
        __slots__ = ("gradient_reduce_div_fusion",)

    model = Model()
    model.ddp_config = SlotsConfig()
    built_configs.remember(model)
    assert not built_configs.changed(model)
    plain = SimpleNamespace(ddp_config=Config())  # no weak references
    built_configs.remember(plain)
    assert not built_configs.changed(plain)
