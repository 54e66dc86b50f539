"""``mfsdp-hotfix parity``: a user's own job run against Megatron's own DDP, every iteration
compared. This package reads the runs (``log_lines``, ``capture``), judges them (``floors``,
``comparison``) and says the verdict (``verdict_text``). Nothing here imports torch or Megatron
at module level: the command runs where neither is installed."""
