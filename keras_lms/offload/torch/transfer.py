"""Moving tensors between a compute device and host memory: copy streams, host copies, swap-ins, back-pressure.

A wrapped model's step makes its ``Transfer`` objects with that model's pool, counters and settings (its
``Offloader``). A ``Transfer`` made without them (tests) uses ``host_pool()``, counts into the process-wide total
only, and reads the package defaults ``CPU_HOST_COPIES`` and ``MAX_INFLIGHT_BYTES`` when it uses them. The copy
streams, one per device, are the only state shared by all models: they hold nothing of any model.
"""

from __future__ import annotations

import collections
import threading

import torch

from keras_lms.offload.torch.offloader import package_default
from keras_lms.offload.torch.pool import HostBufferPool, host_pool, layout_of
from keras_lms.offload.torch.stats import TransferCounter, count

_COPY_STREAMS: dict = {}


def _copy_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _COPY_STREAMS.get(index)
    if stream is None:
        stream = _COPY_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


class _HostCopy:
    """The host copy of one device tensor for one step, shared by every call that offloads that tensor.

    ``pending`` counts the backward passes that will still read it; the buffer goes back to the pool when the
    last has issued its swap-in (or when the step's graph is freed without them). ``output_pending`` counts
    activation layers that take their gradient from it (it is their output): while one is pending, the device
    copy a consumer brings back stays ``resident`` so the activation's backward, which runs right after the
    consumer's, reads it without another transfer. ``shared_pending`` counts other readers that will take the
    ``resident`` copy (a BatchNorm whose input a recompute brought back: ``recompute.RecomputedCopy``).
    """

    __slots__ = ("buffer", "pool", "nbytes", "pending", "output_pending", "shared_pending", "resident",
                 "__weakref__")

    def __init__(self, buffer, pool, nbytes):
        self.buffer, self.pool, self.nbytes = buffer, pool, nbytes
        self.pending = 0
        self.output_pending = 0
        self.shared_pending = 0
        self.resident = None

    def bring_back(self, transfer: Transfer) -> _SwapIn:
        """Start the copy back to ``transfer``'s device."""
        return transfer.to_device(self)

    def done(self, output_reader: bool, shared: bool = False) -> None:
        """One reader has issued its swap-in (``shared``: it took the ``resident`` copy)."""
        self.pending -= 1
        if output_reader:
            self.output_pending -= 1
        elif shared and self.shared_pending > 0:
            self.shared_pending -= 1
        if self.output_pending <= 0 and self.shared_pending <= 0:
            self.resident = None
        if self.pending <= 0:
            self.release()

    def release(self) -> None:
        buffer, self.buffer = self.buffer, None
        self.resident = None
        if buffer is not None and self.pool is not None:
            self.pool.release(buffer)

    def __del__(self):
        try:
            self.release()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class _SwapIn:
    """A device tensor being brought back; ``get`` makes the compute stream wait for the copy."""

    __slots__ = ("tensor", "event", "device", "used")

    def __init__(self, tensor, event=None, device=None):
        self.tensor, self.event, self.device, self.used = tensor, event, device, False

    def get(self) -> torch.Tensor:
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        self.used = True
        return self.tensor

    def __del__(self):
        # A prefetched copy nobody read: order the block's reuse on the compute stream after the copy.
        if self.event is not None and not self.used:
            try:
                torch.cuda.current_stream(self.device).wait_event(self.event)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


class Transfer:
    """Moves tensors between one compute device and host memory.

    CUDA: pinned pool buffers, one copy stream per device, non-blocking copies, events. CPU: no copy (the
    "host copy" is the tensor itself) unless ``copies`` is True, then synchronous copies into pool buffers.

    Back-pressure: a device tensor being copied to host stays allocated until its copy has run. When the forward
    pass computes faster than the link copies, those tensors would pile up on the device, so once the bytes of
    unfinished device-to-host copies exceed ``max(max_inflight_bytes, 2 x the tensor at hand)`` the host thread
    waits for the oldest copy (the device keeps computing what is already queued).

    ``copies`` / ``max_inflight_bytes``: None reads the package default (``CPU_HOST_COPIES`` now,
    ``MAX_INFLIGHT_BYTES`` at each copy). ``stats``: the counter to count into (a model's), else the process-wide
    total.
    """

    def __init__(self, device: torch.device, pool: HostBufferPool | None = None, copies: bool | None = None,
                 max_inflight_bytes: int | None = None, stats: TransferCounter | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.copies = self.cuda or bool(package_default("CPU_HOST_COPIES") if copies is None else copies)
        self.max_inflight_bytes = max_inflight_bytes
        self.pool = pool if pool is not None else host_pool()
        self.count = stats.count if stats is not None else count
        self.stream = _copy_stream(self.device) if self.cuda else None
        self._inflight = collections.deque()  # (event, nbytes) of device-to-host copies, oldest first
        self._inflight_bytes = 0
        self._inflight_lock = threading.Lock()

    def _throttle(self, event, nbytes: int) -> None:
        with self._inflight_lock:
            self._inflight.append((event, nbytes))
            self._inflight_bytes += nbytes
            inflight = self.max_inflight_bytes
            limit = max(package_default("MAX_INFLIGHT_BYTES") if inflight is None else inflight, 2 * nbytes)
            while self._inflight and (self._inflight_bytes > limit or self._inflight[0][0].query()):
                oldest, size = self._inflight.popleft()
                oldest.synchronize()  # no-op when query() said it is done
                self._inflight_bytes -= size

    def to_host(self, tensor: torch.Tensor) -> _HostCopy:
        nbytes = tensor.numel() * tensor.element_size()
        if not self.copies:
            return _HostCopy(tensor, None, nbytes)
        buffer = self.pool.acquire(tensor.shape, tensor.dtype, layout_of(tensor))
        source = tensor.detach()  # the copy is not part of the autograd graph
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer has run
            with torch.cuda.stream(self.stream):
                buffer.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            # The caching allocator must not hand the device block to anyone before the copy has read it.
            source.record_stream(self.stream)
            self._throttle(event, nbytes)
        else:
            buffer.copy_(source)
        self.count(d2h_bytes=nbytes, d2h_copies=1)
        return _HostCopy(buffer, self.pool, nbytes)

    def to_device(self, host: _HostCopy) -> _SwapIn:
        if host.buffer is None:
            raise RuntimeError(
                "keras-lms: an offloaded activation was already released; the backward pass of a wrapped model's "
                "training step can run only once (retain_graph=True / a second backward are not supported)."
            )
        if not self.copies:
            return _SwapIn(host.buffer)
        if not self.cuda:
            self.count(h2d_bytes=host.nbytes, h2d_copies=1)
            return _SwapIn(host.buffer.clone())
        compute = torch.cuda.current_stream(self.device)
        # Allocated on the compute stream (where it is used and freed); the copy stream waits for the work
        # queued so far, which may still be using the block the allocator just handed out.
        # with the buffer's strides, which are the original's (HostBufferPool)
        tensor = torch.empty_strided(host.buffer.shape, host.buffer.stride(), dtype=host.buffer.dtype,
                                     device=self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            tensor.copy_(host.buffer, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.count(h2d_bytes=host.nbytes, h2d_copies=1)
        return _SwapIn(tensor, event, self.device)
