"""Horovod's `horovodrun` for the tests, without the build check it makes before every launch.

Why: before it starts a worker, `horovodrun --gloo` asks whether Horovod was built with Gloo by importing
`horovod.tensorflow` (so TensorFlow) in a child process: about 7 s of every launch on 2 cores. The tests ask once
per session (`horovod_build()` in test_horovod_multirank.py, which skips the Gloo tests where it was not built);
this is otherwise Horovod's own launcher (`horovod.runner.launch.run_commandline`, what `horovodrun` runs).

Usage: python tests/horovod/_horovodrun.py HOROVODRUN_ARGUMENTS...
"""

import sys

from horovod.runner import launch

launch.gloo_built = lambda verbose=False: True  # asked once per test session instead

if __name__ == "__main__":
    sys.exit(launch.run_commandline())
