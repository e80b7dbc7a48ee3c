"""keras-lms: Large Model Support for Keras 3.

`keras_lms.wrap(model)` returns a model whose large layer inputs live in host memory between their forward and
backward use; `keras_lms.report(model, batch_size)` predicts what that saves before anything runs, and
`keras_lms.horovod` trains data-parallel on many ranks. See README.md and docs/ for usage.

The public names are those in `__all__`: the entry points (`wrap`, `unwrap`, `report`, `largest_input`), the
settings (`LMSConfig`, `DeviceProfile`), what they return (`LMSModel`, `PlanEntry`, `ActivationReport`,
`LargestInput`), the callbacks (`MemoryHighWaterMark`, `BackupAndRestore`) and the errors a user may catch
(`BudgetError`, `HostMemoryError`, `BackupError`).
"""

import os as _os
import sys as _sys


def _is_the_cli() -> bool:
    """True in the `keras-lms` command (or `python -m keras_lms.cli`), where this package is imported first."""
    argv = list(getattr(_sys, "orig_argv", _sys.argv))
    command = _os.path.basename(_sys.argv[0]) == "keras-lms" if _sys.argv else False
    module = any(a == "-m" and b == "keras_lms.cli" for a, b in zip(argv, argv[1:]))
    return (command or module) and "--verbose" not in argv


if _is_the_cli():
    # The command's answer would follow about eight lines of TensorFlow start-up logs (absl, oneDNN,
    # cpu_feature_guard), printed while the `import keras` below imports TensorFlow, before keras_lms.cli.main
    # runs; `keras-lms --verbose ...` keeps them. A level the user set is left alone.
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from keras_lms.quiet_startup import quiet_tensorflow_startup as _quiet_tensorflow_startup

    with _quiet_tensorflow_startup():
        from keras_lms._keras_adapter import check_keras_version as _check_keras_version
else:
    from keras_lms._keras_adapter import check_keras_version as _check_keras_version

_check_keras_version()

from keras_lms.callbacks import BackupAndRestore, BackupError, MemoryHighWaterMark  # noqa: E402
from keras_lms.config import LMSConfig  # noqa: E402
from keras_lms.largest_input import LargestInput, largest_input  # noqa: E402
from keras_lms.memory import HostMemoryError  # noqa: E402
from keras_lms.model import LMSModel  # noqa: E402
from keras_lms.planning import BudgetError, PlanEntry  # noqa: E402
from keras_lms.planning.device_profile import DeviceProfile  # noqa: E402
from keras_lms.report import ActivationReport, report  # noqa: E402
from keras_lms.wrapping import unwrap, wrap  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    # entry points
    "wrap",
    "unwrap",
    "report",
    "largest_input",
    # settings and results
    "LMSConfig",
    "LMSModel",
    "PlanEntry",
    "ActivationReport",
    "LargestInput",
    "DeviceProfile",
    "MemoryHighWaterMark",
    "BackupAndRestore",
    # errors
    "BudgetError",
    "HostMemoryError",
    "BackupError",
    "__version__",
]
