"""The models that benchmarks and tests measure, defined here so that a change to an example cannot move a number.

`build_unet` is the architecture of `examples/unet.py` (tests/test_examples.py checks that both build identical
layer configurations, so the numbers in docs/benchmarks.md apply to the example's model); the example keeps its
own copy so that a reader follows it without leaving examples/. `resnetish` is the residual CNN of
`benchmarks.cpu_overhead` and `benchmarks.report_accuracy`.
"""

from __future__ import annotations

import keras
from keras import layers


def build_unet(input_shape, classes: int = 1, depth: int = 3, base_filters: int = 16, batch_norm: bool = True,
               dropout: float = 0.1, name: str | None = None, bn_momentum: float = 0.99) -> keras.Model:
    """A U-Net with ``depth`` down/up levels for 2D (H, W, C) or 3D (D, H, W, C) inputs.

    Each level: two 3x3(x3) convolutions with ReLU (BatchNorm after the first when ``batch_norm``); the
    bottleneck has Dropout; the decoder uses transposed convolutions and Concatenate skips. The output is a
    sigmoid (``classes == 1``) or softmax map with the input's spatial size, which must be divisible by
    ``2**depth``. ``bn_momentum`` is the BatchNormalization momentum of the moving statistics (Keras' default
    0.99; lower values make validation follow the weights faster in short runs).
    """
    ndim = len(input_shape) - 1
    if ndim not in (2, 3):
        raise ValueError(f"input_shape must be (H, W, C) or (D, H, W, C); got {input_shape}.")
    if any(s is not None and s % 2**depth for s in input_shape[:-1]):
        raise ValueError(f"Spatial size {input_shape[:-1]} must be divisible by 2**depth = {2**depth}.")
    conv = layers.Conv2D if ndim == 2 else layers.Conv3D
    up = layers.Conv2DTranspose if ndim == 2 else layers.Conv3DTranspose
    pool = layers.MaxPooling2D if ndim == 2 else layers.MaxPooling3D

    def block(x, filters, prefix):
        x = conv(filters, 3, padding="same", activation=None if batch_norm else "relu", name=f"{prefix}_conv1")(x)
        if batch_norm:
            x = layers.BatchNormalization(momentum=bn_momentum, name=f"{prefix}_bn")(x)
            x = layers.ReLU(name=f"{prefix}_relu")(x)
        return conv(filters, 3, padding="same", activation="relu", name=f"{prefix}_conv2")(x)

    inputs = keras.Input(input_shape, name="image")
    x, skips = inputs, []
    for level in range(depth):
        x = block(x, base_filters * 2**level, f"down{level}")
        skips.append(x)
        x = pool(name=f"down{level}_pool")(x)
    x = block(x, base_filters * 2**depth, "bottleneck")
    if dropout:
        x = layers.Dropout(dropout, name="bottleneck_dropout")(x)
    for level in reversed(range(depth)):
        x = up(base_filters * 2**level, 2, strides=2, padding="same", name=f"up{level}_upconv")(x)
        x = layers.Concatenate(name=f"up{level}_concat")([x, skips[level]])
        x = block(x, base_filters * 2**level, f"up{level}")
    activation = "sigmoid" if classes == 1 else "softmax"
    outputs = conv(classes, 1, activation=activation, dtype="float32", name="mask")(x)
    return keras.Model(inputs, outputs, name=name or f"unet{ndim}d")


def resnetish(size=128, filters=32, blocks=4):
    """A ResNet-style classifier on (size, size, 3): a stem convolution, ``blocks`` residual blocks at one
    resolution (Conv-BN-ReLU, Conv-BN, Add, ReLU), global pooling and Dense(10)."""
    inp = keras.Input((size, size, 3))
    x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(inp)
    for _ in range(blocks):
        y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        y = keras.layers.BatchNormalization()(y)
        y = keras.layers.ReLU()(y)
        y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = keras.layers.BatchNormalization()(y)
        x = keras.layers.ReLU()(keras.layers.Add()([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, keras.layers.Dense(10)(x), name="resnetish")


def unet(input_shape, base_filters: int = 32, levels: int = 4) -> keras.Model:
    """U-Net (2D or 3D by ``input_shape``): ``levels`` down-sampling levels and a bottleneck, two
    Conv-BN-ReLU per level, filters doubling per level, transposed-convolution up-sampling, concatenated
    skips, a sigmoid 1x1 head."""
    ndim = len(input_shape) - 1
    conv = {2: keras.layers.Conv2D, 3: keras.layers.Conv3D}[ndim]
    up = {2: keras.layers.Conv2DTranspose, 3: keras.layers.Conv3DTranspose}[ndim]
    pool = {2: keras.layers.MaxPooling2D, 3: keras.layers.MaxPooling3D}[ndim]

    def block(x, filters, prefix):
        for j in (1, 2):
            x = conv(filters, 3, padding="same", use_bias=False, name=f"{prefix}_conv{j}")(x)
            x = keras.layers.BatchNormalization(name=f"{prefix}_bn{j}")(x)
            x = keras.layers.ReLU(name=f"{prefix}_relu{j}")(x)
        return x

    inputs = keras.Input(input_shape)
    x, skips = inputs, []
    for level in range(levels):
        x = block(x, base_filters * 2**level, f"down{level}")
        skips.append(x)
        x = pool(name=f"down{level}_pool")(x)
    x = block(x, base_filters * 2**levels, "bottleneck")
    for level in reversed(range(levels)):
        x = up(base_filters * 2**level, 2, strides=2, padding="same", name=f"up{level}_upconv")(x)
        x = keras.layers.Concatenate(name=f"up{level}_concat")([x, skips[level]])
        x = block(x, base_filters * 2**level, f"up{level}")
    outputs = conv(1, 1, activation="sigmoid", name="head")(x)
    return keras.Model(inputs, outputs, name=f"unet{ndim}d")
