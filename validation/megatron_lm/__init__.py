"""Megatron-LM's own training loop on one GPU: ``pretrain_gpt.py``, unchanged, with mock data.

Every run trains ``ITERS`` iterations of ``MICROBATCHES`` microbatches through
``megatron.training.pretrain`` (``forward_backward_no_pipelining``, ``finalize_model_grads``, the
distributed optimizer, gradient clipping) with ``--use-megatron-fsdp``, and is compared bit for
bit, iteration by iteration, with the same run serialized (``CUDA_LAUNCH_BLOCKING=1``): the
reported losses, the grad norm, the reduced gradient (every gradient buffer after the
iteration) and the updated parameters (every weight buffer).

``megatron/training`` comes from the megatron-core wheel; ``pretrain_gpt.py``,
``gpt_builders.py`` and ``model_provider.py`` from a Megatron-LM checkout given by
``--megatron-lm [RELEASE=]DIR`` whose ``megatron/training`` must be the wheel's, file for file
(``training_differences``; a checkout that differs is refused). The three scripts are copied
into the run's own folder and run from there, so the checkout's ``megatron/`` never shadows the
wheel. What the process needs around the script goes in through ``PYTHONPATH``
(``validation/mlm_inject/sitecustomize.py``): the fake group's NCCL semantics and the slow
reduce-scatter, the APEX stub, the shipped dataset helpers, and the capture.

Runs (``plan``), most important first:
* ``dp2``: data-parallel size 2 in one process, Megatron-LM's ``--fake-process-group`` with
  ``WORLD_SIZE=2`` and NCCL work semantics, a reduce-scatter delayed 0 and 20 ms; each
  configuration as shipped, with the hotfix (``mfsdp-hotfix run --``) and with
  ``--fsdp-double-buffer`` left out, each against its own serialized run; the audit route
  (``mfsdp-hotfix audit``) with and without ``MFSDP_HOTFIX=0`` beside ZeRO-3.
* ``dp1``: world size 1 with real NCCL through ``torchrun``, the plain user route, and the
  audit route on it. At a data-parallel size of 1 the gradient buffer is not distributed and
  ``fetch_bucket`` returns a view of it: no gradient-pool slot is ever taken, which the capture
  counts (``pool_allocations``); those runs are smoke tests.
* ``unit``: Megatron-LM's own Megatron-FSDP unit tests from the same checkout, through
  ``torchrun --nproc-per-node 1 -m pytest``, as shipped and with the hotfix.

    python3 validation/megatron_lm --megatron-lm core-0.19.2=ML19 \\
        --megatron-lm core-0.18.2=ML18 --out megatron-lm.json       # GPU
    python3 validation/megatron_lm --dry                             # the plan, no GPU
    python3 validation/megatron_lm --summary megatron-lm.json        # the summary rows

The modules, in the order of a call: ``plan`` (the runs), ``arguments`` (a run's command line
for ``pretrain_gpt.py``, checked by the release's own parser), ``stage`` (a checkout against
the wheel, copied into the run's folder), ``launch`` (one run's process), ``outcome`` (its
record and outcome), ``unit_tests`` (Megatron-LM's unit tests), ``driver`` (the runs side by
side within the time budget), ``record`` (the raw record of a call), ``summary`` (records joined
into summaries), ``tables`` (a summary's markdown tables); ``__main__`` is the command line.
"""
