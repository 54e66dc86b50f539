"""Build one Megatron-FSDP model on real megatron-core (its vendored copy, CPU, gloo, one rank)
whose wrapped module carries a real ``TransformerConfig``, and say whether building it raised.

Run as ``python cuda_graph_job.py CONFIG_JSON OUT`` with the megatron-core release first on
``PYTHONPATH`` and the repository after it; ``MFSDP_HOTFIX=0`` in the environment runs the release
as shipped. ``CONFIG_JSON``: the ``TransformerConfig`` keywords beyond a one-layer model's (e.g.
``{"cuda_graph_impl": "transformer_engine"}``). Writes ``OUT/result.json``: ``built``, or the
``exception`` raised while building.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

VENDORED = "megatron.core.distributed.fsdp.src.megatron_fsdp"


def build(settings: dict[str, Any], store: str) -> dict[str, Any]:
    import mfsdp_hotfix  # noqa: F401  (the hooks patch the copy on import)
    from mfsdp_hotfix.selftest import cuda_standin

    cuda_standin.install()
    import importlib

    import torch
    import torch.distributed as dist
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mfsdp_hotfix.selftest import model as model_lib
    from mfsdp_hotfix.selftest.wrapping import wrap

    dist.init_process_group("gloo", store=dist.FileStore(store, 1),  # type: ignore[attr-defined]
                            rank=0, world_size=1, timeout=timedelta(seconds=60))
    net = model_lib.build(16, 2, 1234)
    net.config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1,
                                   **settings)
    fully_shard = importlib.import_module(VENDORED + ".fully_shard")
    try:
        wrap(fully_shard, net, model_lib.Unit, "optim_grads_params", False, torch.device("cpu"))
    except Exception as exc:
        return {"built": False, "exception": f"{type(exc).__name__}: {exc}"}
    return {"built": True}


def main(argv: list[str]) -> int:
    settings, out = argv
    try:
        result = build(json.loads(settings), f"{out}/store")
    except BaseException as exc:
        result = {"harness": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-4000:]}
    Path(out, "result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def run_job(release: Path, hotfix: bool, **settings: Any) -> dict[str, Any]:
    """One build, as a test runs it."""
    import subprocess
    import tempfile

    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="mfsdp-cuda-graph-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
        env.update(PYTHONPATH=os.pathsep.join([str(release), str(repo)]),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   **({} if hotfix else {"MFSDP_HOTFIX": "0"}))
        subprocess.run([sys.executable, __file__, json.dumps(settings), tmp], env=env,
                       capture_output=True, timeout=300, check=False)
        found: dict[str, Any] = json.loads(Path(tmp, "result.json").read_text())
    assert "harness" not in found, found
    return found


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
