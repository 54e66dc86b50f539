"""Which release of a distribution is installed, and what kind of label it carries.

Only the distribution's metadata is trusted: the ``package_info.py`` vendored inside megatron-core
reports the wrong Megatron-FSDP version in several releases. A label corroborates the code shape,
it never decides it: only a final release label (``0.18.2``) can name a release whose code the
registry knows. A pre-release (``0.18.0rc0``), dev (``0.5.0.dev3``), post or local label
(``0.19.0+d199bb9``, what a git checkout of Megatron-LM installs as) names no release at all,
and such a copy is judged by its code shape alone.
"""

from __future__ import annotations

from importlib import metadata

# Kinds of label, as status reports them.
NONE, INVALID, RELEASE = "none", "invalid", "release"
LOCAL, DEV, PRE_RELEASE, POST_RELEASE = "local", "dev", "pre-release", "post-release"


def installed_version(distribution: str, near: str | None = None, fallback: bool = True
                      ) -> str | None:
    """The version string of ``distribution``, or None when no metadata is found.

    ``near`` is the folder the package was imported from: when given, metadata found next to it
    (the same ``sys.path`` entry) is preferred, so that two copies on one path report their own.
    ``fallback`` False: only ``near`` counts (a folder read from disk, not this environment's).
    """
    if near is not None:
        for dist in metadata.distributions(path=[near]):
            if _normalise(dist.metadata["Name"] or "") == _normalise(distribution):
                return dist.version
        if not fallback:
            return None
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def label_kind(version: str | None) -> str:
    """``"release"`` for a final label; otherwise why the label names no release: ``"local"``
    (a ``+`` build label, e.g. a git install), ``"dev"``, ``"pre-release"``, ``"post-release"``,
    ``"none"`` (no metadata) or ``"invalid"`` (not PEP 440)."""
    if not version:
        return NONE
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return INVALID
    if parsed.local is not None:
        return LOCAL
    if parsed.is_devrelease:
        return DEV
    if parsed.is_prerelease:
        return PRE_RELEASE
    if parsed.is_postrelease:
        return POST_RELEASE
    return RELEASE


def final_release(version: str | None) -> str | None:
    """``"0.18.2"`` for a final release label (``"0.18"`` → ``"0.18.0"``); None for any other."""
    if label_kind(version) != RELEASE:
        return None
    from packaging.version import Version

    parsed = Version(version or "")
    if parsed.epoch:
        return None
    release = parsed.release
    return ".".join(str(n) for n in release + (0,) * (3 - len(release)))


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
