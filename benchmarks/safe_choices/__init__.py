"""What the safe choices cost: step time and peak memory with real TransformerEngine, one GPU.

    python3 benchmarks/safe_choices --out $OUT/safe_choices.json   # GPU, TE importable
    python3 benchmarks/safe_choices --smoke --out $OUT/smoke.json   # tiny, every code path
    python3 benchmarks/safe_choices --dry                           # the plan; no GPU
    python3 benchmarks/safe_choices --report safe_choices.json      # docs/PERFORMANCE.md

Four variants of one model, each in its own worker process (the hotfix
patches at import, so it is per process):

* ``hotfix``: ``import mfsdp_hotfix`` first, TE fused wgrad accumulation, ``fsdp_double_buffer``;
* ``no-db``: as shipped, fused wgrad, ``fsdp_double_buffer=False`` (safe);
* ``fuse-off``: as shipped, ``fuse_wgrad_accumulation=False`` beside the double buffer, the
  workaround Megatron-Bridge and ROCm users run today (unsafe: the slot race remains);
* ``shipped``: as shipped, fused wgrad and double buffer (the unsafe default), for reference.

Model: identical FSDP units of real TE layers in bf16, the parameter GEMMs of a transformer
layer: ``te.LayerNormLinear(h, 3h)`` (QKV), ``te.Linear(h, h)`` (attention output projection;
the attention core, which has no parameters, is replaced by an elementwise gate of V by Q and K)
and ``te.LayerNormMLP(h, ffn)``. Default 6 units at h 4096, ffn 16384: 1.21 B parameters, so the
GEMMs dominate a step (at 8 x hidden 2048 fp32 it was launch-bound). One step: zero the gradient
buffer, forward and backward of every microbatch, ``finish_grad_sync()``; no optimizer step
(the same work in every variant). Timed with CUDA events, one event pair per step.

Megatron-FSDP runs on a fake process group of world size 2 on one GPU, with NCCL work semantics
(``validation/fakepg_shims.py``), a (2, 1) dp/tp mesh, exactly as ``validation/harness.py`` does.
Its collectives are local copies: what is measured is the GPU work of each variant and the
ordering the hotfix adds, not the network.

Order: groups (release, ZeRO level) one after another. A group starts its four workers in
parallel (imports, model build and a first warm-up, about 25 s with TE; nothing is timed then),
then gives them turns one at a time, repetition by repetition, the variants in the same order
(A B C D A B C D ...): in its turn a worker runs ``--warmup`` steps and ``--steps`` timed steps
while the others wait idle on their stdin, so only one process uses the GPU while timing. Each
turn's peak memory is ``torch.cuda.max_memory_allocated()`` over its timed steps. A group
starts only if it fits in what is left of ``--budget-s`` at the longest group time seen so far
(the first group always runs). Ratios are taken within one repetition (each variant's median
step time over the hotfix's median in the same repetition), then summarized over repetitions
(median, min, max). Workers' logs go to /tmp/safe_choices_logs; the results to the one JSON.

The modules, each importing only those before it: ``plan`` (variants, sizes, groups, turns),
``worker`` (the process protocol), ``driver`` (groups and turns under the time budget), ``model``
(the TE units), ``build`` (one variant's imports, model and check), ``summary`` (ratios within
repetitions; its step statistics serve the measure too), ``measure`` (a variant's warm-up and
timed turns), ``report`` (the tables), ``record`` (the one JSON of a GPU call), ``__main__``
(the command line).
"""

from __future__ import annotations

import os
import sys

PACKAGE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(PACKAGE))
VALIDATION = os.path.join(REPO, "validation")
sys.path.insert(0, VALIDATION)  # the validation scripts it builds on, by their bare names
