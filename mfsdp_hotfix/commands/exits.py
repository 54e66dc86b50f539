"""The exit statuses of ``mfsdp-hotfix``'s commands, named once (docs/CLI.md tabulates them;
``tree.py`` names those of ``status --path``, ``audit/verdicts.py`` those of the audit's
verdicts)."""

# Exit status of a usage error (argparse's): no command, an unknown one, a bad option.
USAGE_ERROR = 2
# Exit codes of ``status --check``.
CHECK_OK, CHECK_UNFIXED = 0, 1
# Exit codes of ``selftest``: PASS, FAIL (a fix failed), and CANNOT RUN here (no torch, no
# numpy; --gpu: no CUDA GPU), a word of its own so that a grep for FAIL counts broken fixes only.
SELFTEST_PASS, SELFTEST_FAIL, SELFTEST_CANNOT_RUN = 0, 1, 2
# A reader that closed the pipe early (``mfsdp-hotfix status | head -1``): the shell's status
# for a command killed by SIGPIPE.
BROKEN_PIPE = 141
# A command stopped by a signal (the shell's 128 + N): Ctrl-C (SIGINT), SIGTERM (``kill``,
# ``timeout``), SIGHUP (the terminal closed). Every process it started is ended first.
INTERRUPTED, TERMINATED, HUNG_UP = 130, 143, 129
# ``run`` and ``audit`` when COMMAND cannot be started (the shell's status for a command not
# found or not executable).
CANNOT_START = 127
# Exit codes of ``parity``: the verdicts MATCH and MISMATCH, and CANNOT COMPARE (a run crashed,
# hung, printed no iteration, or the print is too coarse to decide); nothing run is a usage
# error, and a signal that stopped parity gives the shell's 128 + N.
PARITY_MATCH, PARITY_MISMATCH, PARITY_CANNOT_COMPARE = 0, 1, 4
