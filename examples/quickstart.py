"""keras-lms on one page: build a model, wrap it, train it, then see what was offloaded and what that saves.

    python examples/quickstart.py                 # ~10 s on a CPU; KERAS_BACKEND=torch works too
    python examples/quickstart.py --epochs 5 --min-bytes 0

The Horovod version of the same script is examples/quickstart_horovod.py.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # TensorFlow on CPU: allocator peaks for peak_device_mib

import keras
import numpy as np

import keras_lms


def build_model(size: int = 64) -> keras.Model:
    """A small CNN: two conv blocks, then a classifier. Any built keras.Model can be wrapped."""
    inputs = keras.Input((size, size, 3))
    x = inputs
    for filters in (16, 32):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(x), name="quickstart_cnn")


def make_data(n: int = 64, size: int = 64, seed: int = 0):
    """Random images; the label says whether the red channel is brighter than the blue one."""
    rng = np.random.default_rng(seed)
    x = rng.random((n, size, size, 3), dtype=np.float32)
    y = (x[..., 0].mean(axis=(1, 2)) > x[..., 2].mean(axis=(1, 2))).astype("float32")[:, None]
    return x, y


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--min-bytes", default="256KiB", help="smaller layer inputs stay on the device")
    args = parser.parse_args(argv)

    wrapped = keras_lms.wrap(build_model(), min_bytes=args.min_bytes)
    wrapped.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    x, y = make_data()
    wrapped.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=2,
                callbacks=[keras_lms.MemoryHighWaterMark()])

    print("\nOffload plan (one entry per layer call of the training step):")
    for entry in wrapped.lms_plan:
        print("  ", entry)
    print(keras_lms.report(wrapped, batch_size=args.batch_size).to_text())
    return wrapped


if __name__ == "__main__":
    main()
