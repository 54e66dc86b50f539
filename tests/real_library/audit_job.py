"""A training job as torchrun starts it, for ``mfsdp-hotfix audit``: one selftest rank (the
CPU stand-in, real Megatron-FSDP on gloo) per process, then a normal exit, so that the audit's
exit step runs as it does in a user's job.

    torchrun --nproc-per-node 2 audit_job.py SPEC_JSON STORE_PATH
"""

from __future__ import annotations

import os
import sys

from mfsdp_hotfix.selftest.spec import CaseSpec
from mfsdp_hotfix.selftest.worker import run_rank

if __name__ == "__main__":
    spec_json, store_path = sys.argv[1:]
    report = run_rank(CaseSpec.from_json(spec_json), int(os.environ["RANK"]),
                      int(os.environ["WORLD_SIZE"]), store_path)
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.exit(1 if report["crashed"] else 0)
