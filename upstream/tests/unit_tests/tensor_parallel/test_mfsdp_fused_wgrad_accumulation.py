# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Regression test: with gradient accumulation fusion, megatron-core's linear adds a Megatron-FSDP
weight's gradient into ``main_grad`` unless ``overwrite_main_grad`` says to overwrite it.

Megatron-FSDP sets ``overwrite_main_grad`` on each parameter after its all-gather: True where
``get_main_grad()`` hands out a fresh bucket each microbatch (sharded gradients, ZeRO-2/3), False
where it returns the one unsharded buffer that sums the microbatches of a step (ZeRO-1,
``optim``). TransformerEngine's layers honour it. The Megatron-FSDP branch of
``LinearWithGradAccumulationAndAsyncCommunication.backward`` wrote the weight gradient over
``main_grad`` whatever it said, so with ZeRO-1 each microbatch's gradient of a
``ColumnParallelLinear`` or ``RowParallelLinear`` (the GPT output layer, every layer with
``--transformer-impl local``) erased the ones before it.

The path needs no GPU kernel of its own (the Megatron-FSDP branch uses TE's GEMM where TE is
installed, else torch's), so the test runs wherever megatron-core imports.
"""

import pytest
import torch

from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def mfsdp_weight(overwrite_main_grad):
    """A weight as Megatron-FSDP hands it to fused wgrad accumulation: ``__fsdp_param__``, a
    ``get_main_grad()`` that returns its gradient buffer, and ``overwrite_main_grad``."""
    weight = torch.nn.Parameter(torch.randn(32, 16, device=DEVICE))
    main_grad = torch.zeros_like(weight)
    weight.__fsdp_param__ = True
    weight.get_main_grad = lambda: main_grad
    weight.overwrite_main_grad = overwrite_main_grad
    return weight, main_grad


@pytest.mark.parametrize("overwrite_main_grad", [False, True])
def test_mfsdp_fused_wgrad_accumulates_unless_told_to_overwrite(overwrite_main_grad):
    weight, main_grad = mfsdp_weight(overwrite_main_grad)
    wgrads = []
    for _ in range(2):  # two microbatches of one optimizer step
        input_data = torch.randn(4, 3, 16, device=DEVICE)
        grad_output = torch.randn(4, 3, 32, device=DEVICE)
        output = linear_with_grad_accumulation_and_async_allreduce(
            input_data, weight, None, True, False, False
        )
        output.backward(grad_output)
        wgrads.append(grad_output.reshape(-1, 32).t().matmul(input_data.reshape(-1, 16)))

    expected = wgrads[1] if overwrite_main_grad else wgrads[0] + wgrads[1]
    torch.testing.assert_close(main_grad, expected)
    assert weight.grad is None  # the gradient went into main_grad only
