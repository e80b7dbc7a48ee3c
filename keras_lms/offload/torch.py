"""How a tensor goes to host and comes back on the torch back end.

For every offloaded layer call ``y = layer(x)`` (the contract of ``offload/tensorflow.py``, in torch terms):

1. forward: a ``torch.autograd.Function`` runs the layer's *original* ``call`` through
   ``_keras_adapter.run_stateless`` (no autograd graph is built inside it). Its inputs are the call's tensors and
   the torch tensors behind the layer's trainable variables, so the weight gradients flow into ``.grad`` where
   Keras' torch trainer reads them. The new non-trainable values (BatchNorm moving statistics, seed-generator
   states) are assigned to the variables once, outside; the recompute uses a *snapshot* taken before.
2. swap-out: each offloaded input is copied into a pinned host buffer (from a pool keyed by shape and dtype,
   reused across steps) on a dedicated CUDA copy stream (``non_blocking``); ``record_stream`` tells the caching
   allocator that the device tensor is in use by the copy, so it is released as soon as the copy has run and
   the forward pass drops it (the Function does not save it). One host copy per tensor per step: a U-Net skip
   tensor consumed by several offloaded calls is copied once (cache keyed by tensor identity, weakly).
3. backward: the host copies come back on the copy stream into device memory allocated on the compute stream
   (the copy stream first waits for the compute stream, so the block cannot still be in use); the backward of
   call k starts the swap-ins of the offloaded calls k-1 .. k-prefetch (forward order), so they overlap with
   call k's recompute. Before use, the compute stream waits on the copy's event. The layer is recomputed under
   ``torch.enable_grad()`` from the swapped-in inputs with the snapshot (identical Dropout masks and BatchNorm
   batch statistics) and the VJP is ``torch.autograd.grad``.
4. without the recompute:
   * relu/sigmoid/tanh activation layers (``ReLU()``, ``Activation(...)``) copy their *output* instead of
     their input (the same host copy as the next layer's input) and take their gradient from it with the very
     kernels torch's own autograd uses (``threshold_backward`` etc.), sharing the swap-in with the consumer
     (not elu: torch differentiates elu from its input, so an output-based gradient would differ by ~1e-7);
   * structural layers whose torch gradient reads no activation (Add, Concatenate, reshapes, padding,
     cropping, global average pooling) run plainly: autograd keeps nothing of them, so there is nothing to
     offload;
   * calls whose inputs and weights need no gradient run plainly (autograd keeps nothing of them either).
   Convolutions are recomputed (unlike the TF back end, torch has no graph pruning that would skip the
   forward convolution in the recompute).

On a machine without CUDA nothing is copied: the "host copy" is the tensor itself (``CPU_HOST_COPIES = True``
makes it a real copy into pool buffers, which the tests use). The recompute, its numerics and the scheduling
are the same, so CPU CI tests the logic.

Keras keeps every intermediate tensor of a functional graph alive until the forward pass returns; on an eager
back end that would keep all activations on the device, so :meth:`StepContext.forward_scope` makes the
wrapped model's functional graphs release each tensor after its last consumer
(``_keras_adapter.releasing_graph_runs``). Keras' torch tree utilities keep every tensor they flatten in a
reference cycle until Python's cyclic collector runs; the forward pass and each recompute run under
``_keras_adapter.acyclic_torch_trees``, so an offloaded original dies when its last forward consumer is done
(also with ``gc.disable()``; ``tests/torch/test_memory.py``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import threading
import weakref

import keras
import torch
from torch.utils.weak import WeakIdKeyDictionary

from keras_lms import _keras_adapter as adapter
from keras_lms import layer_facts, policy
from keras_lms.offload import common

# On a machine without CUDA, copy offloaded tensors into pool buffers instead of keeping them (tests).
CPU_HOST_COPIES = False


# --------------------------------------------------------------------------------------------- statistics
@dataclasses.dataclass
class TransferStats:
    """Cumulative counters of what the torch back end moved (since the last :func:`reset_transfer_stats`)."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    h2d_copies: int = 0
    shared_swap_ins: int = 0  # swap-ins served by a copy already on the device (no transfer)
    offloaded_calls: int = 0
    output_gradient_calls: int = 0
    plain_calls: int = 0


_STATS = TransferStats()
_STATS_LOCK = threading.Lock()


def transfer_stats() -> dict:
    with _STATS_LOCK:
        return dataclasses.asdict(_STATS)


def reset_transfer_stats() -> None:
    global _STATS
    with _STATS_LOCK:
        _STATS = TransferStats()


def _count(**deltas):
    with _STATS_LOCK:
        for key, value in deltas.items():
            setattr(_STATS, key, getattr(_STATS, key) + value)


# ------------------------------------------------------------------------------------------- host buffers
class HostBufferPool:
    """Host buffers keyed by ``(shape, dtype)``, reused across steps (pinned allocation costs milliseconds).

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

    @staticmethod
    def key(shape, dtype) -> tuple:
        return tuple(int(d) for d in shape), dtype

    def acquire(self, shape, dtype) -> torch.Tensor:
        key = self.key(shape, dtype)
        with self._lock:
            self._last_used[key] = self.step
            self.lent += 1
            idle = self._idle.get(key)
            if idle:
                self.reuses += 1
                return idle.pop()
            self.allocations += 1
        return torch.empty(key[0], dtype=dtype, device="cpu", pin_memory=self.pin)

    def release(self, buffer: torch.Tensor) -> None:
        key = self.key(buffer.shape, buffer.dtype)
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


_POOL: HostBufferPool | None = None


def host_pool() -> HostBufferPool:
    """The process-wide host buffer pool (pinned when CUDA is available)."""
    global _POOL
    if _POOL is None:
        _POOL = HostBufferPool()
    return _POOL


def clear_host_pool() -> None:
    """Free the idle host buffers (e.g. between runs at different input sizes)."""
    if _POOL is not None:
        _POOL.clear()


# -------------------------------------------------------------------------------------------- transfers
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
    consumer's, reads it without another transfer.
    """

    __slots__ = ("buffer", "pool", "nbytes", "pending", "output_pending", "resident", "__weakref__")

    def __init__(self, buffer, pool, nbytes):
        self.buffer, self.pool, self.nbytes = buffer, pool, nbytes
        self.pending = 0
        self.output_pending = 0
        self.resident = None

    def done(self, output_reader: bool) -> None:
        self.pending -= 1
        if output_reader:
            self.output_pending -= 1
        if self.output_pending <= 0:
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


# Device bytes that device-to-host copies still being read may hold (at least two tensors' worth, so the copy
# engine always has the next copy queued).
MAX_INFLIGHT_BYTES = 256 << 20


class Transfer:
    """Moves tensors between one compute device and host memory.

    CUDA: pinned pool buffers, one copy stream per device, non-blocking copies, events. CPU: no copy (the
    "host copy" is the tensor itself) unless ``copies`` is True, then synchronous copies into pool buffers.

    Back-pressure: a device tensor being copied to host stays allocated until its copy has run. When the forward
    pass computes faster than the link copies, those tensors would pile up on the device, so once the bytes of
    unfinished device-to-host copies exceed ``max(MAX_INFLIGHT_BYTES, 2 x the tensor at hand)`` the host thread
    waits for the oldest copy (the device keeps computing what is already queued).
    """

    def __init__(self, device: torch.device, pool: HostBufferPool | None = None, copies: bool | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.copies = self.cuda or (CPU_HOST_COPIES if copies is None else copies)
        self.pool = pool if pool is not None else host_pool()
        self.stream = _copy_stream(self.device) if self.cuda else None
        self._inflight = collections.deque()  # (event, nbytes) of device-to-host copies, oldest first
        self._inflight_bytes = 0
        self._inflight_lock = threading.Lock()

    def _throttle(self, event, nbytes: int) -> None:
        with self._inflight_lock:
            self._inflight.append((event, nbytes))
            self._inflight_bytes += nbytes
            limit = max(MAX_INFLIGHT_BYTES, 2 * nbytes)
            while self._inflight and (self._inflight_bytes > limit or self._inflight[0][0].query()):
                oldest, size = self._inflight.popleft()
                oldest.synchronize()  # no-op when query() said it is done
                self._inflight_bytes -= size

    def to_host(self, tensor: torch.Tensor) -> _HostCopy:
        nbytes = tensor.numel() * tensor.element_size()
        if not self.copies:
            return _HostCopy(tensor, None, nbytes)
        buffer = self.pool.acquire(tensor.shape, tensor.dtype)
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
        _count(d2h_bytes=nbytes, d2h_copies=1)
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
            _count(h2d_bytes=host.nbytes, h2d_copies=1)
            return _SwapIn(host.buffer.clone())
        compute = torch.cuda.current_stream(self.device)
        # Allocated on the compute stream (where it is used and freed); the copy stream waits for the work
        # queued so far, which may still be using the block the allocator just handed out.
        tensor = torch.empty(host.buffer.shape, dtype=host.buffer.dtype, device=self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            tensor.copy_(host.buffer, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        _count(h2d_bytes=host.nbytes, h2d_copies=1)
        return _SwapIn(tensor, event, self.device)


# ------------------------------------------------------------------------------------------- scheduling
def swap_in_order(index: int, pending, prefetch: int) -> list:
    """Which offloaded calls' swap-ins the backward of call ``index`` starts, in the order they are issued.

    ``pending`` holds the calls whose swap-in has not started. The call's own inputs come first (needed now),
    then calls ``index-1 .. index-prefetch`` of the forward pass (their backward runs next, in that order).
    With ``prefetch=0`` a call brings back only its own inputs, when its gradient arrives.
    """
    order = [index] if index in pending else []
    order += [i for i in range(index - 1, index - prefetch - 1, -1) if i in pending]
    return order


# ----------------------------------------------------------------------------------------- unit kinds
def _output_gradient_fns():
    """activation name -> f(y, dy): its input gradient from its output, with torch's own kernels."""
    aten = torch.ops.aten
    return {
        "relu": lambda y, dy: aten.threshold_backward(dy, y, 0),
        "sigmoid": lambda y, dy: aten.sigmoid_backward(dy, y),
        "tanh": lambda y, dy: aten.tanh_backward(dy, y),
        # Not elu: torch's own elu gradient reads the input; elu_backward from the output is 1.2e-7 off.
    }


def output_gradient(unit):
    """For a relu/sigmoid/tanh activation layer, ``fn(y, dy)`` giving its input gradient; else None."""
    return _output_gradient_fns().get(layer_facts.output_gradient_activation(unit))


def runs_plainly(unit, kwargs) -> bool:
    """Structural layers whose torch gradient keeps no activation (a mask turns pooling into a product)."""
    if not layer_facts.is_keras_class(unit, layer_facts.STRUCTURAL_LAYERS):
        return False
    return not any(isinstance(v, torch.Tensor) for v in keras.tree.flatten(kwargs))


def offloadable_reason(unit) -> str | None:
    """Why the torch back end cannot offload this unit's calls, or None if it can."""
    if adapter.is_quantized(unit):
        return "quantized layers are not intercepted (they run quantized_call)"
    return None


# ------------------------------------------------------------------------------------------ the backend
def executing_eagerly() -> bool:
    return True


_HOST_RE = re.compile(r"^/?(?:device:)?(cpu)(?::(\d+))?$", re.IGNORECASE)


def validate_host_device(host_device: str) -> str:
    """Resolve ``host_device`` to the host ('/CPU:0'); torch has one CPU device."""
    if not isinstance(host_device, str):
        raise ValueError(f"host_device={host_device!r} is not a device string; use e.g. '/CPU:0'.")
    match = _HOST_RE.match(host_device.strip())
    if match is None:
        if re.match(r"^/?(?:device:)?(gpu|cuda|tpu|mps|xla)", host_device.strip(), re.IGNORECASE):
            raise ValueError(
                f"host_device={host_device!r} is not a CPU device. keras-lms offloads activations to host memory; "
                "use '/CPU:0'."
            )
        raise ValueError(f"host_device={host_device!r} is not a device string; use e.g. '/CPU:0'.")
    index = int(match.group(2) or 0)
    if index != 0:
        raise ValueError(f"host_device={host_device!r} does not exist on this machine; available: /CPU:0.")
    return "/CPU:0"


def _is_torch_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class _RngState:
    """torch's global RNG states at the forward call, re-used by the recompute (as torch.utils.checkpoint does).

    Keras' torch Dropout without a seed draws its mask from torch's global generator, not from a Keras
    SeedGenerator variable, so the variable snapshot alone would not reproduce it.
    """

    __slots__ = ("cpu", "cuda")

    def __init__(self, cpu, cuda):
        self.cpu, self.cuda = cpu, cuda

    @classmethod
    def capture(cls, tensors):
        cuda = {}
        if torch.cuda.is_available():
            devices = {t.device.index for t in tensors if t.is_cuda}
            devices.add(torch.cuda.current_device())
            cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
        return cls(torch.get_rng_state(), cuda)

    @contextlib.contextmanager
    def restored(self):
        with torch.random.fork_rng(devices=sorted(self.cuda), enabled=True):
            torch.set_rng_state(self.cpu)
            for device, state in self.cuda.items():
                torch.cuda.set_rng_state(state, device)
            yield


class _OffloadedFunction(torch.autograd.Function):
    """One offloaded layer call; the non-tensor first argument carries everything (a :class:`_CallRecord`)."""

    @staticmethod
    def forward(ctx, record, *flat):
        ctx.set_materialize_grads(False)
        ctx.record = record
        return record.forward(flat)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        record = ctx.record
        return (None, *record.backward(grads))


class _CallRecord:
    """What the backward pass of one offloaded call needs: host copies, small kept tensors, the snapshot."""

    def __init__(self, step, index, unit, original, template, positions, tensors, trainable, snapshot, masks,
                 autocast, output_grad=None):
        self.step = step
        self.index = index
        self.unit = unit
        self.original = original
        self.template = template
        self.positions = positions
        self.n_inputs = len(tensors)
        self.trainable = trainable
        self.snapshot = snapshot
        self.masks = masks
        self.autocast = autocast
        self.output_grad = output_grad  # fn(y, dy) for activation layers (output-based gradient)
        self.hosts = [None] * len(tensors)  # _HostCopy per offloaded input
        self.kept = [None] * len(tensors)  # device tensors kept as they are (small or not offloaded)
        self.output_host = None  # the activation's output host copy (output-based gradient)
        self.swaps = None  # id(_HostCopy) -> _SwapIn, once started
        self.started = False
        self.finished = False
        self.forward_result = None
        self.transfer = None  # the Transfer of the call's device
        self.rng = None  # torch's global RNG states before the forward call (unseeded Dropout draws from them)

    # ------------------------------------------------------------------------------------- forward
    def forward(self, flat):
        xs, values = list(flat[:self.n_inputs]), list(flat[self.n_inputs:])
        for x, mask in zip(xs, self.masks):
            adapter.set_mask(x, mask)
        args, kwargs = common.rebuild(self.template, self.positions, xs)
        outputs, new_state, losses = adapter.run_stateless(self.unit, self.original, values, self.snapshot, args,
                                                           kwargs, self.autocast)
        leaves = keras.tree.flatten(outputs)
        tensor_out = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self.forward_result = (outputs, new_state, len(tensor_out))
        return tuple(tensor_out) + tuple(losses)

    # ------------------------------------------------------------------------------------ backward
    def host_copies(self):
        hosts = [h for h in self.hosts if h is not None]
        if self.output_host is not None:
            hosts.append(self.output_host)
        return hosts

    def start_swap_in(self):
        """Issue this call's host-to-device copies (idempotent); shares a copy already on the device."""
        if self.started:
            return
        self.started = True
        self.swaps = {}
        for host in self.host_copies():
            if id(host) in self.swaps:
                continue
            swap = host.resident
            if swap is not None:
                _count(shared_swap_ins=1)
            else:
                swap = self.transfer.to_device(host)
                others = host.output_pending - (1 if host is self.output_host else 0)
                if others > 0:
                    host.resident = swap  # an activation layer's backward reads it right after ours
            self.swaps[id(host)] = swap
        for host in self.host_copies():
            host.done(output_reader=host is self.output_host)

    def backward(self, grads):
        if self.finished:
            raise RuntimeError(
                "keras-lms: the backward pass of an offloaded layer call ran twice. A wrapped model's training step "
                "supports one backward pass per forward pass (no retain_graph=True)."
            )
        self.finished = True
        step = self.step
        step.begin_backward(self)
        try:
            if self.output_grad is not None:
                y = self.swaps[id(self.output_host)].get()
                dy = grads[0]
                dx = None if dy is None else self.output_grad(y, dy)
                return [dx] + [None] * (self.n_inputs - 1) + [None] * len(self.trainable)
            return self._recompute_vjp(grads)
        finally:
            self.swaps = None
            self.kept = [None] * self.n_inputs
            self.trainable = self.snapshot = None
            step.end_backward(self)

    def _recompute_vjp(self, grads):
        xs = []
        for host, kept in zip(self.hosts, self.kept):
            xs.append(kept if host is None else self.swaps[id(host)].get())
        with torch.enable_grad(), self.rng.restored(), adapter.acyclic_torch_trees():
            xs = [x.detach().requires_grad_(True) if _is_float(x) else x.detach() for x in xs]
            params = [p.detach().requires_grad_(True) for p in self.trainable]
            for x, mask in zip(xs, self.masks):
                adapter.set_mask(x, mask)
            args, kwargs = common.rebuild(self.template, self.positions, xs)
            outputs, _, losses = adapter.run_stateless(self.unit, self.original, params, self.snapshot, args, kwargs,
                                                       self.autocast)
            targets = [t for t in keras.tree.flatten(outputs) if isinstance(t, torch.Tensor)] + list(losses)
            pairs = [(t, g) for t, g in zip(targets, grads) if g is not None and t.requires_grad]
            sources = [x for x in xs if _is_float(x)] + params
            if pairs and sources:
                source_grads = torch.autograd.grad([t for t, _ in pairs], sources, [g for _, g in pairs],
                                                   allow_unused=True)
            else:
                source_grads = [None] * len(sources)
        source_grads = iter(source_grads)
        input_grads = [next(source_grads) if _is_float(x) else None for x in xs]
        return input_grads + list(source_grads)


class StepContext(common.InterceptingContext):
    """State of one forward pass of a wrapped model in training mode (torch).

    Lives as long as the backward pass of that step needs it: every offloaded call's autograd node holds its
    record, which holds this context; the context indexes the records weakly.
    """

    def __init__(self, config, structure, plan, eager: bool = True):
        self.config = config
        self.structure = structure
        self.plan = plan
        self.eager = eager
        self.host = validate_host_device(config.host_device)
        self.index = 0
        self.host_copies = WeakIdKeyDictionary()  # device tensor (weakly) -> _HostCopy
        self.records = weakref.WeakValueDictionary()  # call index -> _CallRecord (offloaded calls)
        self.transfers = {}  # device -> Transfer
        self.pool = host_pool()
        self.pool.new_step()
        self.mismatch_warned = False
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def forward_scope(self):
        """Around the wrapped model's forward pass: release graph intermediates after their last use, and
        flatten structures without reference cycles (see ``_keras_adapter.acyclic_torch_trees``)."""
        with adapter.releasing_graph_runs(self.structure.models), adapter.acyclic_torch_trees():
            yield

    def transfer(self, device) -> Transfer:
        transfer = self.transfers.get(device)
        if transfer is None:
            transfer = self.transfers[device] = Transfer(device, self.pool)
        return transfer

    # ----------------------------------------------------------------------------------- forward
    def call(self, index, unit, original, args, kwargs):
        tensors = [leaf for leaf in keras.tree.flatten((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        decision = self._decision(index, unit, tensors)
        if not decision.offloaded or not self._needs_graph(unit, tensors) or runs_plainly(unit, kwargs):
            _count(plain_calls=1)
            return original(*args, **kwargs)
        return self._offloaded_call(index, unit, original, args, kwargs, tensors, decision)

    @staticmethod
    def _needs_graph(unit, tensors) -> bool:
        """Whether autograd would record this call at all (else it keeps nothing and runs plainly)."""
        if not torch.is_grad_enabled():
            return False
        if any(t.requires_grad for t in tensors):
            return True
        return bool(getattr(unit, "trainable_variables", None))

    def _decision(self, index, unit, tensors):
        sizes = [policy.tensor_bytes(tuple(t.shape), keras.backend.standardize_dtype(t.dtype)) for t in tensors]
        ranks = [t.dim() for t in tensors]
        return common.planned_decision(self, index, unit, sizes, ranks, offloadable_reason(unit))

    def swap_out(self, tensor) -> _HostCopy:
        """The step's host copy of ``tensor`` (made once, shared by every call that offloads it)."""
        with self._lock:
            host = self.host_copies.get(tensor)
            if host is None or host.buffer is None:
                host = self.transfer(tensor.device).to_host(tensor)
                self.host_copies[tensor] = host
            return host

    def _offloaded_call(self, index, unit, original, args, kwargs, tensors, decision):
        template, positions = common.template(args, kwargs, _is_torch_tensor)
        is_layer = isinstance(unit, keras.layers.Layer)
        trainable = list(adapter.raw_values(unit.trainable_variables)) if is_layer else []
        snapshot = list(adapter.raw_values(unit.non_trainable_variables)) if is_layer else []
        masks = [adapter.get_mask(t) for t in tensors]
        act_grad = output_gradient(unit) if len(tensors) == 1 and not trainable else None
        record = _CallRecord(self, index, unit, original, template, positions, tensors, trainable, snapshot, masks,
                             adapter.current_autocast_dtype(), output_grad=act_grad)
        record.transfer = self.transfer(next((t.device for t in tensors if t.is_cuda), tensors[0].device))
        if act_grad is None:
            record.rng = _RngState.capture(tensors)
            for j, (t, off) in enumerate(zip(tensors, decision.offload_tensor)):
                if off:
                    host = self.swap_out(t)
                    host.pending += 1
                    record.hosts[j] = host
                else:
                    record.kept[j] = t
        flat_results = _OffloadedFunction.apply(record, *tensors, *trainable)
        outputs, new_state, n_out = record.forward_result
        record.forward_result = None
        tensor_results, losses = list(flat_results[:n_out]), list(flat_results[n_out:])
        inner = iter(leaf for leaf in keras.tree.flatten(outputs) if isinstance(leaf, torch.Tensor))
        results = iter(tensor_results)
        leaves = []
        for leaf in keras.tree.flatten(outputs):
            if isinstance(leaf, torch.Tensor):
                mask = adapter.get_mask(next(inner))
                leaf = next(results)
                adapter.set_mask(leaf, mask)
            leaves.append(leaf)
        outputs = keras.tree.pack_sequence_as(outputs, leaves)
        if act_grad is not None:
            if not tensor_results or tensor_results[0].grad_fn is None:
                act_grad = record.output_grad = None  # nothing will ask for its gradient
            else:
                host = self.swap_out(tensor_results[0])
                host.pending += 1
                host.output_pending += 1
                record.output_host = host
                _count(output_gradient_calls=1)
        for loss in losses:
            unit.add_loss(loss)
        if is_layer:
            for j, (var, old, new) in enumerate(zip(unit.non_trainable_variables, snapshot, new_state)):
                if new is not old:
                    # assign() copies in place into the tensor the snapshot holds: keep the old value.
                    record.snapshot[j] = old.detach().clone()
                    var.assign(new)
        self.records[index] = record
        _count(offloaded_calls=1)
        return outputs

    # ---------------------------------------------------------------------------------- backward
    def begin_backward(self, record):
        """Start this call's swap-in (if not prefetched) and those of the next ``prefetch`` calls."""
        with self._lock:
            candidates = {i: self.records.get(i) for i in range(record.index - self.config.prefetch, record.index)}
            candidates[record.index] = record
            pending = {i for i, r in candidates.items() if r is not None and not r.started}
            for i in swap_in_order(record.index, pending, self.config.prefetch):
                candidates[i].start_swap_in()

    def end_backward(self, record):
        with self._lock:
            if self.records.get(record.index) is record:
                del self.records[record.index]


# --------------------------------------------------------------------------------------------- planning
def _keras_dtype(dtype) -> str:
    return keras.backend.standardize_dtype(dtype)


def _spec(value):
    if isinstance(value, torch.Tensor):
        return keras.KerasTensor(tuple(value.shape), _keras_dtype(value.dtype))
    return value


def spec_for(shape, dtype):
    """A placeholder spec for trace_calls from a shape (with batch axis) and dtype."""
    return keras.KerasTensor(tuple(shape), dtype)


def signature_of(inputs, kwargs):
    """Hashable key of a call's tensor shapes/dtypes: one plan per input signature."""
    out = []
    for leaf in keras.tree.flatten((inputs, kwargs)):
        if isinstance(leaf, (torch.Tensor, keras.KerasTensor)):
            out.append((tuple(leaf.shape), _keras_dtype(leaf.dtype)))
        else:
            out.append(repr(leaf))
    return tuple(out)


def trace_calls(model, structure, inputs, kwargs) -> list:
    """Run ``model(inputs, training=True)`` symbolically (torch "meta" tensors) and list its unit calls in order.

    Only shapes are recorded; nothing is computed on the device and no state changes (Keras' symbolic call
    runs under a StatelessScope); losses added during the trace are cleared.
    """
    calls, held = [], []

    def make_recorder(unit, original):
        def recording_call(*args, **kw):
            tensors = [t for t in keras.tree.flatten((args, kw)) if isinstance(t, torch.Tensor)]
            outputs = original(*args, **kw)
            outs = [t for t in keras.tree.flatten(outputs) if isinstance(t, torch.Tensor)]
            held.extend(tensors + outs)  # keep ids unique within the trace
            calls.append(policy.RawCall(
                unit=unit,
                enclosing=structure.unit_models.get(id(unit), []),
                shapes=[list(t.shape) for t in tensors],
                dtypes=[_keras_dtype(t.dtype) for t in tensors],
                ranks=[t.dim() for t in tensors],
                keys=[id(t) for t in tensors],
                output_shapes=[list(t.shape) for t in outs],
                output_dtypes=[_keras_dtype(t.dtype) for t in outs],
                offloadable=offloadable_reason(unit),
                output_keys=[id(t) for t in outs],
            ))
            return outputs

        return recording_call

    spec_inputs, spec_kwargs = keras.tree.map_structure(_spec, (inputs, kwargs))

    def forward(x, kw):
        calls.clear()  # Keras retries on real tensors when an op has no meta kernel
        held.clear()
        return model(x, training=True, **kw)

    with adapter.patched_calls(structure.units, make_recorder):
        adapter.compute_output_spec(forward, spec_inputs, spec_kwargs)
    adapter.clear_losses(model)
    return calls


def example_inputs(model, batch_size: int):
    """Placeholder specs for a built model's inputs, or None when the model does not say its input shape."""
    declared = common.declared_inputs(model)
    if declared is not None:
        return keras.tree.map_structure(
            lambda kt: keras.KerasTensor([batch_size] + list(kt.shape[1:]), kt.dtype), declared)
    build = model.get_build_config() if hasattr(model, "get_build_config") else None
    shape = (build or {}).get("input_shape")
    if shape is None or not isinstance(shape, (list, tuple)) or not shape or isinstance(shape[0], (list, tuple, dict)):
        return None
    return keras.KerasTensor([batch_size] + list(shape[1:]), "float32")
