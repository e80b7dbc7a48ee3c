"""The independent oracle on the torch back end: the unwrapped model on the same weights and seeds.

``compare_step`` runs one training step (forward, loss incl. ``model.losses``, ``loss.backward()``) on the plain
model, restores every variable (weights, BatchNorm moving statistics, Dropout seed states), runs the same step
on the wrapped model and compares loss, outputs, every gradient and the state after the step — the torch twin
of ``tests/oracle.py`` (which imports TensorFlow).
"""

import keras
import numpy as np
import torch


def snapshot(model):
    return [np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in model.variables]


def restore(model, values):
    for v, value in zip(model.variables, values):
        v.assign(value)


def rng_state():
    """torch's global RNG states: Keras' torch Dropout without a seed draws its mask from them."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def to_tensor(x):
    return keras.tree.map_structure(lambda a: keras.ops.convert_to_tensor(a) if isinstance(a, np.ndarray) else a, x)


def _loss(outputs, targets):
    flat_o, flat_t = keras.tree.flatten(outputs), keras.tree.flatten(targets)
    return sum(torch.mean(torch.square(o.to(t.dtype) - t)) for o, t in zip(flat_o, flat_t))


def train_step(model, x, y):
    """One step with torch autograd, as Keras' torch trainer does it: loss.backward(), then read ``.grad``."""
    for v in model.trainable_variables:
        v.value.grad = None
    out = model(to_tensor(x), training=True)
    loss = _loss(out, y)
    if model.losses:
        loss = loss + sum(extra.to(loss.dtype) for extra in model.losses)
    loss.backward()
    grads = [None if v.value.grad is None else v.value.grad.detach().clone() for v in model.trainable_variables]
    for v in model.trainable_variables:
        v.value.grad = None
    return (loss.detach(), [None if g is None else g.cpu().numpy() for g in grads],
            [o.detach().cpu().numpy() for o in keras.tree.flatten(out)])


def targets_for(model, x):
    with torch.no_grad():
        out = model(to_tensor(x), training=False)
    rng = np.random.default_rng(1)
    dtype = lambda o: torch.float64 if o.dtype == torch.float64 else torch.float32  # noqa: E731
    return keras.tree.map_structure(
        lambda o: torch.tensor(rng.random(tuple(o.shape)), dtype=dtype(o), device=o.device), out)


def relative_error(a, b, zero_below=0.0):
    a = np.asarray(a, dtype="float64")
    b = np.asarray(b, dtype="float64")
    if np.linalg.norm(a) < zero_below and np.linalg.norm(b) < zero_below:
        return 0.0
    scale = max(np.linalg.norm(a), 1e-12)
    return float(np.linalg.norm(a - b) / scale)


def compare_step(plain, wrapped, x, y=None):
    """Relative errors (loss, outputs, per gradient, per state variable) of the wrapped vs the plain step."""
    y = targets_for(plain, x) if y is None else y
    start, rng = snapshot(plain), rng_state()
    loss_p, grads_p, out_p = train_step(plain, x, y)
    state_p, rng_p = snapshot(plain), rng_state()
    restore(plain, start)
    set_rng_state(rng)
    loss_w, grads_w, out_w = train_step(wrapped, x, y)
    state_w, rng_w = snapshot(plain), rng_state()
    restore(plain, start)
    # The wrapped step draws exactly the random numbers the plain one draws (the recompute re-uses them).
    assert torch.equal(rng_p[0], rng_w[0]), "the wrapped step advanced torch's CPU RNG differently"
    assert len(grads_p) == len(grads_w)
    missing = [v.path for v, gp, gw in zip(plain.trainable_variables, grads_p, grads_w) if (gp is None) != (gw is None)]
    assert not missing, f"gradient connectivity differs for {missing}"
    # As in tests/oracle.py: a gradient below 1e-5 x the global gradient norm in *both* models is rounding noise
    # around a mathematical zero (a conv bias before BatchNorm) and counts as a match.
    total = float(np.sqrt(sum(np.sum(np.square(np.asarray(g, "float64"))) for g in grads_p if g is not None)))
    floor = 1e-5 * total
    grad_errors = {v.path: relative_error(gp, gw, floor) for v, gp, gw in zip(plain.trainable_variables, grads_p,
                                                                               grads_w) if gp is not None}
    state_errors = {v.path: relative_error(a, b) for v, a, b in zip(plain.variables, state_p, state_w)}
    changed = [v.path for v, a, b in zip(plain.variables, start, state_p) if not np.array_equal(a, b)]
    return {
        "loss": relative_error(loss_p.cpu().numpy(), loss_w.cpu().numpy()),
        "outputs": max(relative_error(a, b) for a, b in zip(out_p, out_w)),
        "grads": grad_errors,
        "state": state_errors,
        "state_changed": changed,
        "n_grads": sum(g is not None for g in grads_p),
    }


def assert_matches(plain, wrapped, x, y=None, tol=1e-5):
    r = compare_step(plain, wrapped, x, y)
    assert r["n_grads"] > 0
    assert r["loss"] <= tol, r["loss"]
    assert r["outputs"] <= tol, r["outputs"]
    bad = {k: e for k, e in r["grads"].items() if not e <= tol}
    assert not bad, f"gradients differ: {bad}"
    bad = {k: e for k, e in r["state"].items() if not e <= tol}
    assert not bad, f"state after the step differs (BatchNorm stats / seed states): {bad}"
    return r
