"""Device and host memory readings, and the host-memory guard.

Device: read by the active back end's offload module (`keras_lms.offload.active_backend()`): TensorFlow's
allocator statistics (`tf.config.experimental.get_memory_info`; on a CPU-only machine the CPU allocator, shared
by all logical CPU devices) or `torch.cuda.max_memory_allocated`.
Host: the process's resident set size (psutil) and its high-water mark (Linux `VmHWM`, which
`/proc/self/clear_refs` resets, so peaks can be taken per epoch or per batch).
"""

from __future__ import annotations

import logging
import os
import pathlib

import psutil

from keras_lms import offload
from keras_lms.offload import DeviceStatsUnavailable

log = logging.getLogger(__name__)  # "keras_lms.memory": propagates to the "keras_lms" logger
MIB = float(1 << 20)
_warned_no_stats = set()
_STATUS = pathlib.Path("/proc/self/status")
_CLEAR_REFS = pathlib.Path("/proc/self/clear_refs")


def _offload_backend():
    """The active back end's offload module (which reads its device's allocator), or None on another back end."""
    try:
        return offload.active_backend()
    except NotImplementedError:
        return None


def default_device() -> str:
    """The device whose memory matters: the first GPU when there is one, else the CPU allocator."""
    backend = _offload_backend()
    return "cpu" if backend is None else backend.default_device()


def reset_device_peak(device: str) -> None:
    backend = _offload_backend()
    if backend is None:
        return
    try:
        backend.reset_device_peak(device)
    except DeviceStatsUnavailable as err:
        _warn_no_stats(device, err)


def _warn_no_stats(device: str, err: DeviceStatsUnavailable) -> None:
    """Say once per device why the device peak reads NaN, and how to get it (the back end's hint)."""
    if device in _warned_no_stats:
        return
    _warned_no_stats.add(device)
    log.warning("keras-lms: %s, so peak_device_mib is NaN.%s", err, err.hint)


def device_peak_bytes(device: str) -> int | None:
    """Peak bytes allocated on `device` since the last reset, or None when the back end cannot tell."""
    backend = _offload_backend()
    if backend is None:
        return None
    try:
        return backend.device_peak_bytes(device)
    except DeviceStatsUnavailable as err:
        _warn_no_stats(device, err)
        return None


def host_rss_bytes() -> int:
    return int(psutil.Process(os.getpid()).memory_info().rss)


def host_peak_rss_bytes() -> int:
    """Peak RSS since the last `reset_host_peak` (Linux VmHWM); the current RSS elsewhere."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return host_rss_bytes()


def reset_host_peak() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux); False where that is not possible."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def host_available_bytes() -> int:
    return int(psutil.virtual_memory().available)


def initialized_horovod():
    """`horovod.tensorflow` when the program imported and initialised it, else None (never imports it)."""
    import sys

    hvd = sys.modules.get("horovod.tensorflow")
    try:
        return hvd if hvd is not None and hvd.is_initialized() else None
    except (AttributeError, ValueError):
        return None


def ranks_on_this_node() -> int:
    """Processes on this machine that offload into its RAM: Horovod's local size, else 1."""
    hvd = initialized_horovod()
    return int(hvd.local_size()) if hvd is not None else 1


class HostMemoryError(MemoryError):
    """The offload plan needs more host RAM than the machine has available."""

    # Raised while a step is traced: AutoGraph would re-wrap it as a StagingError; let it through unchanged.
    ag_pass_through = True


def check_host_memory(host_bytes_per_step: int, headroom: float = 0.9) -> None:
    """Refuse a plan whose host bytes (times the ranks on this node) exceed `headroom` of available RAM.

    Better one clear message before the first step than the kernel's OOM killer in the middle of an epoch.
    """
    from keras_lms.config import format_bytes

    ranks = ranks_on_this_node()
    needed = host_bytes_per_step * ranks
    available = host_available_bytes()
    if needed > headroom * available:
        raise HostMemoryError(
            f"keras-lms would hold {format_bytes(needed)} of activations in host memory per step "
            f"({format_bytes(host_bytes_per_step)} x {ranks} rank(s) on this node), but only "
            f"{format_bytes(available)} of RAM is available ({headroom:.0%} usable). Reduce the batch size or input "
            "size, offload less (raise min_bytes, set device_budget), run fewer ranks per node, or add RAM."
        )
