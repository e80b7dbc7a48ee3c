"""The numerics oracle on real architectures on the torch back end (keras.applications, weights=None)."""

import time

import keras
import numpy as np
import pytest

import keras_lms
from tests.torch.torch_oracle import assert_matches

APPS = {
    "MobileNetV2": lambda: keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=5),
    "ResNet50": lambda: keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=5),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(APPS))
def test_application_matches_plain(name):
    keras.utils.set_random_seed(0)
    model = APPS[name]()
    x = np.random.default_rng(0).random((2, 32, 32, 3)).astype("float32")
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=1)
    start = time.perf_counter()
    result = assert_matches(model, wrapped, x, tol=1e-5)
    offloaded = sum(e.offloaded for e in wrapped.lms_plan)
    assert offloaded >= len(wrapped.lms_plan) // 2
    print(f"{name}: {len(wrapped.lms_plan)} calls, {offloaded} offloaded, max grad rel err "
          f"{max(result['grads'].values()):.2e}, {time.perf_counter() - start:.1f}s")
