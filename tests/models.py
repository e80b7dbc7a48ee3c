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


# --- Composite layers whose ``call`` takes no ``training`` argument (common in keras_hub): their inner Dropout and
# BatchNormalization learn the training flag only from Keras' call context, which the recompute must re-enter.
class NormDropBlock(layers.Layer):
    """Dense -> BatchNormalization -> Dropout(0.5), ``call`` without ``training``."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(units)
        self.bn = layers.BatchNormalization()
        self.drop = layers.Dropout(0.5)

    def call(self, x):
        return self.drop(self.bn(self.dense(x)))


class Nest(layers.Layer):
    """Dense -> Dropout -> ``child``: one more level of composite layers, ``call`` without ``training``."""

    def __init__(self, child, units=8, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(units, activation="relu")
        self.drop = layers.Dropout(0.3)
        self.child = child

    def call(self, x):
        return self.child(self.drop(self.dense(x)))


class ModelHolder(layers.Layer):
    """A keras.Model used as a layer inside a composite layer, called without ``training``."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.body = keras.Sequential([layers.Dense(units), layers.BatchNormalization(), layers.Dropout(0.5),
                                      layers.Dense(units, activation="relu")])

    def call(self, x):
        return self.body(x)


def composite_block(features=6):
    """Dense -> NormDropBlock -> Dense: a composite layer one level deep (the minimal case of issue 10)."""
    inp = keras.Input((features,))
    x = NormDropBlock(8)(layers.Dense(8)(inp))
    return keras.Model(inp, layers.Dense(3)(x), name="composite_block")


def composite_nested(features=6):
    """A layer in a layer in a layer: Nest(Nest(NormDropBlock)), Dropout at every level."""
    inp = keras.Input((features,))
    x = Nest(Nest(NormDropBlock(8)))(layers.Dense(8)(inp))
    return keras.Model(inp, layers.Dense(3)(x), name="composite_nested")


def composite_model(features=6):
    """A Sequential model with BatchNorm and Dropout used as a layer inside a composite layer."""
    inp = keras.Input((features,))
    x = ModelHolder(8)(layers.Dense(8)(inp))
    return keras.Model(inp, layers.Dense(3)(x), name="composite_model")


class ConvBlock(layers.Layer):
    """Conv2D -> BatchNormalization -> ReLU -> SpatialDropout2D, ``call`` without ``training``."""

    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.conv = layers.Conv2D(filters, 3, padding="same", use_bias=False)
        self.bn = layers.BatchNormalization()
        self.act = layers.ReLU()
        self.drop = layers.SpatialDropout2D(0.25)

    def call(self, x):
        return self.drop(self.act(self.bn(self.conv(x))))


def deep_supervision(size=16, filters=4):
    """A small U-Net of ConvBlocks with a sigmoid side output (each with its own loss) at every decoder level."""
    inp = keras.Input((size, size, 1))
    skip = ConvBlock(filters)(inp)
    x = ConvBlock(filters * 2)(layers.MaxPooling2D()(skip))
    side_low = layers.Conv2D(1, 1, activation="sigmoid", name="side_low")(x)
    x = layers.Concatenate()([layers.UpSampling2D()(x), skip])
    x = ConvBlock(filters)(x)
    side_mid = layers.Conv2D(1, 1, activation="sigmoid", name="side_mid")(x)
    out = layers.Conv2D(1, 1, activation="sigmoid", name="final")(ConvBlock(filters)(x))
    return keras.Model(inp, [out, side_mid, side_low], name="deep_supervision")


class AttentionBlock(layers.Layer):
    """Pre-norm transformer block: MultiHeadAttention(dropout=0.1) and a Dropout FFN, ``call`` without ``training``."""

    def __init__(self, dim=8, heads=2, **kwargs):
        super().__init__(**kwargs)
        self.norm1 = layers.LayerNormalization()
        self.attention = layers.MultiHeadAttention(heads, dim // heads, dropout=0.1)
        self.norm2 = layers.LayerNormalization()
        self.ffn = layers.Dense(2 * dim, activation="gelu")
        self.proj = layers.Dense(dim)
        self.drop = layers.Dropout(0.1)

    def call(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h)
        return x + self.drop(self.proj(self.ffn(self.norm2(x))))


def attention_dropout(length=6, dim=8):
    inp = keras.Input((length, dim))
    x = AttentionBlock(dim)(layers.Dense(dim)(inp))
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inp, layers.Dense(2)(x), name="attention_dropout")


def cnn3d_maxpool(size=8, filters=4):
    """A 3D CNN with MaxPooling3D after ReLU convolutions. The pointwise stem keeps the near-ties of the input
    (see `near_ties`) inside the first pooling windows; relu zeros tie exactly."""
    inp = keras.Input((size, size, size, 1))
    x = layers.Conv3D(filters, 1, activation="relu")(inp)
    x = layers.MaxPooling3D(2)(x)
    x = layers.Conv3D(filters, 3, padding="same", activation="relu")(x)
    x = layers.MaxPooling3D(2)(x)
    x = layers.Flatten()(x)
    return keras.Model(inp, layers.Dense(2)(x), name="cnn3d_maxpool")


def conv_chain():
    """Three same-padding 3x3 convolutions (`c1`..`c3`) and a 1x1 `head` on 32x32 one-channel images.

    `c2`, `c3` and `head` read 32 KiB per sample (32x32x8 float32), so a `min_bytes` between one sample and a
    batch of 8 (256 KiB) makes the batch size decide what is offloaded; the names let tests select layers.
    """
    inp = keras.Input((32, 32, 1))
    h = layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(inp)
    h = layers.Conv2D(8, 3, padding="same", activation="relu", name="c2")(h)
    h = layers.Conv2D(8, 3, padding="same", activation="relu", name="c3")(h)
    out = layers.Conv2D(1, 1, name="head")(h)
    return keras.Model(inp, out)


_RNG = np.random.default_rng(0)


def bn_relu_unet3d(size=16):
    """A small 3D U-Net with Conv -> BatchNorm -> ReLU twice per level, every layer in the global dtype policy
    (benchmarks.models' U-Net has a float32 head): the lean normalisation's and the recompute's model (torch)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((size, size, size, 1))

    def block(x, filters):
        for _ in range(2):
            x = layers.ReLU()(layers.BatchNormalization()(layers.Conv3D(filters, 3, padding="same")(x)))
        return x

    skip = block(inp, 4)
    x = block(layers.MaxPooling3D()(skip), 8)
    x = layers.Conv3DTranspose(4, 2, strides=2, padding="same")(x)
    x = block(layers.Concatenate()([x, skip]), 4)
    return keras.Model(inp, layers.Conv3D(1, 1)(x))


def images(batch=4, size=16, channels=3, rng=None):
    """Uniform images; ``rng`` makes them independent of which tests ran before (the module's generator is shared)."""
    return (rng or _RNG).random((batch, size, size, channels)).astype("float32")


def conv_chain_data(n=20, rng=None):
    """`n` samples `(x, y)` for `conv_chain`, the target being the input (an autoencoder's task)."""
    x = images(n, size=32, channels=1, rng=rng)
    return x, x


def near_ties(shape, step=0.25, jitter=1e-6, rng=None):
    """Values on a coarse grid plus multiples of ``jitter``: pooling windows hold exact and near ties."""
    rng = rng or _RNG
    coarse = np.round(rng.random(shape) / step) * step
    return (coarse + rng.integers(0, 3, shape) * jitter).astype("float32")


# The structures tests/test_numerics.py compares wrapped vs plain on (either backend): name -> (build, inputs).
ORACLE_CASES = {
    "cnn_bn_dropout": (cnn_bn_dropout, lambda: images()),
    "unet2d": (unet2d, lambda: images(size=32, channels=1)),
    "resnet_blocks": (resnet_blocks, lambda: images()),
    "nested": (nested, lambda: images()),
    "multi_io": (multi_io, lambda: {"image": images(), "meta": _RNG.random((4, 5)).astype("float32")}),
    "losses_and_frozen": (losses_and_frozen, lambda: images()),
    "masked_sequence": (masked_sequence,
                        lambda: np.concatenate([_RNG.integers(1, 20, (4, 8)), np.zeros((4, 4), int)],
                                               1).astype("int32")),
    "subclassed": (subclassed, lambda: images()),
    # Issue 10: composite layers without `training`, deep supervision, attention dropout, 3D max pooling.
    "composite_block": (composite_block, lambda: _RNG.random((4, 6)).astype("float32")),
    "composite_nested": (composite_nested, lambda: _RNG.random((4, 6)).astype("float32")),
    "composite_model": (composite_model, lambda: _RNG.random((4, 6)).astype("float32")),
    "deep_supervision": (deep_supervision, lambda: images(size=16, channels=1)),
    "attention_dropout": (attention_dropout, lambda: _RNG.random((4, 6, 8)).astype("float32")),
    "cnn3d_maxpool": (cnn3d_maxpool, lambda: near_ties((2, 8, 8, 8, 1))),
}


# --- keras.applications (weights=None): the model zoo tests/test_applications.py compares wrapped vs plain on,
# under either backend: name -> (build, input edge, dtype, tolerance).
# DenseNet121 at 32x32 with batch 2 has BatchNorm over 1x1 maps, so its float32 gradients are dominated by
# cancellation; it runs in float64, where the comparison is exact to ~1e-10 (tests/test_applications.py).
# EfficientNetB0 runs at 64x64 (issue 13's reproduction: stochastic depth is Dropout(noise_shape=(None, 1, 1, 1))).
APPLICATIONS = {
    "MobileNetV2": (lambda: keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None,
                                                           classes=5), 32, "float32", 1e-5),
    "ResNet50": (lambda: keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=5), 32,
                 "float32", 1e-5),
    "EfficientNetB0": (lambda: keras.applications.EfficientNetB0(input_shape=(64, 64, 3), weights=None, classes=5),
                       64, "float32", 1e-5),
    "VGG16": (lambda: keras.applications.VGG16(input_shape=(32, 32, 3), weights=None, classes=5), 32, "float32", 1e-5),
    "ConvNeXtTiny": (lambda: keras.applications.ConvNeXtTiny(input_shape=(32, 32, 3), weights=None, classes=5), 32,
                     "float32", 1e-5),
    "DenseNet121": (lambda: keras.applications.DenseNet121(input_shape=(32, 32, 3), weights=None, classes=5), 32,
                    "float64", 1e-8),
    "Xception": (lambda: keras.applications.Xception(input_shape=(71, 71, 3), weights=None, classes=5), 71,
                 "float32", 1e-5),
    "MobileNetV3Small": (lambda: keras.applications.MobileNetV3Small(input_shape=(32, 32, 3), weights=None,
                                                                     classes=5), 32, "float32", 1e-5),
}


class RandomBlock(layers.Layer):
    """Every random layer Keras has, in one composite layer without ``training``: Dropout with and without
    ``noise_shape``, SpatialDropout2D, GaussianNoise, GaussianDropout, AlphaDropout, random augmentation."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.randoms = [layers.Dropout(0.3), layers.Dropout(0.3, noise_shape=(None, 1, 1, 1)),
                        layers.SpatialDropout2D(0.3), layers.GaussianNoise(0.2), layers.GaussianDropout(0.3),
                        layers.AlphaDropout(0.3), layers.RandomFlip(), layers.RandomTranslation(0.2, 0.2)]
        self.convs = [layers.Conv2D(4, 3, padding="same", activation="relu") for _ in self.randoms]

    def call(self, x):
        for random, conv in zip(self.randoms, self.convs):
            x = x + conv(random(x))
        return x


def random_layers(size=16):
    """Random layers as model layers and inside a composite layer: each draws once per step, the recompute
    must replay the forward's draws (issue 13)."""
    inp = keras.Input((size, size, 4))
    x = layers.Conv2D(4, 3, padding="same")(inp)
    x = layers.Dropout(0.5, noise_shape=(None, 1, 1, 4))(x)  # stochastic depth / EfficientNet style
    x = layers.GaussianNoise(0.1)(layers.GaussianDropout(0.2)(x))
    x = RandomBlock()(x)
    x = layers.AlphaDropout(0.2)(layers.SpatialDropout2D(0.2)(x))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, layers.Dense(3)(x), name="random_layers")


ORACLE_CASES["random_layers"] = (random_layers, lambda: images(channels=4))
