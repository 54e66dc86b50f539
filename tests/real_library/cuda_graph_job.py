"""Build one Megatron-FSDP model on real megatron-core (its vendored copy, CPU, gloo, one rank)
whose wrapped module carries a real ``TransformerConfig``, and say whether building it raised.

A rank job (``tests/rank_jobs.py``). ``CONFIG_JSON``: the ``TransformerConfig`` keywords beyond a
one-layer model's (e.g. ``{"cuda_graph_impl": "transformer_engine"}``). Reports ``built``, or
the ``exception`` raised while building.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

VENDORED = "megatron.core.distributed.fsdp.src.megatron_fsdp"


def run(config: dict[str, Any], rank: int, world: int, store: str) -> dict[str, Any]:
    import mfsdp_hotfix  # noqa: F401  (the hooks patch the copy on import)
    from mfsdp_hotfix.selftest import cuda_standin

    cuda_standin.install()
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mfsdp_hotfix.selftest import model as model_lib
    from mfsdp_hotfix.selftest.wrapping import wrap

    dist.init_process_group("gloo", store=dist.FileStore(store, world),  # type: ignore[attr-defined]
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))
    net = model_lib.build(16, 2, 1234)
    net.config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, **config)
    fully_shard = importlib.import_module(VENDORED + ".fully_shard")
    try:
        wrap(fully_shard, net, model_lib.Unit, "optim_grads_params", False, torch.device("cpu"))
    except Exception as exc:
        return {"built": False, "exception": f"{type(exc).__name__}: {exc}"}
    return {"built": True}


if __name__ == "__main__":
    import rank_jobs

    rank_jobs.main(run)
