"""Seams of the core split (issue 34): a tag called under jax.vmap and also unbatched, one tag
vmapped over a different axis in each branch of a cond, and literal constants in the runs of
equations that are spliced as one cached call. Every number against the hand-written ``+ eps``
program (float64), eager and under jit."""

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_trees_close

import jaxtrace as jt

XS = jnp.arange(12.0).reshape(4, 3) / 7 - 0.5

# --- a tag called under vmap and once unbatched: the documented TagError, in either order ------


def vmapped_and_plain(order, repeated):
    def g(v):
        return jnp.sum(jnp.sin(jt.tag(v * 2.0, "h", repeated=repeated)))

    def f(x):
        batched = lambda: jnp.sum(jax.vmap(g)(x))  # noqa: E731
        plain = lambda: g(x[0])  # noqa: E731
        return batched() + plain() if order == "vmap_first" else plain() + batched()

    return f


TRANSFORMS = {
    "grad": lambda f: jt.grad(f),
    "grad_with_values": lambda f: jt.grad(f, with_values=True),
    "value_and_grad_with_values": lambda f: jt.value_and_grad(f, with_values=True),
    "capture": lambda f: jt.capture(f),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("order", ["vmap_first", "plain_first"])
@pytest.mark.parametrize("repeated", [False, True])
def test_a_tag_called_under_vmap_and_unbatched_is_a_tag_error(maybe_jit, transform, order, repeated):
    f = vmapped_and_plain(order, repeated)
    message = "different shapes" if repeated else "used at 2 sites"
    with pytest.raises(jt.TagError, match=message):
        maybe_jit(TRANSFORMS[transform](f))(XS)


def test_a_tag_called_under_vmap_and_unbatched_does_not_stop_other_tags(maybe_jit):
    def f(x, e=None):
        y = jt.tag(jnp.cos(x), "other") if e is None else jnp.cos(x) + e
        return vmapped_and_plain("vmap_first", False)(y)

    _, tag_grads = maybe_jit(jt.grad(f, tags="other"))(XS)
    assert_trees_close(tag_grads["other"], jax.grad(f, argnums=1)(XS, jnp.zeros_like(XS)))
