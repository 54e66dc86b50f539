"""``mfsdp-hotfix parity`` proved on one GPU, on Megatron-LM's own ``pretrain_gpt.py``.

Every case is one parity check run as a user runs it: the package installed with ``pip install``
(its ``mfsdp_hotfix.pth`` loads the hotfix in every process of the job), then

    mfsdp-hotfix parity --json --out CASE_DIR --iters 3 [--with-shipped] \\
        -- torchrun --nproc-per-node 1 --master-port PORT pretrain_gpt.py ARGS

in a folder of the case's own, with ``ARGS`` a small GPT's (or MoE's) command line from
``validation/megatron_lm`` (``pretrain_args``: Megatron-FSDP, the double buffer, overlapped
reduce-scatter and all-gather, fused wgrad accumulation as Megatron-LM's default, mock data, four
microbatches an iteration). The case records the verdict, the exit status, the command's JSON,
each run's first-iteration grad norm and losses and the hotfix's state as the command saw it, the
time the check took, and the output tails of a case that failed or whose verdict is not the
expected one.

What goes into the process around the unchanged script goes in as in ``validation/megatron_lm``,
through ``PYTHONPATH`` (``validation/mlm_inject``, with ``MFSDP_VAL_MLM_INJECT=1``: the APEX stub,
the shipped dataset helpers and, for two ranks on one GPU, the fake process group's NCCL work
semantics; no capture of its own: the command's capture is the one that counts).

The modules, in the order of a call: ``plan`` (the cases, most important first, ``--groups`` and
``--only``), ``command`` (a case's exact command line and environment), ``reading`` (what a case's
JSON says), ``driver`` (the cases side by side within the time budget, TE built meanwhile),
``record`` (the call's record, rewritten as each case ends), ``tables`` (the table of
``docs/PARITY.md`` and the noise floors measured); ``__main__`` is the command line.
``--check-args`` runs every run of each case as the command plans it (the candidate, the reference
rewritten to Megatron's DDP, the shipped run) through the release's own
``parse_and_validate_args`` on the CPU (DIR: the unpacked megatron-core wheel; megatron-core 0.18
and later import triton, which must be importable there).

    python3 validation/parity_gpu --dry                                   # every command line
    python3 validation/parity_gpu --check-args core-0.19.2=DIR            # the release's parser
    bash validation/parity_gpu_call.sh .gpu --releases core-0.19.2        # GPU (one call)
    python3 validation/parity_gpu --report RECORD...                      # the table
"""
