"""Code shapes recognised by structure rather than by text.

A fingerprint names one exact text; a fork or a backport that makes the same change in its own
words (ROCm/Megatron-LM PR #146 ports NVIDIA #5222's getter guard through
``self.grad_reduce_pipeline`` instead of ``p._megatron_fsdp_model.grad_reduce_pipeline``) has a
new text but the property the fixes care about. Each test here reads one function's source and
answers one yes/no question about its syntax tree; the registry names the test per shape
(:data:`RECOGNISERS`). One module per family of functions read, on the syntax-tree matchers of
:mod:`.syntax` (and, for the hooks and the overwrite setter, the decisions :mod:`.decisions`
evaluates).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from importlib import import_module


def _recognisers() -> dict[str, Callable[[str], bool]]:
    """Every module here that declares ``RECOGNISERS`` (its tests, in order), so that a new
    family of functions is one new module."""
    found: dict[str, Callable[[str], bool]] = {}
    for info in pkgutil.iter_modules(__path__):
        for test in getattr(import_module(f"{__name__}.{info.name}"), "RECOGNISERS", ()):
            assert test.__name__ not in found, f"two recognisers named {test.__name__}"
            found[test.__name__] = test
    return found


# Each test a registry shape names (``Shape.structure``), by that name.
RECOGNISERS: dict[str, Callable[[str], bool]] = _recognisers()
