"""Scopes the TensorFlow step context runs a layer's forward and recompute under: BatchNormalization's batch
statistics recorded in the forward and handed back in the recompute (exact gradient), given statistics for a
slab's pass, and a fused activation switched off while the pre-activation is recomputed."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from keras_lms import _keras_adapter as adapter
from keras_lms.offload.common import given_moments

__all__ = ["TotalMoments", "capture_moments", "given_moments", "reuse_moments", "without_activation"]


@contextlib.contextmanager
def capture_moments(unit, record):
    """Record the batch statistics a BatchNormalization computes in the forward pass (per-channel, tiny)."""
    hook = adapter.batchnorm_moments_hook(unit)
    if hook is None:
        yield
        return
    original = getattr(unit, hook)

    def recording_moments(inputs, mask):
        mean, variance = original(inputs, mask)
        record.moments.append(None if mask is not None
                              else (mean, variance, adapter.batchnorm_reduction_axes(unit, inputs)))
        return mean, variance

    with adapter.patched_attribute(unit, hook, recording_moments):
        yield


@contextlib.contextmanager
def reuse_moments(unit, record):
    """In the recompute, hand BatchNormalization its forward statistics instead of recomputing them.

    The gradient stays exact: ``tf.nn.moments`` computes the variance against ``stop_gradient(mean)``, so
    its gradient needs only the input and the mean's *value*, which the saved mean is. The reductions
    themselves are not recomputed (their outputs are not needed and TensorFlow prunes them).
    """
    hook = adapter.batchnorm_moments_hook(unit)
    if hook is None or not record.moments or any(m is None for m in record.moments):
        yield
        return
    original = getattr(unit, hook)
    saved = iter(record.moments)

    def saved_moments(inputs, mask):
        entry = next(saved, None)
        if entry is None or mask is not None:
            return original(inputs, mask)
        return _moments_with_exact_gradient(inputs, *entry)

    with adapter.patched_attribute(unit, hook, saved_moments):
        yield


def _moments_with_exact_gradient(x, mean, variance, axes):
    axes = list(axes)

    @tf.custom_gradient
    def moments(x):
        def grad(d_mean, d_variance):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(x)
                # The ops of tf.nn.moments(x, axes), with the saved mean behind its stop_gradient.
                kept_mean = tf.reduce_mean(x, axes, keepdims=True, name="mean")
                saved_mean = tf.reshape(mean, kept_mean.shape)
                kept_var = tf.reduce_mean(tf.math.squared_difference(x, tf.stop_gradient(saved_mean)), axes,
                                          keepdims=True, name="variance")
                outs = [tf.squeeze(kept_mean, axes), tf.squeeze(kept_var, axes)]
            pairs = [(o, g) for o, g in zip(outs, (d_mean, d_variance)) if g is not None]
            if not pairs:
                return tf.zeros_like(x)
            return tape.gradient([o for o, _ in pairs], x, output_gradients=[g for _, g in pairs])

        return [tf.identity(mean), tf.identity(variance)], grad

    mean_out, variance_out = moments(x)
    return mean_out, variance_out


class without_activation:
    """Temporarily replace a layer's activation by ``linear`` while its pre-activation is recomputed."""

    def __init__(self, unit, enabled: bool):
        self.unit, self.enabled, self.saved = unit, enabled, None

    def __enter__(self):
        if self.enabled:
            self.saved = adapter.fused_activation(self.unit)
            object.__setattr__(self.unit, "activation", keras.activations.linear)

    def __exit__(self, *exc):
        if self.enabled:
            object.__setattr__(self.unit, "activation", self.saved)


class TotalMoments:
    """BatchNormalization's batch statistics for the second pass of a slab backward: their values are the
    forward's, and the gradient they send to a slab's input is the one the *total* gradient of the mean and
    variance (summed over slabs in the first pass) sends there, computed as TensorFlow's gradients of
    ``reduce_mean`` (d_mean / n, broadcast) and ``squared_difference`` (2 * d_variance / n * (x - mean)) do."""

    def __init__(self, mean, variance, d_mean, d_variance, count):
        self.mean, self.variance, self.count = mean, variance, count
        self.d_mean, self.d_variance = d_mean, d_variance
        self.gate = [d_mean, d_variance]  # the second pass starts once the first has finished (d_mean alone
        # reads only the upstream gradient and is ready long before d_variance)

    def __call__(self, x):
        mean, variance, d_mean, d_variance, count = self.mean, self.variance, self.d_mean, self.d_variance, self.count

        @tf.custom_gradient
        def statistics(x):
            def grad(unused_d_mean, unused_d_variance):
                factor = tf.cast(count, x.dtype)  # the forward's count, in the forward's compute dtype
                from_mean = d_mean / factor
                from_variance = tf.math.scalar_mul(2.0, d_variance / factor) * (x - mean)
                return from_mean + from_variance

            return [tf.identity(mean), tf.identity(variance)], grad

        return statistics(x)
