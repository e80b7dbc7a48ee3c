import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# TensorFlow's default CPU allocator keeps statistics only on NUMA machines; the BFC one always does, and the
# callback and memory tests read them (keras_lms.memory warns and logs NaN without them).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import pytest

# The TensorFlow-backend suite (and the Horovod tests) are not collected in the torch run of `make test`;
# tests/torch/ holds the torch-backend suite and is ignored unless KERAS_BACKEND=torch (its own conftest).
if os.environ.get("KERAS_BACKEND") == "torch":
    collect_ignore_glob = ["test_*.py", "horovod/*"]


@pytest.fixture
def mixed_precision():
    import keras

    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


@pytest.fixture
def dtype_policy(request):
    """Float type and dtype policy for one test (indirect parametrisation), restored to float32 afterwards."""
    import keras

    dtype = request.param
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        yield dtype
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")
