import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import pytest  # noqa: E402


@pytest.fixture
def mixed_precision():
    import keras

    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
