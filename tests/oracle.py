"""The independent oracle: the unwrapped model on the same weights and seeds, on the active Keras backend.

``compare_step`` runs one training step (forward, loss incl. ``model.losses``, gradients) on the plain model,
restores every variable (weights, BatchNorm moving statistics, Dropout seed states) and torch's global RNG,
runs the same step on the wrapped model, and returns relative errors of loss, outputs, every gradient and the
state after the step.

Only how a step takes gradients is backend-specific (``_STEPS``, chosen by ``keras.backend.backend()``):
``tf.GradientTape``, in a ``tf.function`` unless ``graph=False``, on TensorFlow; ``loss.backward()`` and
``.grad``, as Keras' torch trainer does it, on torch (always eager: ``graph`` is ignored); ``jax.value_and_grad``
of the model's ``stateless_call``, as Keras' JAX trainer does it, in a ``jax.jit`` unless ``graph=False``, on
JAX. Everything else is ``keras.ops`` and NumPy, so every backend compares by the same arithmetic.
"""

import keras
import numpy as np

BACKEND = keras.backend.backend()


def _numpy(t):
    if t is None:
        return None
    return t.detach().cpu().numpy() if BACKEND == "torch" else keras.ops.convert_to_numpy(t)


def snapshot(model):
    return [np.array(_numpy(v.value), copy=True) for v in model.variables]


def restore(model, values):
    for v, value in zip(model.variables, values):
        v.assign(value)


def rng_state():
    """torch's global RNG states (Keras' torch Dropout without a seed draws its mask from them); None on
    TensorFlow, where every random layer draws from its SeedGenerator variable (restored with ``restore``)."""
    if BACKEND != "torch":
        return None
    import torch

    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(state):
    if state is None:
        return
    import torch

    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _same_rng(a, b):
    """Whether two ``rng_state()`` results hold the same CPU generator state (always, on TensorFlow)."""
    if a is None or b is None:
        return a is b
    import torch

    return torch.equal(a[0], b[0])


def _loss(model, outputs, targets, losses=None):
    ops = keras.ops
    flat_o, flat_t = keras.tree.flatten(outputs), keras.tree.flatten(targets)
    loss = sum(ops.mean(ops.square(ops.cast(o, t.dtype) - t)) for o, t in zip(flat_o, flat_t))
    losses = model.losses if losses is None else losses
    if losses:
        loss = loss + sum(ops.cast(extra, loss.dtype) for extra in losses)
    return loss


# ------------------------------------------------------------------------ the backend-specific part
def _tensorflow_step(model, x, y, graph):
    import tensorflow as tf

    def step():
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = _loss(model, out, y)
        grads = tape.gradient(loss, model.trainable_variables)
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
        return loss, grads, tf.nest.flatten(out)

    return tf.function(step)() if graph else step()


def _to_tensors(x):
    return keras.tree.map_structure(lambda a: keras.ops.convert_to_tensor(a) if isinstance(a, np.ndarray) else a, x)


def _torch_step(model, x, y, graph):
    for v in model.trainable_variables:
        v.value.grad = None
    out = model(_to_tensors(x), training=True)
    loss = _loss(model, out, y)
    loss.backward()
    grads = [None if v.value.grad is None else v.value.grad.detach().clone() for v in model.trainable_variables]
    for v in model.trainable_variables:
        v.value.grad = None
    return loss.detach(), grads, [o.detach() for o in keras.tree.flatten(out)]


def _jax_step(model, x, y, graph):
    import jax

    x = _to_tensors(x)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_fn(trainable, non_trainable):
        out, new_non_trainable, losses = model.stateless_call(trainable, non_trainable, x, training=True,
                                                              return_losses=True)
        return _loss(model, out, y, losses), (out, new_non_trainable)

    step = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (out, new_non_trainable)), grads = (jax.jit(step) if graph else step)(trainable, non_trainable)
    for variable, value in zip(model.non_trainable_variables, new_non_trainable):
        variable.assign(value)
    return loss, grads, keras.tree.flatten(out)


_STEPS = {"tensorflow": _tensorflow_step, "torch": _torch_step, "jax": _jax_step}


def train_step(model, x, y, graph=True):
    """One training step: (loss, [gradient or None per trainable variable], [flat outputs]) as NumPy."""
    loss, grads, out = _STEPS[BACKEND](model, x, y, graph)
    return _numpy(loss), [_numpy(g) for g in grads], [_numpy(o) for o in out]


def input_gradient(model, x, graph=True):
    """The training-mode output for NumPy input ``x`` and the gradient of its sum with respect to ``x``."""
    if BACKEND == "torch":
        x = keras.ops.convert_to_tensor(x).requires_grad_(True)
        out = model(x, training=True)
        out.sum().backward()
        return _numpy(out.detach()), _numpy(x.grad)
    if BACKEND == "jax":
        import jax

        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def total(inputs):
            out, _ = model.stateless_call(trainable, non_trainable, inputs, training=True)
            return keras.ops.sum(out), out

        fn = jax.value_and_grad(total, has_aux=True)
        (_, out), g = (jax.jit(fn) if graph else fn)(keras.ops.convert_to_tensor(x))
        return _numpy(out), _numpy(g)
    import tensorflow as tf

    x = tf.constant(x)

    def grad():
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = model(x, training=True)
        return out, tape.gradient(out, x)

    out, g = tf.function(grad)() if graph else grad()
    return _numpy(out), _numpy(g)


# ------------------------------------------------------------------------------------- comparison
def targets_for(model, x):
    """Random targets shaped like the model's outputs for ``x``. The shapes come from a symbolic call
    (``compute_output_spec``: no kernels run), not an eager one: on JAX an eager forward compiles one XLA
    program per op (DenseNet121: 30 s of its 150 s test)."""
    specs = keras.tree.map_structure(lambda a: keras.KerasTensor(tuple(a.shape), dtype=str(a.dtype)), x)
    out = model.compute_output_spec(specs, training=False)
    rng = np.random.default_rng(1)
    dtype = lambda o: "float64" if keras.backend.standardize_dtype(o.dtype) == "float64" else "float32"  # noqa: E731
    return keras.tree.map_structure(
        lambda o: keras.ops.convert_to_tensor(rng.random(tuple(o.shape)).astype(dtype(o))), out)


def relative_error(a, b, zero_below=0.0):
    a = np.asarray(a, dtype="float64")
    b = np.asarray(b, dtype="float64")
    if np.linalg.norm(a) < zero_below and np.linalg.norm(b) < zero_below:
        return 0.0
    scale = max(np.linalg.norm(a), 1e-12)
    return float(np.linalg.norm(a - b) / scale)


def compare_step(plain, wrapped, x, y=None, graph=True):
    """Return a dict of relative errors (loss, outputs, per-gradient max, state max) wrapped vs plain, and both
    steps' gradients (``gradients``)."""
    y = targets_for(plain, x) if y is None else y
    start, rng = snapshot(plain), rng_state()
    loss_p, grads_p, out_p = train_step(plain, x, y, graph)
    state_p, rng_p = snapshot(plain), rng_state()
    restore(plain, start)
    set_rng_state(rng)
    loss_w, grads_w, out_w = train_step(wrapped, x, y, graph)
    state_w, rng_w = snapshot(plain), rng_state()
    restore(plain, start)
    # The wrapped step draws exactly the random numbers the plain one draws (the recompute re-uses them).
    assert _same_rng(rng_p, rng_w), "the wrapped step advanced torch's CPU RNG differently"
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
    # Likewise a state vector whose norm is below 1e-6 in both (the moving mean of a BatchNorm over 1x1 maps whose
    # batch mean is mathematically zero: ~1e-10 of float32 noise) counts as zero in both.
    state_errors = {v.path: relative_error(a, b, 1e-6) for v, a, b in zip(plain.variables, state_p, state_w)}
    changed = [v.path for v, a, b in zip(plain.variables, start, state_p) if not np.array_equal(a, b)]
    return {
        "loss": relative_error(loss_p, loss_w),
        "outputs": max(relative_error(a, b) for a, b in zip(out_p, out_w)),
        "grads": grad_errors,
        "state": state_errors,
        "state_changed": changed,
        "n_grads": sum(g is not None for g in grads_p),
        "gradients": {"plain": grads_p, "wrapped": grads_w},  # the raw gradients, for oracles of their own
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
