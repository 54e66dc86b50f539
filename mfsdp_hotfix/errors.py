"""The errors the public API raises, at the bottom of the layers so that the modules raising them
need not import the package that re-exports them."""


class HotfixRefused(RuntimeError):
    """Strict mode: a Megatron-FSDP copy was found that the hotfix cannot verify."""


class UnsupportedConfiguration(RuntimeError):
    """A ``MegatronFSDP`` was built in a configuration that fails on this release and that the
    hotfix could not repair here; the message names the release, the configuration and the
    workaround."""
