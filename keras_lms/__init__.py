"""keras-lms: Large Model Support for Keras 3.

`keras_lms.wrap(model)` returns a model whose large layer inputs live in host memory between their forward and
backward use; `keras_lms.report(model, batch_size)` predicts what that saves before anything runs, and
`keras_lms.horovod` trains data-parallel on many ranks. See README.md and docs/ for usage.

The public names are those in `__all__`: the entry points (`wrap`, `unwrap`, `report`), the settings
(`LMSConfig`), what they return (`LMSModel`, `PlanEntry`, `ActivationReport`), the callback
(`MemoryHighWaterMark`) and the errors a user may catch (`BudgetError`, `HostMemoryError`).
"""

from keras_lms._keras_adapter import check_keras_version as _check_keras_version

_check_keras_version()

from keras_lms import callbacks, planner  # noqa: E402 - after the Keras version check
from keras_lms.callbacks import MemoryHighWaterMark  # noqa: E402
from keras_lms.config import LMSConfig  # noqa: E402
from keras_lms.memory import HostMemoryError  # noqa: E402
from keras_lms.model import LMSModel  # noqa: E402
from keras_lms.planner import BudgetError  # noqa: E402
from keras_lms.policy import PlanEntry  # noqa: E402
from keras_lms.report import ActivationReport, report  # noqa: E402
from keras_lms.wrapping import unwrap, wrap  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    # entry points
    "wrap",
    "unwrap",
    "report",
    # settings and results
    "LMSConfig",
    "LMSModel",
    "PlanEntry",
    "ActivationReport",
    "MemoryHighWaterMark",
    # errors
    "BudgetError",
    "HostMemoryError",
    # modules
    "callbacks",
    "planner",
    "__version__",
]
