"""Run the executed-graph cases in a fresh process (two logical CPUs must be set before TF initialises).

    python -m tests.offload.tensorflow.executed_graph_cases OUT.json

Writes, per case, the counts ``tests/offload/tensorflow/test_executed_graph.py`` asserts on
(see tests/offload/tensorflow/executed_graph.py).
Cases: three models (2D U-Net, ResNet-style, 3D U-Net) x {wrap() defaults, forced offload with prefetch
0/1/2}, the U-Nets with slabs (and the same without: the control), and two negative controls per model: the
plain model, and the 0.1.0 mechanism rebuilt here (a host
``Identity`` swap-out, and a swap-in gated on the device side) with grappler's defaults and with its
dependency optimiser off (then the swap-out survives, and the transfer back is shown to be ungated).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_BACKEND"] = "tensorflow"

from tests.offload.tensorflow import executed_graph as eg

eg.configure_two_cpus()

import numpy as np
import tensorflow as tf

import keras_lms
from benchmarks.models import build_unet
from keras_lms.offload.tensorflow import devices as tf_devices
from keras_lms.offload.tensorflow import recomputed_copies
from keras_lms.offload.tensorflow import record as tf_record
from keras_lms.offload.tensorflow import slabs as tf_slabs
from keras_lms.offload.tensorflow import step as tf_step
from keras_lms.offload.tensorflow.step import StepContext
from tests import models

# Activations at least this large count (the models' smallest activations are >= 16 KiB; biases, BatchNorm
# statistics and their reshapes are < 1 KiB).
ACTIVATION_BYTES = 1024

# Sizes chosen so that wrap()'s defaults (min_bytes=1 MiB, keep_last=1) offload several calls.
MODELS = {
    "unet2d": (lambda: models.unet2d(size=128, filters=8, depth=2), (4, 128, 128, 1)),
    "resnet": (lambda: models.resnet_blocks(size=96, filters=16, blocks=2), (4, 96, 96, 3)),
    "unet3d": (lambda: build_unet((32, 32, 32, 1), depth=2, base_filters=8, dropout=0.1), (2, 32, 32, 32, 1)),
}
# (forced with prefetch 1, between 0 and 2, left CI in session 26; prefetch 1 is the defaults' case)
CONFIGS = {
    "defaults": {},
    "forced_prefetch0": dict(min_bytes=0, keep_last=0, prefetch=0),
    "forced_prefetch2": dict(min_bytes=0, keep_last=0, prefetch=2),
}
# Slabs (keras_lms/offload/tensorflow/slabs.py): every full-resolution call of the U-Nets (2 MiB level-0 tensors) is cut
# into 8 slabs; the control computes the same calls whole.
SLAB_BYTES = 256 << 10
SLAB_CONFIGS = {
    "slabs": dict(min_bytes=0, keep_last=0, slab_bytes=SLAB_BYTES),
    "slabs_off": dict(min_bytes=0, keep_last=0, slab_bytes=0),
}
SLAB_MODELS = ("unet2d", "unet3d")


def _old_swap_in(self, host, trigger, device, index):
    """0.1.0's swap-in: a compute-device Identity with the trigger as control input (gates nothing)."""
    with tf.control_dependencies([trigger] if trigger is not None else []), tf_devices.on_device(device):
        dev = tf.identity(host, name=f"{tf_record.SWAP_IN_NAME}_{index}")
    self.swap_ins[host.ref()] = dev
    return dev


@contextlib.contextmanager
def old_mechanism():
    """Rebuild the 0.1.0 mechanism: host Identity swap-out, device-side gated swap-in."""
    saved = tf_step.host_op, StepContext.swap_in
    tf_step.host_op = lambda tensor, name: tf.identity(tensor, name=name)
    StepContext.swap_in = _old_swap_in
    try:
        yield
    finally:
        tf_step.host_op, StepContext.swap_in = saved


@contextlib.contextmanager
def forward_windows_ungated():
    """Negative control for the slab forward: cut the skip's windows without waiting for the newest part."""
    original = StepContext._host_window

    def ungated(self, host, a, b, gates, record, kind="bwd"):
        return original(self, host, a, b, gates if kind != "fwd" else [], record, kind)

    StepContext._host_window = ungated
    try:
        yield
    finally:
        StepContext._host_window = original


@contextlib.contextmanager
def slices_gated_through_constants():
    """Negative control for the slab gates: slice as ``x[:, a:b]`` did before 0.3.0, which puts a gate's control
    input on the slice's bound constants only (grappler merges and ungates those)."""
    original = tf_slabs.rows
    tf_slabs.rows = lambda x, a, b: x[:, a:b]
    try:
        yield
    finally:
        tf_slabs.rows = original


@contextlib.contextmanager
def recompute_not_waiting_for_its_reader():
    """Negative control for ``recomputed_copies.when_reader_runs``: its gates made without their control input."""
    recomputed_copies.GATED_ON_READER = False
    try:
        yield
    finally:
        recomputed_copies.GATED_ON_READER = True


@contextlib.contextmanager
def dependency_optimizer_off():
    tf.config.optimizer.set_experimental_options({"dependency_optimization": False})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"dependency_optimization": True})


def _gated(step, name):
    """Whether host node ``name`` or the ops that cut its window (its data inputs and theirs: the slice and its
    begin/end constants, where grappler moves the control input) wait on a control input: the wait for the
    newest part of the concatenation. A ``_Recv``'s link to its ``_Send`` does not count."""
    nodes, frontier = {name}, [name]
    for _ in range(2):
        frontier = [parent for node in frontier for tensor, parent in step.parents.get(node, [])
                    if tensor is not None and parent in step.nodes]
        nodes.update(frontier)
    return any(tensor is None for node in nodes if step.nodes[node].op != "_Recv"
               for tensor, _ in step.parents.get(node, []))


def counts(model, x, wrapped=None):
    step = eg.run_step(wrapped or model, x, None)
    plan = getattr(wrapped, "lms_plan", None) if wrapped is not None else None
    return {
        "offloaded_calls": sum(e.offloaded for e in plan) if plan else 0,
        "swap_out_sources": len(step.swap_out_sources),
        "device_resident_reads": sorted(step.device_resident_reads(ACTIVATION_BYTES)),
        "bypassed": sorted(step.bypassed(ACTIVATION_BYTES)),
        "transfers_back": len(step.transfers_back(ACTIVATION_BYTES)),
        # A slab forward reads a concatenation's older part (a U-Net skip) from its host copy on purpose: those
        # windows ("_fwd_rows") are gated on the newest part instead of the backward pass (forward_windows).
        "ungated": sorted(src for _, src in step.ungated_transfers(ACTIVATION_BYTES) if "_fwd_rows" not in src),
        "forward_windows": sorted(src for _, src in step.transfers_back(ACTIVATION_BYTES) if "_fwd_rows" in src),
        "forward_windows_without_gate": sorted(
            src for _, src in step.transfers_back(ACTIVATION_BYTES) if "_fwd_rows" in src and not _gated(step, src)),
        # host copies sent back whole although larger than two slabs (a window is a slab plus halo rows)
        "oversized_back": sorted(src for _, src in step.transfers_back(ACTIVATION_BYTES)
                                 if (step.tensor_info(f"{src}:0") or eg.Tensor("", (), 0)).nbytes > 2 * SLAB_BYTES),
        "slab_windows_back": sum("_rows" in src for _, src in step.transfers_back(ACTIVATION_BYTES)),
        # slices of an upstream gradient in the backward on the compute device, and those that wait on a control
        # input of their own (the slab before: slabs.backward's gate), as grappler left them
        **dict(zip(("backward_gradient_slices", "backward_gradient_slices_gated"), _gradient_slices(step))),
        **dict(zip(("reader_gates", "reader_gates_waiting"), _reader_gates(step))),
    }


def _gradient_slices(step) -> tuple:
    """(slices, gated slices): StridedSlice nodes of the backward on the compute device that cut a tensor
    made in the backward (an upstream gradient), and how many of them have a control input themselves."""
    sliced = [name for name, node in step.nodes.items()
              if node.op == "StridedSlice" and name in step.backward and step.device[name] == eg.COMPUTE
              and any(parent in step.backward for tensor, parent in step.parents.get(name, [])[:1]
                      if tensor is not None)]
    gated = [name for name in sliced if any(tensor is None for tensor, _ in step.parents.get(name, []))]
    return len(sliced), len(gated)


def _reader_gates(step) -> tuple:
    """(reader gates, those that wait for a gradient): the ``EnsureShape`` nodes that
    ``recomputed_copies.when_reader_runs`` puts between a reader's prefetched windows and what is recomputed from
    them, as grappler left them, and how many have a control input from a node of the backward (the reader's
    gradient: grappler removes the arrival marker and moves the edge to the op that made the gradient)."""
    gates = [name for name in step.nodes if recomputed_copies.READER_GATE in name.rsplit("/", 1)[-1]]
    waiting = [name for name in gates
               if any(tensor is None and parent in step.backward for tensor, parent in step.parents.get(name, []))]
    return len(gates), len(waiting)


def run_cases():
    results = {}
    rng = np.random.default_rng(0)
    for name, (build, shape) in MODELS.items():
        x = rng.random(shape).astype("float32")
        with tf.device(eg.COMPUTE):
            model = build()
        results[f"{name}/plain"] = counts(model, x)
        for config_name, kwargs in CONFIGS.items():
            with tf.device(eg.COMPUTE):
                wrapped = keras_lms.wrap(model, **kwargs)
            results[f"{name}/{config_name}"] = counts(model, x, wrapped)
        for config_name, kwargs in SLAB_CONFIGS.items() if name in SLAB_MODELS else ():
            with tf.device(eg.COMPUTE):
                wrapped = keras_lms.wrap(model, **kwargs)
            results[f"{name}/{config_name}"] = counts(model, x, wrapped)
        if name in SLAB_MODELS:
            with forward_windows_ungated():
                with tf.device(eg.COMPUTE):
                    wrapped = keras_lms.wrap(model, **SLAB_CONFIGS["slabs"])
                results[f"{name}/slabs_forward_ungated"] = counts(model, x, wrapped)
            with slices_gated_through_constants():
                with tf.device(eg.COMPUTE):
                    wrapped = keras_lms.wrap(model, **SLAB_CONFIGS["slabs"])
                results[f"{name}/slabs_slices_gated_through_constants"] = counts(model, x, wrapped)
        if name == "unet3d":  # (the 2D U-Net's slab plan recomputes nothing from prefetched windows)
            with recompute_not_waiting_for_its_reader():
                with tf.device(eg.COMPUTE):
                    wrapped = keras_lms.wrap(model, **SLAB_CONFIGS["slabs"])
                results[f"{name}/slabs_recompute_not_waiting"] = counts(model, x, wrapped)
        with old_mechanism():
            with tf.device(eg.COMPUTE):
                wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
            results[f"{name}/old_mechanism"] = counts(model, x, wrapped)
            with dependency_optimizer_off():
                with tf.device(eg.COMPUTE):
                    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
                results[f"{name}/old_mechanism_no_dependency_optimizer"] = counts(model, x, wrapped)
    return results


if __name__ == "__main__":
    out = run_cases()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    for case, c in out.items():
        print(f"{case:48s} offloaded={c['offloaded_calls']:3d} resident={len(c['device_resident_reads']):3d} "
              f"bypassed={len(c['bypassed']):3d} back={c['transfers_back']:3d} ungated={len(c['ungated']):3d} "
              f"oversized={len(c['oversized_back']):3d} slab windows={c['slab_windows_back']:3d}")
