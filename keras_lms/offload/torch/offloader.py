"""One wrapped model's offloader state on torch: its host buffer pool, its transfer counters and its settings.

Every training step of a wrapped model (``StepContext``) runs with the ``Offloader`` of that model, so two wrapped
models in one process (a GAN's generator and discriminator, models trained alternately) neither evict each other's
pooled host buffers nor count each other's bytes, and settings given to one do not change the other (as
torchtune's ``OffloadActivations`` keeps its state on the instance). Only the copy streams are shared, one per
device (``transfer``): they hold no per-model state.

The offloader belongs to the model's ``lms_structure``, which ``LMSModel`` makes for itself when it is created, and
lives as long as it does; ``offloader_of(wrapped)`` returns it.
"""

from __future__ import annotations

import sys
import threading

from torch.utils.weak import WeakIdKeyDictionary

from keras_lms.offload.torch.pool import HostBufferPool
from keras_lms.offload.torch.stats import _TOTAL, TransferCounter
from keras_lms.planning import ModelStructure


def package_default(name: str):
    """The package's setting ``keras_lms.offload.torch.<name>`` (``CPU_HOST_COPIES``, ``MAX_INFLIGHT_BYTES``),
    read now: the default of every model that was not given its own (tests and benchmarks set them there)."""
    return getattr(sys.modules[__package__], name)


class Offloader:
    """The offloader state of one wrapped model (torch).

    Args:
        cpu_host_copies: on a machine without CUDA, copy offloaded tensors into pool buffers (True) or keep the
            tensor itself (False); None follows the package default ``CPU_HOST_COPIES``, read at each step.
        max_inflight_bytes: device bytes that unfinished device-to-host copies may hold before the host waits
            (see ``Transfer``); None follows the package default ``MAX_INFLIGHT_BYTES``, read at each step.
        pool: the host buffer pool; None makes one for this model.

    Attributes:
        pool: the model's ``HostBufferPool`` (``new_step`` once per training forward pass of this model).
        stats: the model's ``TransferCounter`` (which also adds to the process-wide ``transfer_stats()``).
    """

    def __init__(self, cpu_host_copies: bool | None = None, max_inflight_bytes: int | None = None,
                 pool: HostBufferPool | None = None):
        self.cpu_host_copies = cpu_host_copies
        self.max_inflight_bytes = max_inflight_bytes
        self.pool = pool if pool is not None else HostBufferPool()
        self.stats = TransferCounter(parent=_TOTAL)

    def settings(self) -> dict:
        """The settings in effect now: this model's own, else the package defaults."""
        copies = self.cpu_host_copies
        inflight = self.max_inflight_bytes
        return {
            "cpu_host_copies": bool(package_default("CPU_HOST_COPIES") if copies is None else copies),
            "max_inflight_bytes": int(package_default("MAX_INFLIGHT_BYTES") if inflight is None else inflight),
        }

    def transfer_stats(self) -> dict:
        """What this model moved since its last :meth:`reset_transfer_stats` (same keys as ``transfer_stats()``)."""
        return self.stats.as_dict()

    def reset_transfer_stats(self) -> None:
        self.stats.reset()


_OFFLOADERS = WeakIdKeyDictionary()  # a model's lms_structure (weakly) -> its Offloader
_LOCK = threading.Lock()


def offloader_for(structure) -> Offloader:
    """The ``Offloader`` of the wrapped model whose ``lms_structure`` is ``structure`` (made on first use)."""
    with _LOCK:
        offloader = _OFFLOADERS.get(structure)
        if offloader is None:
            offloader = _OFFLOADERS[structure] = Offloader()
        return offloader


def offloader_of(model) -> Offloader:
    """The ``Offloader`` of a wrapped model (a ``keras_lms.LMSModel``, or its ``lms_structure``).

    Example (torch)::

        wrapped = keras_lms.wrap(model)
        offloader_of(wrapped).max_inflight_bytes = 64 << 20  # this model only
        wrapped.fit(x, y)
        print(offloader_of(wrapped).transfer_stats()["d2h_bytes"])  # what this model offloaded
    """
    structure = getattr(model, "lms_structure", model)
    if not isinstance(structure, ModelStructure):
        raise TypeError(f"offloader_of takes a wrapped model (keras_lms.LMSModel), not {type(model).__name__}")
    return offloader_for(structure)
