"""keras-lms: Large Model Support for Keras 3.

``keras_lms.wrap(model)`` returns a model whose large layer inputs live in host memory between their
forward and backward use. See README.md and docs/ for usage.
"""

from keras_lms._keras_adapter import check_keras_version as _check_keras_version

_check_keras_version()

from keras_lms import callbacks  # noqa: E402
from keras_lms.callbacks import MemoryHighWaterMark  # noqa: E402
from keras_lms.config import LMSConfig  # noqa: E402
from keras_lms.model import LMSModel, unwrap, wrap  # noqa: E402
from keras_lms import planner  # noqa: E402
from keras_lms.policy import PlanEntry  # noqa: E402
from keras_lms.report import ActivationReport, report  # noqa: E402

__version__ = "0.1.0"
__all__ = ["wrap", "unwrap", "LMSModel", "LMSConfig", "PlanEntry", "MemoryHighWaterMark", "callbacks", "report",
           "ActivationReport", "planner", "__version__"]
