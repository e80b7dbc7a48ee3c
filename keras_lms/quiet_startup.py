"""Quiet TensorFlow's C++ start-up lines in the `keras-lms` command (not in a user's program).

TensorFlow 2.21 writes them (absl's "before absl::InitializeLog", oneDNN, cpu_feature_guard) while it is
imported, before its logging reads `TF_CPP_MIN_LOG_LEVEL`: on a fresh install they appear whatever the level, so
the command's answer would follow eight lines of noise. The command holds file descriptor 2 on /dev/null while
TensorFlow is imported: in `keras_lms/__init__.py` (the `import keras` of the TensorFlow back end) and where the
command imports TensorFlow itself (`keras-lms info` under another Keras back end). `keras-lms --verbose` keeps
them. Standard library only: `keras_lms/__init__.py` imports it before anything else.
"""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def quiet_tensorflow_startup(enabled: bool = True):
    """Hold fd 2 on /dev/null for the block; an exception raised in it propagates after fd 2 is restored."""
    saved = None
    if enabled:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        except OSError:  # no descriptor 2 (an embedded interpreter): nothing to quiet
            saved = None
    try:
        yield
    finally:
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)
