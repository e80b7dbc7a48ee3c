"""Test models: small, but each exercises one structure the wrapper must handle."""

import keras
import numpy as np
from keras import layers


def cnn_bn_dropout(size=16):
    inp = keras.Input((size, size, 3))
    x = layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    x = layers.BatchNormalization()(x)
    x = layers.Dropout(0.3)(x)
    x = layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D()(x)
    x = layers.SpatialDropout2D(0.2)(x)
    x = layers.Conv2D(8, 3, padding="same", activation="sigmoid")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(16, activation="tanh")(x)
    return keras.Model(inp, layers.Dense(3)(x), name="cnn_bn_dropout")


def unet2d(size=32, filters=4, depth=2, channels=1, classes=1):
    """A small 2D U-Net with Concatenate skips, BatchNorm and Dropout."""
    inp = keras.Input((size, size, channels))
    x, skips = inp, []
    for d in range(depth):
        x = layers.Conv2D(filters * 2**d, 3, padding="same", activation="relu")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Conv2D(filters * 2**d, 3, padding="same", activation="relu")(x)
        skips.append(x)
        x = layers.MaxPooling2D()(x)
    x = layers.Conv2D(filters * 2**depth, 3, padding="same", activation="relu")(x)
    x = layers.Dropout(0.2)(x)
    for d in reversed(range(depth)):
        x = layers.Conv2DTranspose(filters * 2**d, 2, strides=2, padding="same")(x)
        x = layers.Concatenate()([x, skips[d]])
        x = layers.Conv2D(filters * 2**d, 3, padding="same", activation="relu")(x)
    return keras.Model(inp, layers.Conv2D(classes, 1, activation="sigmoid")(x), name="unet2d")


def resnet_blocks(size=16, filters=8, blocks=2):
    inp = keras.Input((size, size, 3))
    x = layers.Conv2D(filters, 3, padding="same")(inp)
    for _ in range(blocks):
        shortcut = x
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        y = layers.BatchNormalization()(y)
        y = layers.ReLU()(y)
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization()(y)
        x = layers.Activation("relu")(layers.Add()([shortcut, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, layers.Dense(4)(x), name="resnet_blocks")


def nested(size=16):
    """A Functional model and a Sequential block used as layers inside another model."""
    block_in = keras.Input((size, size, 8))
    b = layers.Conv2D(8, 3, padding="same", activation="relu")(block_in)
    b = layers.BatchNormalization()(b)
    block = keras.Model(block_in, layers.Add()([block_in, b]), name="inner_block")
    head = keras.Sequential([keras.Input((8,)), layers.Dense(8, activation="relu"), layers.Dropout(0.2),
                             layers.Dense(2)], name="head")
    inp = keras.Input((size, size, 3))
    x = layers.Conv2D(8, 3, padding="same")(inp)
    x = block(x)
    x = block(x)  # the same nested model called twice
    x = layers.GlobalMaxPooling2D()(x)
    return keras.Model(inp, head(x), name="nested")


def multi_io(size=16):
    image = keras.Input((size, size, 3), name="image")
    meta = keras.Input((5,), name="meta")
    x = layers.Conv2D(8, 3, padding="same", activation="relu")(image)
    x = layers.GlobalAveragePooling2D()(x)
    m = layers.Dense(8, activation="relu")(meta)
    shared = layers.Dense(8, activation="relu", name="shared_dense")
    a, b = shared(x), shared(m)  # one layer, two call sites
    joined = layers.Concatenate()([a, b])
    gated = keras.ops.multiply(joined, keras.ops.sigmoid(joined))  # keras.ops nodes in the graph
    seg = layers.Conv2D(1, 1, activation="sigmoid", name="seg")(x[:, None, None, :] * keras.ops.ones((1, 2, 2, 1)))
    cls = layers.Dense(3, name="cls")(gated)
    return keras.Model({"image": image, "meta": meta}, {"cls": cls, "seg": seg}, name="multi_io")


@keras.saving.register_keras_serializable(package="keras_lms_tests")
class LossLayer(layers.Layer):
    """Adds a loss from inside call (must be counted once, with gradients)."""

    def call(self, x):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.square(x)))
        return x


def losses_and_frozen(size=16):
    inp = keras.Input((size, size, 3))
    frozen = layers.Conv2D(8, 3, padding="same", activation="relu", name="frozen_conv")
    frozen.trainable = False
    x = frozen(inp)
    bn = layers.BatchNormalization(name="frozen_bn")
    bn.trainable = False
    x = bn(x)
    x = layers.Conv2D(8, 3, padding="same", activity_regularizer=keras.regularizers.L2(1e-3),
                      kernel_regularizer=keras.regularizers.L2(1e-3))(x)
    x = LossLayer()(x)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, layers.Dense(2)(x), name="losses_and_frozen")


def masked_sequence(length=12, vocab=20):
    inp = keras.Input((length,), dtype="int32")
    x = layers.Embedding(vocab, 8, mask_zero=True)(inp)
    x = layers.Dense(8, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    x = layers.GlobalAveragePooling1D()(x)  # uses the mask
    return keras.Model(inp, layers.Dense(2)(x), name="masked_sequence")


class Subclassed(keras.Model):
    """Arbitrary Python in call: a loop over a list of blocks and a data-independent branch."""

    def __init__(self, filters=8, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Conv2D(filters, 3, padding="same", activation="relu")
        self.blocks = [[layers.Conv2D(filters, 3, padding="same"), layers.BatchNormalization()] for _ in range(2)]
        self.drop = layers.Dropout(0.25)
        self.pool = layers.GlobalAveragePooling2D()
        self.out = layers.Dense(3)

    def call(self, x, training=False):
        x = self.stem(x)
        for conv, bn in self.blocks:
            x = x + keras.ops.relu(bn(conv(x), training=training))
        if training:
            x = self.drop(x, training=training)
        return self.out(self.pool(x))


def subclassed(size=16):
    model = Subclassed(name="subclassed")
    model.build((None, size, size, 3))
    return model


@keras.saving.register_keras_serializable(package="keras_lms_tests")
class TiedProjection(layers.Layer):
    """Projects with the transposed kernel of another layer (tied weights: a variable the layer does not own)."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        object.__setattr__(self, "_source", source)  # not tracked: the kernel is not this layer's variable

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self._source.kernel))


def tied_weights():
    inp = keras.Input((6,))
    encode = layers.Dense(4, use_bias=False, name="encode")
    hidden = layers.Dense(4, activation="tanh")(encode(inp))
    return keras.Model(inp, TiedProjection(encode)(hidden), name="tied_weights")


_RNG = np.random.default_rng(0)


def images(batch=4, size=16, channels=3):
    return _RNG.random((batch, size, size, channels)).astype("float32")


# The structures both back ends' numerics suites compare wrapped vs plain on: name -> (build, make inputs).
ORACLE_CASES = {
    "cnn_bn_dropout": (cnn_bn_dropout, lambda: images()),
    "unet2d": (unet2d, lambda: images(size=32, channels=1)),
    "resnet_blocks": (resnet_blocks, lambda: images()),
    "nested": (nested, lambda: images()),
    "multi_io": (multi_io, lambda: {"image": images(), "meta": _RNG.random((4, 5)).astype("float32")}),
    "losses_and_frozen": (losses_and_frozen, lambda: images()),
    "masked_sequence": (masked_sequence,
                        lambda: np.concatenate([_RNG.integers(1, 20, (4, 8)), np.zeros((4, 4), int)], 1).astype("int32")),
    "subclassed": (subclassed, lambda: images()),
}
