"""`keras_lms.report`'s arguments are checked up front, and each error names the argument (either backend)."""

import numpy as np
import pytest

import keras_lms
from tests import models


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(link_gbps=0), ValueError, "link_gbps must be a positive number"),
    (dict(link_gbps=-3.0), ValueError, "link_gbps must be a positive number"),
    (dict(input_shape="abc"), ValueError, "input_shape must be one sample's shape"),
    (dict(input_shape=(32, 0, 1)), ValueError, "input_shape must be one sample's shape"),
    (dict(config={"min_bytes": 0}), TypeError, "config must be a keras_lms.LMSConfig"),
])
def test_report_arguments(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        keras_lms.report(models.conv_chain(), batch_size=2, **kwargs)


def test_report_accepts_numpy_input_shape():
    rep = keras_lms.report(models.conv_chain(), batch_size=2,
                           input_shape=(np.int64(32), np.int64(32), np.int64(1)))
    assert rep.rows and rep.batch_size == 2
