"""The package version: pyproject.toml and ``--version`` read it here."""

__version__ = "0.1.0"
