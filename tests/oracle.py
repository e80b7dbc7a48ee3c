"""The independent oracle: the unwrapped model on the same weights and seeds.

``compare_step`` runs one training step (forward, loss incl. model.losses, gradients) on the plain model,
restores every variable (weights, BatchNorm moving statistics, Dropout seed states), runs the same step on
the wrapped model, and returns both results for comparison.
"""

import numpy as np
import tensorflow as tf


def snapshot(model):
    return [v.numpy().copy() for v in model.variables]


def restore(model, values):
    for v, value in zip(model.variables, values):
        v.assign(value)


def _loss(outputs, targets):
    flat_o, flat_t = tf.nest.flatten(outputs), tf.nest.flatten(targets)
    return tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, t.dtype) - t)) for o, t in zip(flat_o, flat_t)])


def train_step(model, x, y, graph=True):
    def step():
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = _loss(out, y)
            if model.losses:
                loss = loss + tf.add_n([tf.cast(extra, loss.dtype) for extra in model.losses])
        grads = tape.gradient(loss, model.trainable_variables)
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
        return loss, grads, tf.nest.flatten(out)

    return tf.function(step)() if graph else step()


def targets_for(model, x):
    out = model(x, training=False)
    rng = np.random.default_rng(1)
    dtype = lambda o: "float64" if o.dtype == tf.float64 else "float32"  # noqa: E731
    return tf.nest.map_structure(lambda o: tf.constant(rng.random(o.shape).astype(dtype(o))), out)


def relative_error(a, b, zero_below=0.0):
    a = np.asarray(a, dtype="float64")
    b = np.asarray(b, dtype="float64")
    if np.linalg.norm(a) < zero_below and np.linalg.norm(b) < zero_below:
        return 0.0
    scale = max(np.linalg.norm(a), 1e-12)
    return float(np.linalg.norm(a - b) / scale)


def compare_step(plain, wrapped, x, y=None, graph=True):
    """Return a dict of relative errors (loss, outputs, per-gradient max, state max) wrapped vs plain."""
    y = targets_for(plain, x) if y is None else y
    start = snapshot(plain)
    loss_p, grads_p, out_p = train_step(plain, x, y, graph)
    state_p = snapshot(plain)
    restore(plain, start)
    loss_w, grads_w, out_w = train_step(wrapped, x, y, graph)
    state_w = snapshot(plain)
    restore(plain, start)
    assert len(grads_p) == len(grads_w)
    missing = [v.path for v, gp, gw in zip(plain.trainable_variables, grads_p, grads_w) if (gp is None) != (gw is None)]
    assert not missing, f"gradient connectivity differs for {missing}"
    # A gradient that is mathematically zero (a conv bias followed by BatchNorm) is pure rounding noise, so
    # relative error is meaningless for it: a gradient below 1e-5 x the global gradient norm in *both* models
    # counts as zero in both (a match); otherwise the relative error against the plain gradient is used.
    total = float(np.sqrt(sum(np.sum(np.square(np.asarray(g, "float64"))) for g in grads_p if g is not None)))
    floor = 1e-5 * total
    grad_errors = {v.path: relative_error(gp, gw, floor) for v, gp, gw in zip(plain.trainable_variables, grads_p,
                                                                               grads_w) if gp is not None}
    state_errors = {v.path: relative_error(a, b) for v, a, b in zip(plain.variables, state_p, state_w)}
    changed = [v.path for v, a, b in zip(plain.variables, start, state_p) if not np.array_equal(a, b)]
    return {
        "loss": relative_error(loss_p, loss_w),
        "outputs": max(relative_error(a, b) for a, b in zip(out_p, out_w)),
        "grads": grad_errors,
        "state": state_errors,
        "state_changed": changed,
        "n_grads": sum(g is not None for g in grads_p),
    }


def assert_matches(plain, wrapped, x, y=None, graph=True, tol=1e-5):
    r = compare_step(plain, wrapped, x, y, graph)
    assert r["n_grads"] > 0
    assert r["loss"] <= tol, r["loss"]
    assert r["outputs"] <= tol, r["outputs"]
    bad = {k: e for k, e in r["grads"].items() if not e <= tol}
    assert not bad, f"gradients differ: {bad}"
    bad = {k: e for k, e in r["state"].items() if not e <= tol}
    assert not bad, f"state after the step differs (BatchNorm stats / seed states): {bad}"
    return r
