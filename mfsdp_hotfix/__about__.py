"""The package's version, in a module of its own so that any layer can read it without importing
the package (and so without an import cycle); ``pyproject.toml`` reads it from here."""

__version__ = "0.1.0"
