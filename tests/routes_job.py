"""A small training job as a user starts one (``torchrun --nproc-per-node 2 job.py``), for the
route tests: each rank trains the Megatron-FSDP copy installed in its environment for one
iteration (on CPU: the selftest's ``torch.cuda`` stand-in and gloo), and rank 0 prints one JSON
line saying how the hotfix came into the process and what it applied.

The job does not load the hotfix itself (its harness import would, as ``import``): the route
under test (the ``.pth``, ``mfsdp-hotfix run``/``audit``) has to, and ``loaded_via`` says which.

    torchrun --standalone --nproc-per-node 2 job.py STORE_PATH
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    from mfsdp_hotfix.selftest.spec import CaseSpec
    from mfsdp_hotfix.selftest.worker import run_rank

    rank = int(os.environ["RANK"])
    report = run_rank(CaseSpec(iterations=1), rank, int(os.environ["WORLD_SIZE"]), sys.argv[1])
    import torch.distributed as dist

    import mfsdp_hotfix

    if rank == 0:
        status = mfsdp_hotfix.status()
        applied = {f"{copy['package']} {fix}": state["state"]
                   for copy in status["copies"] for fix, state in copy["fixes"].items()}
        print("JOB " + json.dumps({
            "loaded_via": status["loaded_via"], "hotfix": status["hotfix"], "fixes": applied,
            "crashed": report["crashed"], "exception": report.get("exception"),
            "max_abs_grad_error": report.get("max_abs_grad_error"),
            "summary": mfsdp_hotfix.summary()}), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if report["crashed"] else 0)
