"""The pool-ordering checker on a miniature pool/pipeline pair (``tests/miniature.py``; no
megatron, no torch needed).  Draining on the RS stream must be reported; draining on the writer's
stream must not.
"""

from __future__ import annotations

import pytest
from miniature import backward, miniature

from mfsdp_hotfix.selftest.ordering import OrderingChecker


def _backward(drain_on_rs_stream: bool, name: str = "fsdp_grads") -> OrderingChecker:
    checker = OrderingChecker()
    backward(checker.install, drain_on_rs_stream, name)
    return checker


def test_drain_on_rs_stream_is_reported() -> None:
    checker = _backward(drain_on_rs_stream=True)
    assert checker.checks == 3  # units 2, 1, 0 reuse a slot
    assert len(checker.violations) == 3
    v = checker.violations[0]
    assert (v.previous_bucket, v.new_bucket, v.writer) == (4, 2, "default")


def test_drain_on_writer_stream_is_clean() -> None:
    checker = _backward(drain_on_rs_stream=False)
    assert checker.checks == 3
    assert checker.violations == []


def test_only_gradient_pools_are_checked() -> None:
    checker = _backward(drain_on_rs_stream=True, name="fsdp_params")
    assert checker.checks == 0 and checker.violations == []


def test_wrappers_keep_the_release_behaviour() -> None:
    mini = miniature()
    OrderingChecker().install(mini)
    pool = mini.FixedPoolAllocator("fsdp_grads", [mini.Group() for _ in range(3)])
    pool.allocate(0)
    pool.allocate(1)
    with pytest.raises(AssertionError, match="No buffer found"):
        pool.allocate(2)
