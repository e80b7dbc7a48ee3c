"""Device-memory peak of one torch training step, measured on the CPU: live tensor storages, plain vs wrapped.

    KERAS_BACKEND=torch python -m benchmarks.torch_cpu_peak                 # issue-15 U-Nets + Dense chain
    KERAS_BACKEND=torch python -m benchmarks.torch_cpu_peak --large         # + 2D 8x256^2, 3D 2x96^3 (slow)
    KERAS_BACKEND=torch python -m benchmarks.torch_cpu_peak --quick         # tiny sizes (seconds)
    KERAS_BACKEND=torch python -m benchmarks.torch_cpu_peak --large --only 2x96 --dtype-policy mixed_bfloat16
    KERAS_BACKEND=torch python -m benchmarks.torch_cpu_peak --large --only 2x96 --no-lean-normalization  # before

No GPU is needed. A ``TorchDispatchMode`` (:class:`LiveStorageTracker`) sees every tensor the step's compute
produces (forward, loss, backward, optimizer update) and keeps a weak reference to its storage; after each op
it sums the bytes of the storages still alive. Storages that existed before the step (weights, optimizer
slots) are not counted; host copies are: keras-lms' host buffers come from its pool
(``lms_torch.HostBufferPool.acquire``), which the tracker marks as host memory. Host copies are forced on
(``CPU_HOST_COPIES``, as the torch tests do), so the wrapped step moves what it would move on a GPU.

For each model it prints the peak of device bytes plain and wrapped (``wrap`` defaults, or ``--forced``),
once with Python's cyclic garbage collector running normally and once with ``gc.disable()`` for the whole
step (a GPU runs out of memory long before Python's allocation counters trigger a collection, so the second
is what a GPU sees), and ``keras_lms.report``'s prediction of the same quantity beside them
(:func:`predicted_step_bytes`: what the step allocates beyond the weights and optimizer state that exist
before it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import keras_lms
from benchmarks.models import build_unet
from keras_lms import planning
from keras_lms.offload import torch as lms_torch

MIB = float(1 << 20)


class LiveStorageTracker(TorchDispatchMode):
    """Live bytes of the tensor storages produced inside the mode; ``peak`` is their maximum after any op.

    Storages are keyed weakly (``StorageWeakRef``); a storage that dies is dropped at the next op. Storages
    handed out by keras-lms' host buffer pool are host memory and counted apart (``host_peak``).
    """

    def __init__(self):
        super().__init__()
        self.live = {}  # storage key -> (weak ref, bytes)
        self.host = set()  # keys of host buffers
        self.current = self.peak = 0
        self.host_current = self.host_peak = 0
        self.ops = 0

    @staticmethod
    def _key(storage):
        return storage.data_ptr(), storage.nbytes()

    def _sweep(self):
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            _, size = self.live.pop(k)
            if k in self.host:
                self.host.discard(k)
                self.host_current -= size
            else:
                self.current -= size

    def _add(self, tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        key = self._key(storage)
        entry = self.live.get(key)
        if entry is not None and not entry[0].expired():
            return
        if entry is not None:  # the address was reused after the old storage died
            self._sweep()
        self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.current += storage.nbytes()

    def mark_host(self, tensor):
        """Count ``tensor``'s storage as host memory (a keras-lms host buffer)."""
        key = self._key(tensor.untyped_storage())
        if key in self.live and key not in self.host:
            self.host.add(key)
            size = self.live[key][1]
            self.current -= size
            self.host_current += size
            self.host_peak = max(self.host_peak, self.host_current)

    @staticmethod
    def _tensors(values):
        # Not keras.tree.flatten: on torch it would keep the values alive until a garbage collection (issue 15).
        for v in values:
            if isinstance(v, (tuple, list)):
                yield from (u for u in v if isinstance(u, torch.Tensor))
            elif isinstance(v, torch.Tensor):
                yield v

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        self._sweep()
        # Views and in-place ops return an input's storage: not new (and a weight's storage is not counted).
        inputs = {self._key(t.untyped_storage()) for t in self._tensors(list(args) + list(kwargs.values()))
                  if t.device.type != "meta"}
        for t in self._tensors(out if isinstance(out, (tuple, list)) else [out]):
            if t.device.type == "meta" or self._key(t.untyped_storage()) not in inputs:
                self._add(t)
        self.peak = max(self.peak, self.current)
        return out


@contextlib.contextmanager
def tracking(gc_enabled: bool = True):
    """Track live storages (host pool buffers apart) within the block; yields the tracker."""
    tracker = LiveStorageTracker()
    acquire = lms_torch.HostBufferPool.acquire

    def marking_acquire(pool, shape, dtype, stride=None):
        buffer = acquire(pool, shape, dtype, stride)
        tracker.mark_host(buffer)
        return buffer

    lms_torch.HostBufferPool.acquire = marking_acquire
    gc.collect()
    was_enabled = gc.isenabled()
    if not gc_enabled:
        gc.disable()
    try:
        with tracker:
            yield tracker
    finally:
        if was_enabled:
            gc.enable()
        lms_torch.HostBufferPool.acquire = acquire


def step_peak(model, x, y, gc_enabled: bool = True, warmup: bool = True) -> dict:
    """Live-storage peak of one ``train_on_batch`` (forward, loss, backward, Adam) after one warm-up step."""
    if warmup:
        model.train_on_batch(x, y)  # builds the optimizer, plans the wrapped model
    lms_torch.clear_host_pool()  # host buffers are allocated (and marked) inside the measured step
    lms_torch.reset_transfer_stats()
    with tracking(gc_enabled) as tracker:
        model.train_on_batch(x, y)
    return dict(peak=tracker.peak, host_peak=tracker.host_peak, ops=tracker.ops,
                d2h_copies=lms_torch.transfer_stats()["d2h_copies"])


def first_step_bytes(model, x, y) -> int:
    """What a new user counts: the live-storage peak of the *first* ``train_on_batch`` of a compiled model (host
    copies forced by the caller, host buffers apart, GC off) plus the storages that exist before it: weights,
    optimizer state if already built, and ``x`` and ``y`` (torch tensors). Compare with ``keras_lms.report(...)
    .totals["predicted_peak_bytes_plain" / "_wrapped"]``."""
    inner = getattr(model, "inner_model", model)
    before = [v.value for v in inner.variables] + [x, y]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        before += [v.value for v in optimizer.variables]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in before}
    lms_torch.clear_host_pool()
    with tracking(gc_enabled=False) as tracker:
        model.train_on_batch(x, y)
    return sum(storages.values()) + tracker.peak


# ---------------------------------------------------------------------------------------------- models
def dense_chain(width=1024, layers=6):
    inp = keras.Input((width,))
    x = inp
    for i in range(layers):
        x = keras.layers.Dense(width, activation="relu", name=f"dense{i}")(x)
    return keras.Model(inp, keras.layers.Dense(1, name="out")(x), name="dense_chain")


def predicted_step_bytes(memory, model) -> int:
    """The report's prediction of what :func:`step_peak` measures: the step's peak beyond the weights and
    optimizer state that exist before it, i.e. the gradients plus the larger of the activation peak and the
    optimizer update's temporaries (``keras_lms.report(...).plain`` / ``.wrapped`` are ``memory``)."""
    return planning.variable_bytes(model.trainable_variables) + max(memory.activation_peak_bytes, memory.update_bytes)


def cases(args):
    if args.quick:
        yield "2D U-Net d2 f4, 4x32^2", lambda: build_unet((32, 32, 1), depth=2, base_filters=4), (4, 32, 32, 1), {}
        yield "Dense chain 3x256, batch 64 (forced)", lambda: dense_chain(256, 3), (64, 256), dict(
            min_bytes=0, keep_last=0)
        return
    yield ("2D U-Net d4 f32, 8x128^2", lambda: build_unet((128, 128, 1), depth=4, base_filters=32),
           (8, 128, 128, 1), {})
    yield ("3D U-Net d4 f16, 2x48^3", lambda: build_unet((48, 48, 48, 1), depth=4, base_filters=16),
           (2, 48, 48, 48, 1), {})
    yield "Dense chain 6x1024, batch 1024 (forced)", dense_chain, (1024, 1024), dict(min_bytes=0, keep_last=0)
    if args.large:
        yield ("2D U-Net d4 f32, 8x256^2", lambda: build_unet((256, 256, 1), depth=4, base_filters=32),
               (8, 256, 256, 1), {})
        yield ("3D U-Net d4 f16, 2x96^3", lambda: build_unet((96, 96, 96, 1), depth=4, base_filters=16),
               (2, 96, 96, 96, 1), {})


def measure(name, build, shape, settings, forced=False, lean_normalization=True, gc_off_only=False, planning=None):
    """One model's row; ``planning``: ``device_profile`` / ``device_budget`` for ``wrap`` (a time-aware plan,
    whose copies back may start earlier per call: ``leads`` counts the calls that do)."""
    rng = np.random.default_rng(0)
    x = rng.random(shape).astype("float32")
    keras.utils.set_random_seed(0)
    model = build()
    out_shape = (shape[0],) + tuple(model.output.shape[1:])
    y = (rng.random(out_shape) > 0.5).astype("float32")
    if forced:
        settings = dict(min_bytes=0, keep_last=0)
    settings = dict(settings, lean_normalization=lean_normalization, **(planning or {}))
    loss = "binary_crossentropy" if model.output.shape[-1] == 1 and len(shape) > 2 else "mse"
    model.compile(optimizer="adam", loss=loss)
    row = dict(model=name)
    if gc_off_only:  # one measured step per model (the GC-on column repeats the GC-off one)
        row["plain"] = row["plain_nogc"] = step_peak(model, x, y, gc_enabled=False)["peak"]
    else:
        row["plain"] = step_peak(model, x, y)["peak"]
        row["plain_nogc"] = step_peak(model, x, y, gc_enabled=False, warmup=False)["peak"]
    wrapped = keras_lms.wrap(model, **settings)
    wrapped.compile(optimizer="adam", loss=loss)
    lms = step_peak(wrapped, x, y, gc_enabled=not gc_off_only)
    row["wrapped"], row["host"], row["d2h_copies"] = lms["peak"], lms["host_peak"], lms["d2h_copies"]
    if gc_off_only:
        row["wrapped_nogc"] = row["wrapped"]
    else:
        row["wrapped_nogc"] = step_peak(wrapped, x, y, gc_enabled=False, warmup=False)["peak"]
    rep = keras_lms.report(wrapped, batch_size=shape[0])
    row["leads"] = sum(e.copy_back_lead is not None for e in wrapped.lms_plan)
    row["report_plain"] = predicted_step_bytes(rep.plain, model)
    row["report_wrapped"] = predicted_step_bytes(rep.wrapped, model)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models (seconds)")
    parser.add_argument("--large", action="store_true", help="also the 2D 8x256^2 and 3D 2x96^3 U-Nets")
    parser.add_argument("--forced", action="store_true", help="wrap(min_bytes=0, keep_last=0) for every model")
    parser.add_argument("--dtype-policy", default="float32",
                        help="Keras dtype policy the models are built under, e.g. mixed_bfloat16 (default float32)")
    parser.add_argument("--only", default=None, help="measure only the models whose name contains this")
    parser.add_argument("--gc-off-only", action="store_true",
                        help="measure each model once, with the cyclic GC off (the normal-GC columns repeat it)")
    parser.add_argument("--no-lean-normalization", action="store_true",
                        help="wrap(lean_normalization=False): BatchNorm recomputed with Keras' ops (the 'before')")
    parser.add_argument("--keras-tree-cycles", action="store_true",
                        help="measure without keras-lms' workaround for Keras' reference cycles (the 'before')")
    parser.add_argument("--device-profile", default=None,
                        help="wrap(device_profile=...): a time-aware plan (e.g. h100-pcie5), with --device-budget")
    parser.add_argument("--device-budget", default=None, help="wrap(device_budget=...), e.g. 40MiB")
    args = parser.parse_args(argv)
    planning = {k: v for k, v in (("device_profile", args.device_profile), ("device_budget", args.device_budget)) if v}
    lms_torch.CPU_HOST_COPIES = True
    keras.mixed_precision.set_global_policy(args.dtype_policy)
    if args.keras_tree_cycles:
        from keras_lms import _keras_adapter

        _keras_adapter.acyclic_torch_trees = contextlib.nullcontext
    print(f"dtype policy {args.dtype_policy}, lean_normalization={not args.no_lean_normalization}")
    print("| model | plain peak | wrapped, normal GC | ratio | wrapped, GC off | ratio | report plain (err) | "
          "report wrapped (err) | report ratio | host copies |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, build, shape, settings in cases(args):
        if args.only and args.only not in name:
            continue
        start = time.perf_counter()
        r = measure(name, build, shape, settings, args.forced, not args.no_lean_normalization, args.gc_off_only,
                    planning)
        rows.append(r)
        print(f"| {name} | {r['plain'] / MIB:.1f} MiB | {r['wrapped'] / MIB:.1f} MiB | {r['wrapped'] / r['plain']:.3f} "
              f"| {r['wrapped_nogc'] / MIB:.1f} MiB | {r['wrapped_nogc'] / r['plain_nogc']:.3f} "
              f"| {r['report_plain'] / MIB:.1f} MiB ({r['report_plain'] / r['plain_nogc'] - 1:+.0%}) "
              f"| {r['report_wrapped'] / MIB:.1f} MiB ({r['report_wrapped'] / r['wrapped_nogc'] - 1:+.0%}) "
              f"| {r['report_wrapped'] / r['report_plain']:.3f} | {r['host'] / MIB:.1f} MiB |"
              + (f" {r['leads']} calls with their own lead |" if planning else "")
              + f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


if __name__ == "__main__":
    main()
