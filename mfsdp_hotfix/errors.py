"""Every error type the package raises, at the bottom of the layers so that the modules raising
them need not import one another (nor the package that re-exports the public ones). Each module
that raises one imports it from here; its docstring says why it exists."""


class HotfixRefused(RuntimeError):
    """Strict mode: a Megatron-FSDP copy was found that the hotfix cannot verify."""


class UnsupportedConfiguration(RuntimeError):
    """A ``MegatronFSDP`` was built in a configuration that fails on this release and that the
    hotfix could not repair here; the message names the release, the configuration and the
    workaround."""


class RankMismatch(RuntimeError):
    """Ranks of one job run differently patched Megatron-FSDP code."""


class TreeError(Exception):
    """DIR cannot be judged: missing, not a folder, unreadable, or holding no copy."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class SourceUnavailable(Exception):
    """The code has no readable source (for example a bytecode-only install)."""


class Unknown(Exception):
    """An expression a recogniser's evaluator does not evaluate (``structure.decisions``)."""


class ProtocolError(TypeError):
    """The release lacks an API the accumulation protocol needs (the message names it)."""


class CannotRun(Exception):
    """The GPU selftest cannot run here (no CUDA GPU, too few GPUs, no TransformerEngine for a
    TE layer); the message says what to do."""


class AuditArmedFirst(RuntimeError):
    """The on-the-job audit was armed before the CUDA stand-in was installed."""
