"""One module per fix; each exposes ``apply(...) -> undo`` and touches only class attributes."""
