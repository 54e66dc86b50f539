"""Which release of a distribution is installed, as a comparable release tuple.

Only the distribution's metadata is trusted: the ``package_info.py`` vendored inside megatron-core
reports the wrong Megatron-FSDP version in several releases. Local labels (``+git1234``),
pre-releases and dev releases map to their release tuple (``0.5.0rc1`` → ``(0, 5, 0)``), so that a
release candidate is judged like the release it precedes; the code shape decides the rest.
"""

from __future__ import annotations

from importlib import metadata


def installed_version(distribution: str, near: str | None = None) -> str | None:
    """The version string of ``distribution``, or None when no metadata is found.

    ``near`` is the folder the package was imported from: when given, metadata found next to it
    (the same ``sys.path`` entry) is preferred, so that two copies on one path report their own.
    """
    if near is not None:
        for dist in metadata.distributions(path=[near]):
            if _normalise(dist.metadata["Name"] or "") == _normalise(distribution):
                return dist.version
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def release_tuple(version: str | None) -> tuple[int, ...] | None:
    """``"0.18.2+abc"`` → ``(0, 18, 2)``; None when absent or not PEP 440."""
    if not version:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return tuple(release) + (0,) * (3 - len(release))


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
