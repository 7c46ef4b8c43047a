"""``TagError``: the error a tag request that cannot be served raises, shown as ``jaxtrace.TagError``."""

from __future__ import annotations

__all__ = ["TagError"]


class TagError(ValueError):
    """A tag that jaxtrace cannot split, or a request for tags that do not exist."""


# Tracebacks name it where users import it from (``jaxtrace.TagError``), not this private module.
TagError.__module__ = "jaxtrace"
