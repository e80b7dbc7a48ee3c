"""Loss and metrics of the segmentation examples: Dice + binary cross-entropy loss, epoch-wide Dice and IoU.

All three are registered Keras serializables (package ``keras_lms_examples``), so a saved checkpoint loads back
wherever this module has been imported.
"""

from __future__ import annotations

import keras
from keras import ops

PACKAGE = "keras_lms_examples"


def _spatial_axes(x) -> list[int]:
    return list(range(1, len(x.shape)))


@keras.saving.register_keras_serializable(package=PACKAGE)
class DiceBCELoss(keras.losses.Loss):
    """Binary cross-entropy plus soft Dice loss (``1 - soft Dice`` per sample), the usual pair for small lesions.

    Cross-entropy gives well-behaved gradients from the first step; the Dice term counters the foreground /
    background imbalance (lesions are 1-10 % of the voxels).
    """

    def __init__(self, smooth: float = 1.0, bce_weight: float = 1.0, dice_weight: float = 1.0, name="dice_bce",
                 reduction="sum_over_batch_size", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.smooth, self.bce_weight, self.dice_weight = float(smooth), float(bce_weight), float(dice_weight)

    def call(self, y_true, y_pred):
        y_true = ops.cast(y_true, "float32")
        y_pred = ops.cast(y_pred, "float32")
        axes = _spatial_axes(y_pred)
        bce = ops.mean(keras.losses.binary_crossentropy(y_true, y_pred), axis=axes[:-1])
        intersection = ops.sum(y_true * y_pred, axis=axes)
        total = ops.sum(y_true, axis=axes) + ops.sum(y_pred, axis=axes)
        soft_dice = (2.0 * intersection + self.smooth) / (total + self.smooth)
        return self.bce_weight * bce + self.dice_weight * (1.0 - soft_dice)

    def get_config(self):
        return {**super().get_config(), "smooth": self.smooth, "bce_weight": self.bce_weight,
                "dice_weight": self.dice_weight}


class _OverlapMetric(keras.metrics.Metric):
    """Accumulates |P & T|, |P| and |T| of thresholded masks over all batches since the last reset (the epoch).

    The counts are kept in float64 so that an epoch of large volumes (> 2**24 voxels) still counts exactly.
    """

    def __init__(self, threshold: float = 0.5, name=None, dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.threshold = float(threshold)
        self.intersection = self.add_variable(shape=(), initializer="zeros", dtype="float64", name="intersection")
        self.predicted = self.add_variable(shape=(), initializer="zeros", dtype="float64", name="predicted")
        self.actual = self.add_variable(shape=(), initializer="zeros", dtype="float64", name="actual")

    def update_state(self, y_true, y_pred, sample_weight=None):
        if sample_weight is not None:
            raise ValueError(f"{type(self).__name__} does not support sample_weight.")
        t = ops.cast(ops.cast(y_true, "float32") > self.threshold, "float32")
        p = ops.cast(ops.cast(y_pred, "float32") > self.threshold, "float32")
        self.intersection.assign_add(ops.cast(ops.sum(t * p), "float64"))
        self.predicted.assign_add(ops.cast(ops.sum(p), "float64"))
        self.actual.assign_add(ops.cast(ops.sum(t), "float64"))

    def reset_state(self):
        for v in (self.intersection, self.predicted, self.actual):
            v.assign(ops.zeros((), "float64"))

    def _ratio(self, numerator, denominator):
        # Both masks empty: perfect agreement (1.0), not 0/0.
        value = ops.where(denominator > 0, numerator / ops.maximum(denominator, 1.0), ops.ones((), "float64"))
        return ops.cast(value, "float32")

    def get_config(self):
        return {**super().get_config(), "threshold": self.threshold}


@keras.saving.register_keras_serializable(package=PACKAGE)
class Dice(_OverlapMetric):
    """Dice coefficient 2|P & T| / (|P| + |T|) of masks thresholded at ``threshold``, over the whole epoch."""

    def __init__(self, threshold: float = 0.5, name="dice", dtype=None):
        super().__init__(threshold, name=name, dtype=dtype)

    def result(self):
        return self._ratio(2.0 * self.intersection, self.predicted + self.actual)


@keras.saving.register_keras_serializable(package=PACKAGE)
class IoU(_OverlapMetric):
    """Intersection over union |P & T| / |P | T| of masks thresholded at ``threshold``, over the whole epoch."""

    def __init__(self, threshold: float = 0.5, name="iou", dtype=None):
        super().__init__(threshold, name=name, dtype=dtype)

    def result(self):
        return self._ratio(self.intersection, self.predicted + self.actual - self.intersection)
