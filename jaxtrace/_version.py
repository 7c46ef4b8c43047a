"""The package version; pyproject.toml reads it from here (one source)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
