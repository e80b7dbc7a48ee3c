"""The host buffer pool: pinned host buffers keyed by shape, strides and dtype, reused across steps."""

from __future__ import annotations

import threading
import weakref

import torch


class HostBufferPool:
    """Host buffers keyed by ``(shape, strides, dtype)``, reused across steps (pinned allocation costs milliseconds).

    A buffer has the strides of the tensor it copies (Keras' torch ops hand out channels-last permutations of
    channels-first results): the copy brought back then has the original's memory layout, so every kernel of
    the backward pass sees the layout the plain model's does. With a contiguous buffer the gradient of a relu
    read from its host copy came out in another layout, and a max pooling downstream summed its overlapping
    windows in another order (DenseNet121: 1e-5 relative gradient error, float32 and float64 alike).

    ``acquire`` hands out an idle buffer of that key or allocates one (pinned when ``pin``); ``release`` returns
    it. ``new_step`` drops idle buffers whose key was not used during the previous step (input sizes changed),
    so the pool holds about one step's worth of host memory. Thread-safe: backward passes run on torch's
    autograd device threads. Ordering on the device is the caller's business: every copy into or out of a
    pooled buffer is issued on the one copy stream, so a reused buffer cannot be overwritten early.
    """

    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._idle: dict = {}
        self._last_used: dict = {}
        self._lock = threading.RLock()  # reentrant: release may run from __del__ during an acquire
        self.step = 0
        self.allocations = 0
        self.reuses = 0
        self.lent = 0
        _LIVE_POOLS.add(self)

    @staticmethod
    def key(shape, dtype, stride=None) -> tuple:
        shape = tuple(int(d) for d in shape)
        if stride is None:
            stride = torch.empty(shape, device="meta").stride()  # contiguous
        return shape, dtype, tuple(int(s) for s in stride)

    def acquire(self, shape, dtype, stride=None) -> torch.Tensor:
        """An idle buffer of that shape, dtype and stride (default: contiguous), or a new one."""
        key = self.key(shape, dtype, stride)
        with self._lock:
            self._last_used[key] = self.step
            self.lent += 1
            idle = self._idle.get(key)
            if idle:
                self.reuses += 1
                return idle.pop()
            self.allocations += 1
        return torch.empty_strided(key[0], key[2], dtype=dtype, device="cpu", pin_memory=self.pin)

    def release(self, buffer: torch.Tensor) -> None:
        key = self.key(buffer.shape, buffer.dtype, buffer.stride())
        with self._lock:
            self.lent -= 1
            self._idle.setdefault(key, []).append(buffer)

    def new_step(self) -> None:
        with self._lock:
            self.step += 1
            for key in [k for k, last in self._last_used.items() if last < self.step - 1]:
                self._idle.pop(key, None)
                del self._last_used[key]

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for bufs in self._idle.values() for b in bufs)

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._last_used.clear()


_LIVE_POOLS: weakref.WeakSet = weakref.WeakSet()  # every pool still in use (for clear_host_pool)
_POOL: HostBufferPool | None = None


def host_pool() -> HostBufferPool:
    """The pool of a ``Transfer`` made without one (tests); a wrapped model steps with its own
    (``offloader_of(model).pool``)."""
    global _POOL
    if _POOL is None:
        _POOL = HostBufferPool()
    return _POOL


def clear_host_pool() -> None:
    """Free the idle host buffers of every pool, each wrapped model's included (e.g. between runs at different
    input sizes)."""
    for pool in list(_LIVE_POOLS):
        pool.clear()


def layout_of(tensor: torch.Tensor) -> tuple:
    """The strides a host copy of ``tensor`` takes: what ``torch.empty_like`` preserves, i.e. its own when it is
    dense and non-overlapping, else contiguous ones."""
    return torch.empty_like(tensor, device="meta").stride()
