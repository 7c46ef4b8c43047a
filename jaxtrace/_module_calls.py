"""How a tagged module's call is tagged, for every framework: the positional inputs as one value."""

from __future__ import annotations

from typing import Any, Callable


def tag_inputs(args: tuple, name: str, *, skip: Callable[[Any], bool], tag_arrays: Callable) -> tuple:
    """``args`` with the positional arguments that ``skip`` does not exclude (state, graph nodes)
    tagged as ``name``: one such argument as it is, several as a tuple."""
    where = [i for i, a in enumerate(args) if not skip(a)]
    if not where:
        return args
    chosen = tuple(args[i] for i in where)
    tagged = tag_arrays(chosen[0] if len(chosen) == 1 else chosen, name)
    tagged = (tagged,) if len(chosen) == 1 else tagged
    out = list(args)
    for i, value in zip(where, tagged):
        out[i] = value
    return tuple(out)
