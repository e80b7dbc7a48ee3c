"""Settings (keras_lms/config.py): layer selections that cannot work are refused with the fix, and integer-like
values (NumPy integers) are accepted and stored as plain Python values (either backend)."""

import numpy as np
import pytest

import keras_lms
from tests import models


def test_include_and_integer_like_settings():
    model = models.conv_chain()
    with pytest.raises(ValueError, match=r"include=\[\] selects no layer.*include=None"):
        keras_lms.wrap(model, include=[])
    with pytest.raises(TypeError, match="layer object 'c1'.*include=\\['c1'\\]"):
        keras_lms.wrap(model, include=[model.get_layer("c1")])
    with pytest.raises(TypeError, match="Layer indices are not accepted"):
        keras_lms.wrap(model, include=[2])
    wrapped = keras_lms.wrap(model, min_bytes=np.int64(5), keep_last=np.int32(0), prefetch=np.int64(2), exclude=[])
    assert wrapped.lms_config.min_bytes == 5 and type(wrapped.lms_config.min_bytes) is int
    assert wrapped.lms_config.keep_last == 0 and wrapped.lms_config.prefetch == 2
    assert wrapped.lms_config.exclude is None
