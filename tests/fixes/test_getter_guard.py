"""The guarded getter's binding: deepcopy and pickle behave as they do for the release's own
getter, and the copy stays guarded. The release's closure is stood in for by a local function of
the same kind (a per-parameter bound closure); the real closure is exercised by the
real-library tests."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mfsdp_hotfix.fixes import getter_guard  # noqa: E402


class Pipeline:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def _enforce_double_buffer_limit(self, add_buckets: list[int]) -> None:
        self.calls.append(add_buckets)


class Model:
    def __init__(self, buffer: Any, pipeline: Pipeline) -> None:
        self.param_and_grad_buffer, self.grad_reduce_pipeline = buffer, pipeline


def build() -> tuple[Any, Any, Pipeline]:
    param = torch.nn.Parameter(torch.zeros(4))
    param._gbuf = SimpleNamespace(bucket_id=3)
    param._main = torch.ones(4)

    def main_grad_getter(p: Any) -> Any:  # like the release: a local closure bound per param
        return p._main

    param.get_main_grad = main_grad_getter.__get__(param)
    pipeline = Pipeline()
    buffer = SimpleNamespace(parameter_groups=[SimpleNamespace(params=[param])])
    model = Model(buffer, pipeline)
    return param, model, pipeline


def test_guard_drains_then_fetches() -> None:
    param, model, pipeline = build()
    assert getter_guard.link(model) == 1
    assert param.get_main_grad() is param._main
    assert pipeline.calls == [[3]]
    assert getter_guard.link(model) == 0  # idempotent


def test_deepcopy_behaves_as_unpatched() -> None:
    plain, _, _ = build()
    param, model, pipeline = build()
    getter_guard.link(model)
    clone, plain_clone = copy.deepcopy(param), copy.deepcopy(plain)
    assert torch.equal(clone, param)
    assert hasattr(clone, "get_main_grad") == hasattr(plain_clone, "get_main_grad")
    if hasattr(clone, "get_main_grad"):  # torch versions that copy a Parameter's __dict__
        assert clone.get_main_grad.__self__ is clone and getter_guard.is_guarded(clone)
        assert clone.get_main_grad() is clone._main
        assert pipeline.calls == [[3]]


def outcome(obj: Any) -> str:
    try:
        pickle.loads(pickle.dumps(obj))
    except Exception as exc:
        return type(exc).__name__
    return "ok"


def test_pickle_behaves_as_unpatched() -> None:
    plain, _, _ = build()
    guarded, model, _ = build()
    getter_guard.link(model)
    assert outcome(guarded) == outcome(plain)


def test_unlink_restores_the_release_getter() -> None:
    param, model, pipeline = build()
    original = param.get_main_grad.__func__
    getter_guard.link(model)
    getter_guard.unlink(model)
    assert param.get_main_grad.__func__ is original
    assert not hasattr(model.param_and_grad_buffer, "grad_reduce_pipeline")
    param.get_main_grad()
    assert pipeline.calls == []
