"""jaxtrace.plot: figures are produced from real statistics and saved; the core never imports matplotlib."""

import doctest
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

PNG = b"\x89PNG\r\n\x1a\n"


def test_core_does_not_import_matplotlib_and_plot_says_how_to_install():
    code = textwrap.dedent(
        """
        import sys
        import jaxtrace, jaxtrace.stats
        assert "matplotlib" not in sys.modules, "the core imported matplotlib"
        sys.modules["matplotlib"] = None  # as if it were not installed
        try:
            import jaxtrace.plot
        except ImportError as e:
            print("MESSAGE:", e)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'pip install -e ".[plot]"' in out.stdout


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jaxtrace as jt  # noqa: E402

try:
    from jaxtrace import plot
except ImportError:  # matplotlib is not installed: only the test above runs
    plot = None
needs_matplotlib = pytest.mark.skipif(
    plot is None, reason='matplotlib is not installed (pip install -e ".[plot]")'
)


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG


@pytest.fixture(scope="module")
def history():
    """A History from a real jitted loop: three layer tags and one in a scan."""

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            h = jt.tag(jnp.tanh(h @ w), f"layers.{i}")

        def step(c, _):
            c = jt.tag(jnp.tanh(c * 0.9), "loop")
            return c, None

        h, _ = lax.scan(step, h, None, length=4)
        return jnp.mean(h**2)

    ws = [jax.random.normal(jax.random.PRNGKey(i), (5, 5)) / 2 for i in range(3)]
    x = jax.random.normal(jax.random.PRNGKey(9), (8, 5))
    step = jax.jit(jt.stats.value_and_grad(loss))
    history = jt.stats.History()
    for i in range(4):
        value, (grads, tag_stats) = step(ws, x)
        history.append(10 * i, tag_stats, loss=value)
        ws = [w - 0.5 * g for w, g in zip(ws, grads)]
    return history


@needs_matplotlib
def test_grad_flow(history, tmp_path):
    path = tmp_path / "sub" / "grad_flow.png"
    fig = plot.grad_flow(history, path=path, title="test")
    assert _is_png(path)
    lines, bars = fig.axes
    loops = [f"loop[{i}]" for i in range(4)]
    assert [line.get_label() for line in lines.lines] == ["layers.0", "layers.1", "layers.2", *loops]
    np.testing.assert_allclose(lines.lines[0].get_xdata(), [0, 10, 20, 30])
    np.testing.assert_allclose(lines.lines[1].get_ydata(), history.array("layers.1", "norm"), rtol=1e-12)
    # the scan tag (4 norms per step): one line per step of the loop, never reduced over them
    loop = history.array("loop", "norm")
    for i in range(4):
        np.testing.assert_allclose(lines.lines[3 + i].get_ydata(), loop[:, i], rtol=1e-12)
    heights = [p.get_height() for p in bars.patches]
    assert len(heights) == 14  # max |g| and mean |g| for each of the 7 entries (3 tags, 4 loop steps)
    assert [t.get_text() for t in bars.get_xticklabels()] == ["layers.0", "layers.1", "layers.2", *loops]
    np.testing.assert_allclose(heights[7], history.array("layers.0", "mean_abs")[-1], rtol=1e-12)
    np.testing.assert_allclose(heights[3:7], history.array("loop", "max_abs")[-1], rtol=1e-12)
    assert bars.get_title() == "|g| per tag at step 30"


@needs_matplotlib
def test_grad_flow_one_stat_and_nonfinite(tmp_path):
    h = jt.stats.History()
    h.append(0, {"a": {"norm": 1.0, "nonfinite": 0.0}, "b": {"norm": np.inf, "nonfinite": 0.5}})
    fig = plot.grad_flow(h, path=tmp_path / "g.png")
    assert _is_png(tmp_path / "g.png")
    assert len(fig.axes[1].patches) == 3  # two bars and one red span for the non-finite tag
    with pytest.raises(ValueError, match="no statistics"):
        plot.grad_flow(jt.stats.History())


@needs_matplotlib
def test_timestep_norms(tmp_path):
    t = np.arange(30)
    per_example = np.exp(-0.1 * t)[:, None] * np.linspace(1, 2, 5)[None]
    fig = plot.timestep_norms({"rnn": 0.8**t, "gru": per_example}, path=tmp_path / "t.png")
    assert _is_png(tmp_path / "t.png")
    (ax,) = fig.axes
    rnn, gru = ax.lines
    np.testing.assert_allclose(rnn.get_ydata(), 0.8**t)
    np.testing.assert_allclose(gru.get_ydata(), np.median(per_example, axis=1))
    assert len(ax.collections) == 1  # the percentile band of the (T, B) entry
    with pytest.raises(ValueError, match="expected \\(T,\\) or \\(T, B\\)"):
        plot.timestep_norms({"x": np.ones((2, 2, 2))})


@needs_matplotlib
def test_overlay(tmp_path):
    rng = np.random.default_rng(0)
    grey, rgb, cam = rng.random((16, 16)), rng.random((16, 16, 3)), rng.random((4, 4))
    fig = plot.overlay([grey, rgb, grey], [cam, cam, None], titles=["a", "b", "c"], ncols=2, path=tmp_path / "o.png")
    assert _is_png(tmp_path / "o.png")
    assert len(fig.axes) == 4  # a 2 x 2 grid, the last panel empty
    assert [ax.get_title() for ax in fig.axes] == ["a", "b", "c", ""]
    assert [len(ax.images) for ax in fig.axes] == [2, 2, 1, 0]
    np.testing.assert_allclose(fig.axes[0].images[1].get_array(), cam / cam.max())
    shared = plot.overlay([grey, grey], [cam, cam / 2], vmax=cam.max())  # one scale for both maps
    np.testing.assert_allclose(shared.axes[1].images[1].get_array(), cam / 2 / cam.max())
    assert len(shared.axes) == 3  # and one colorbar shows that scale, in the maps' units
    assert shared.axes[2].get_ylim() == pytest.approx((0, cam.max()))
    assert len(plot.overlay([grey, grey], [cam, cam], vmax=1.0, colorbar=False).axes) == 2
    assert fig.axes[0].images[1].get_extent() == [0, 16, 16, 0]  # the coarse map covers the image
    single = plot.overlay(grey, cam)
    assert len(single.axes) == 1
    with pytest.raises(ValueError, match="2 images but 1 heatmaps"):
        plot.overlay([grey, grey], [cam])


@needs_matplotlib
def test_paths_heatmap_marks_terms_that_do_not_reach_a_tag(tmp_path):
    table = {
        "h": {"ce": {"norm": np.float32(0.5)}, "aux": {"norm": np.float32(0.0)}},
        "g": {"ce": {"norm": np.ones(3) * 0.05}, "aux": {"norm": np.float32(3.0)}},
    }
    fig = plot.paths(table, tags=["g", "h"], path=tmp_path / "paths.png")
    assert (tmp_path / "paths.png").read_bytes()[:8] == PNG
    ax = fig.axes[0]
    # g has 3 loop steps: a row each; its aux cell, with no loop axes, is the same in each row
    assert [t.get_text() for t in ax.get_yticklabels()] == ["g[0]", "g[1]", "g[2]", "h"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ce", "aux"]
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("x  no path") == 1 and texts.count("0.05") == 3 and texts.count("3") == 3


@needs_matplotlib
def test_paths_compared_panels_share_one_colour_scale(tmp_path):
    """Side by side, one value has one colour: one norm for all panels, and one colorbar shows it."""
    clean = {"h": {"ce": {"norm": 0.5}, "aux": {"norm": 2.0}}, "g": {"ce": {"norm": 0.01}, "aux": {"norm": 1.0}}}
    buggy = {"h": {"ce": {"norm": 0.5}, "aux": {"norm": 0.0}}, "g": {"ce": {"norm": 0.01}, "aux": {"norm": 0.0}}}
    fig = plot.paths([clean, buggy], titles=["clean", "buggy"], title="t", path=tmp_path / "two.png")
    assert (tmp_path / "two.png").read_bytes()[:8] == PNG
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == ["clean", "buggy"]
    norms = [ax.images[0].norm for ax in panels]
    assert norms[0] is norms[1]
    np.testing.assert_allclose([norms[0].vmin, norms[0].vmax], np.log10([0.01, 2.0]))
    # the unchanged cell ("h", "ce") is drawn in the same colour in both panels
    colours = [ax.images[0].to_rgba(ax.images[0].get_array())[0, 0] for ax in panels]
    np.testing.assert_array_equal(colours[0], colours[1])
    (colorbar,) = [ax for ax in fig.axes if ax not in panels]
    assert colorbar.get_ylabel() == "log10 norm"
    assert [t.get_text() for t in panels[1].texts].count("x  no path") == 2
    with pytest.raises(ValueError, match="1 titles for 2 tables"):
        plot.paths([clean, buggy], titles=["one"])


def test_docstring_examples():
    assert doctest.testmod(plot, optionflags=doctest.ELLIPSIS).failed == 0
