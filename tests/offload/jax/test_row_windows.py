"""`keras_lms.offload.jax.row_windows`: a rule evaluated over windows of rows equals the whole evaluation (float64:
to summation order), with operands of several rows per row and windows that do not divide the rows; the windows
are ordered by optimisation barriers in what JAX traces; and the windowed batch-norm backward (`lean_norm`) is
the derivative of the batch-norm formula, against ``jax.vjp`` in float64, and as close to Keras' own gradient in
float32 as the whole rule. What the windows do to the compiled program's memory: test_compiled_offload."""

from __future__ import annotations

import types

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_lms.offload.jax import lean_norm, row_windows  # noqa: E402

pytestmark = pytest.mark.jax


@pytest.fixture
def x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def _rule(a, b):
    """Sums over rows (of ``a`` and of ``a`` against ``b``'s row pairs) and a row-local map (``b``: 2 rows a row)."""
    pairs = b.reshape(b.shape[0], a.shape[1], 2, *b.shape[2:]).sum(axis=2)
    return (jnp.sum(a, axis=(0, 1)), jnp.sum(a * pairs)), jnp.tanh(a) * pairs


@pytest.mark.parametrize("windows", [2, 3, 7])
def test_over_rows_equals_the_whole_evaluation(x64, windows):
    rng = np.random.default_rng(0)
    a, b = jnp.asarray(rng.normal(size=(2, 7, 5))), jnp.asarray(rng.normal(size=(2, 14, 5)))
    whole = _rule(a, b)
    got = row_windows.over_rows(_rule, [a, b], [1, 2], 7, windows, out=(a.shape, a.dtype, 1))
    for w, g in zip(jax.tree.leaves(whole), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-13, atol=1e-13)
    # the windows are ordered: one barrier before the output buffer, one between consecutive windows
    jaxpr = jax.make_jaxpr(lambda a, b: row_windows.over_rows(_rule, [a, b], [1, 2], 7, windows,
                                                              out=(a.shape, a.dtype, 1)))(a, b)
    assert str(jaxpr).count("optimization_barrier") == windows
    # the control: one window is the rule itself, with no barrier
    assert "optimization_barrier" not in str(jax.make_jaxpr(lambda a, b: row_windows.over_rows(
        _rule, [a, b], [1, 2], 7, 1, out=(a.shape, a.dtype, 1)))(a, b))


def test_one_window_is_the_rule_on_the_whole_arrays_even_without_a_row_axis():
    """A BatchNorm over (batch, features) has no row axis (``row_axis`` None) and runs in one window: the rule
    on the arrays as they are (the regression: cutting them along axis None raised a TypeError)."""
    x = jnp.arange(6.0).reshape(2, 3)
    sums, rows = row_windows.over_rows(lambda a: ((jnp.sum(a),), a * 2), [x], [1], 1, 1, None)
    assert float(sums[0]) == 15.0 and np.array_equal(np.asarray(rows), np.asarray(x) * 2)


def test_window_count_and_bounds():
    assert row_windows.window_count(1000, 10, 0) == 1 and row_windows.window_count(1000, 10, 1000) == 1
    assert row_windows.window_count(1001, 10, 1000) == 2 and row_windows.window_count(10 ** 9, 10, 1) == 10
    assert row_windows.bounds(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert row_windows.row_axis(5, [-1]) == 1 and row_windows.row_axis(5, [1]) == 2
    assert row_windows.row_axis(2, [1]) is None


def _spec(dtype, windows, first=False):
    return ((0, 1, 2), 1e-3, 0, 1, 2, [jnp.dtype(dtype)] * 2, first, windows)


def _batch_norm_vjp(x, scale, cotangent):
    def formula(x, scale, offset):
        mean, variance = x.mean((0, 1, 2)), x.var((0, 1, 2))
        return (x - mean) * jax.lax.rsqrt(variance + 1e-3) * scale + offset
    _, pullback = jax.vjp(formula, x, scale, jnp.zeros_like(scale))
    d_x, d_scale, d_offset = pullback(cotangent)
    return [d_scale, d_offset, d_x]


def _lean(x, scale, cotangent, windows, first=False):
    """The rule's gradients; ``first``: ``x`` stored channels-first, as float32 5-D inputs are."""
    stored = jnp.moveaxis(x, -1, 1) if first else x
    grads, (d_x,) = jax.jit(lambda x, s, c: lean_norm._grads(_spec(x.dtype, windows, first), x, s, c))(
        stored, scale, cotangent)
    return [*grads, d_x]


def _data(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 10, 12, 6)) * 3 + 1, dtype)
    return x, jnp.asarray(rng.normal(size=6), dtype), jnp.asarray(rng.normal(size=x.shape), dtype)


def _relative(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def test_windowed_batch_norm_backward_is_the_formulas_derivative_in_float64(x64, monkeypatch):
    """Keras computes batch norm in float32, and so does the rule: here its float32 is made float64, so that what
    is left is the formula (the control: with float32 kept, the same comparison is off by ~1e-7)."""
    x, scale, cotangent = _data("float64")
    reference = _batch_norm_vjp(x, scale, cotangent)
    kept = [_relative(g, r) for g, r in zip(_lean(x, scale, cotangent, 10), reference)]
    assert max(kept) > 1e-9, kept
    namespace = {name: getattr(jnp, name) for name in dir(jnp) if not name.startswith("__")}
    monkeypatch.setattr(lean_norm, "jnp", types.SimpleNamespace(**{**namespace, "float32": jnp.float64}))
    for windows in (1, 10):
        for first in (False, True):
            errors = [_relative(g, r) for g, r in zip(_lean(x, scale, cotangent, windows, first), reference)]
            assert max(errors) < 1e-13, (windows, first, errors)


def test_windowed_batch_norm_backward_in_float32_is_as_close_to_keras_as_the_whole():
    x, scale, cotangent = _data("float32")
    layer = keras.layers.BatchNormalization(epsilon=1e-3)
    layer.build(x.shape)
    _, pullback = jax.vjp(lambda t, a: layer.stateless_call(t, [v.value for v in layer.non_trainable_variables], a,
                                                            training=True)[0], [scale, jnp.zeros(6)], x)
    (d_scale, d_offset), d_x = pullback(cotangent)
    reference = [d_scale, d_offset, d_x]
    whole = max(_relative(g, r) for g, r in zip(_lean(x, scale, cotangent, 1), reference))
    windowed = max(_relative(g, r) for g, r in zip(_lean(x, scale, cotangent, 10), reference))
    assert whole < 2e-6 and windowed < 2e-6, (whole, windowed)


def test_a_result_written_in_place_of_an_operand_reads_its_overwritten_halo_rows_from_a_copy(x64):
    """``overwrite``: a halo'd row-local map (``y[i] = x[i-1] + 2 x[i] + x[i+1]``, zero beyond the edges) written
    into its operand's buffer gives what it gives into a new buffer: each window's rows below its start, already
    overwritten, come from the copy taken before (the control: without the copy they would be results)."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 23, 5, 3)), jnp.float64)

    def rule(rows):
        middle = rows[:, 1:-1]
        return (), rows[:, :-2] + 2 * middle + rows[:, 2:]

    def run(overwrite):
        return jax.jit(lambda x: row_windows.over_rows(rule, [x], [1], 23, 5, halos=[1],
                                                       out=(x.shape, x.dtype, 1), overwrite=overwrite)[1])(x)

    fresh, written = run(None), run([0])
    padded = np.pad(np.asarray(x), [(0, 0), (1, 1), (0, 0), (0, 0)])
    expected = padded[:, :-2] + 2 * padded[:, 1:-1] + padded[:, 2:]
    np.testing.assert_allclose(fresh, expected, rtol=1e-15)
    np.testing.assert_array_equal(written, fresh)
