"""The releases the registry verifies: the shape of each double-buffer function (getter, drain,
wait) that each release shipped, by distribution and version, and where a shape was shipped."""

from __future__ import annotations

from .registry import FUNCTIONS, Shape

# The shapes (getter, drain, wait) each verified release shipped, checked against every wheel by
# tests/test_detection.py. Only these labels can make a copy a "verified release".
_SHIPPED = (
    (("0.14", "0.14", "0.14"),
     {"megatron-core": "0.14.0 0.15.0 0.15.1 0.15.2 0.15.3 0.16.0 0.16.1",
      "megatron-fsdp": "0.1.0 0.2.0 0.2.1 0.2.2 0.2.3 0.3.0 0.3.1"}),
    (("0.17", "0.14", "0.17"), {"megatron-core": "0.17.0 0.17.1", "megatron-fsdp": "0.4.0"}),
    (("0.17", "0.18", "0.17"),
     {"megatron-core": "0.18.0 0.18.1 0.18.2", "megatron-fsdp": "0.5.0 0.5.1"}),
    (("0.19", "0.19", "0.17"),
     {"megatron-core": "0.19.0 0.19.1 0.19.2", "megatron-fsdp": "0.6.0 0.6.1"}),
)
# (distribution, "X.Y.Z") -> {function: shape name}
RELEASES: dict[tuple[str, str], dict[str, str]] = {
    (distribution, version): dict(zip(FUNCTIONS, names, strict=True))
    for names, by_distribution in _SHIPPED
    for distribution, versions in by_distribution.items()
    for version in versions.split()
}


def shipped_in(qualname: str, shape: Shape) -> str | None:
    """``"megatron-core 0.17.0-0.18.2, megatron-fsdp 0.4.0-0.5.1"``; None for a structural one."""
    parts = []
    for distribution in ("megatron-core", "megatron-fsdp"):
        found = sorted((tuple(int(n) for n in version.split(".")), version)
                       for (dist, version), shapes in RELEASES.items()
                       if dist == distribution and shapes.get(qualname) == shape.name)
        if found:
            first, last = found[0][1], found[-1][1]
            parts.append(f"{distribution} {first}" + (f"-{last}" if last != first else ""))
    return ", ".join(parts) or None
