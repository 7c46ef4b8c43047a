"""``TagError``: the error a tag request that cannot be served raises, shown as ``jaxtrace.TagError``;
and ``NoTags``, the empty result of a transform that found no tags, whose reads say so."""

from __future__ import annotations

import jax.tree_util as jtu

__all__ = ["TagError", "NoTagsError", "NoTags"]


class TagError(ValueError):
    """A tag that jaxtrace cannot split, or a request for tags that do not exist."""


# Tracebacks name it where users import it from (``jaxtrace.TagError``), not this private module.
TagError.__module__ = "jaxtrace"


class NoTagsError(TagError, KeyError):
    """A name read from the results of a transform that found no tags: a ``TagError`` that
    ``except KeyError`` catches too, as a dict's missing key."""

    __str__ = BaseException.__str__  # the sentence as it is (KeyError would print its repr)


class NoTags(dict):
    """The empty ``{name: ...}`` of a transform that found no tags in its function: reading a name
    raises a ``NoTagsError`` saying that no tags were found and how to tag (``fix``). It is ``{}``
    in every other way, and a pytree with no leaves, so it passes through ``jax.jit``."""

    def __init__(self, who: str, fix: str):
        super().__init__()
        self.who, self.fix = who, fix

    def __missing__(self, name):
        raise NoTagsError(f"{self.who} found no tags in the function it ran, so it has nothing named {name!r}. {self.fix}")

    def __reduce__(self):
        return NoTags, (self.who, self.fix)


jtu.register_pytree_with_keys(
    NoTags,
    lambda tree: ((), (tree.who, tree.fix)),
    lambda aux, children: NoTags(*aux),
    lambda tree: ((), (tree.who, tree.fix)),
)
