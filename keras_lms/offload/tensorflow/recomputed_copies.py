"""Tensors recomputed instead of copied (``planning.recompute``): the TensorFlow step context's side.

When the plan recomputes call ``p``'s output, the consumers' ``swap_out`` makes no host copy: it hands out a
``RecomputedCopy`` of ``p``'s record instead, which every reader of host windows accepts in place of a host
tensor (``SlabCalls._host_window``). Rows ``[a, b)`` are then ``p`` run again, on the device, on rows
``[a - h, b + h)`` of its own inputs (cut from their host copies on the host, gated like any window, or
recomputed the same way, recursively, or through a fused chain), and cropped: exactly what ``p``'s slab forward
computed for those rows, with the forward's batch statistics and the snapshot of the weights, so Dropout masks
(never recomputed here: Dropout is not local) and BatchNorm statistics are the forward's own. A reader that
needs the whole tensor (a call the plan did not expect to compute in slabs) gets all rows recomputed.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from keras_lms import _keras_adapter as adapter
from keras_lms.offload import common
from keras_lms.offload.tensorflow import slabs
from keras_lms.offload.tensorflow.devices import on_device


@dataclasses.dataclass(frozen=True)
class RecomputedCopy:
    """Stands in for the host copy of ``producer``'s (a ``CallRecord``) output: its windows are recomputed."""

    producer: object

    @property
    def length(self) -> int:
        if self.producer.upsampling is not None:
            return self.producer.upsampling[1]
        return self.producer.slabs.length


def usable_producer(record) -> bool:
    """Whether a record's output can be recomputed in windows (what planning assumed; else it is copied)."""
    if record is not None and record.upsampling is not None:  # (never slab-computed: StepContext._upsampling)
        return (record.n_outputs == 1 and len(record.hosts) == 1
                and (record.hosts[0] is not None or record.kept[0] is not None))
    plan = record.slabs if record is not None else None
    if plan is None or plan.stride != 1 or record.n_outputs != 1:
        return False
    if plan.moments and (len(record.moments) != 1 or record.moment_count is None):
        return False
    if record.chain is not None and record.chain[1] is None:
        return False
    return all(host is not None or kept is not None for host, kept in zip(record.hosts, record.kept)) or (
        record.chain is not None)


READER_GATE = "lms_reader_gate"  # the executed-graph test finds the gates by this name
GATED_ON_READER = True  # off: the gates are made without their control input (the control of that test)


def when_reader_runs(windows, reader):
    """``windows`` gated on ``reader``'s gradient arrival (``CallRecord.marker``), so what is recomputed from
    them is recomputed in the reader's backward: their copies back still land early (prefetch), but the
    recompute no longer runs as soon as they land (also a fused chain's BatchNorm and activation,
    ``SlabCalls._chain_input_window``). Seen in the executed graph of the 384^3 float32 3D U-Net planned for
    20 GiB: a level-1 convolution's first chain windows (BatchNorm and ReLU recomputed on them, 2.1 GiB with
    their cropped pieces) were computed while the level above's sweep ran, and held through it. The gate is an
    ``EnsureShape`` (no copy), which grappler keeps with its control input: an ``Identity`` it would remove and
    move the control input onto the readers, and the marker itself it removes too."""
    gate = getattr(reader, "marker", None)
    if gate is None or tf.executing_eagerly():
        return windows
    with on_device(reader.compute_device), slabs.gated([gate] if GATED_ON_READER else []):
        return [tf.ensure_shape(w, w.shape, name=READER_GATE) for w in windows]


class RecomputedWindows:
    """The windows of a ``RecomputedCopy`` (a mixin of ``StepContext``, next to ``SlabCalls``)."""

    def _recomputed_window(self, copy: RecomputedCopy, a: int, b: int, gates, reader, kind: str):
        """Rows [a, b) of the producer's output, recomputed on ``reader``'s device from its inputs' windows."""
        producer = copy.producer
        if producer.upsampling is not None:
            return self._upsampled_window(producer, a, b, gates, reader, kind)
        plan = producer.slabs
        lo, hi = max(0, a - plan.halo), min(plan.length, b + plan.halo)
        if producer.chain is not None:  # (its BatchNorm input window waits for the reader there)
            windows = [self._chain_input_window(producer, lo, hi, gates, reader, kind)[1]]
        else:
            windows = []
            for host, kept in zip(producer.hosts, producer.kept):
                if host is not None:
                    windows.append(self._host_window(host, lo, hi, gates, reader, kind))
                else:
                    with on_device(reader.compute_device), slabs.gated(gates):
                        windows.append(slabs.rows(kept, lo, hi))
            windows = when_reader_runs(windows, reader)
        moments = None
        if plan.moments:
            mean, variance, _ = producer.moments[0]
            moments = lambda x: (mean, variance)  # noqa: E731
        with on_device(reader.compute_device):
            if plan.exact_rows:  # slab_rows: the window padded to full width, the "valid" call gives rows [a, b)
                windows = [slabs.halo_padded(w, plan, a, b, lo, hi) for w in windows]
            outputs, _, _ = self._slab_call(producer, windows, producer.trainable, moments)
            y = tf.nest.flatten(outputs)[0]
            return y if plan.exact_rows or (lo, hi) == (a, b) else slabs.rows(y, a - lo, b - lo)

    def _upsampled_window(self, producer, a: int, b: int, gates, reader, kind: str):
        """Rows [a, b) of an up-sampler's output: the layer on its input's rows [a // s, ceil(b / s)), cropped."""
        scale = producer.upsampling[0]
        lo, hi = a // scale, -(-b // scale)
        if producer.hosts[0] is not None:
            window = self._host_window(producer.hosts[0], lo, hi, gates, reader, kind)
        else:  # kept on the device by the plan: sliced there
            with on_device(reader.compute_device), slabs.gated(gates):
                window = slabs.rows(producer.kept[0], lo, hi)
        window = when_reader_runs([window], reader)[0]
        with on_device(reader.compute_device):
            call_args, call_kwargs = common.rebuild(producer.template, producer.positions, [window])
            outputs, _, _ = adapter.run_stateless(producer.unit, producer.original, producer.trainable,
                                                  producer.snapshot, call_args, call_kwargs, producer.autocast)
            y = tf.nest.flatten(outputs)[0]
            return y if (lo * scale, hi * scale) == (a, b) else slabs.rows(y, a - lo * scale, b - lo * scale)

    def _whole_recomputed(self, copy: RecomputedCopy, gates, reader):
        """The whole recomputed tensor (a reader that does not read windows)."""
        return self._recomputed_window(copy, 0, copy.length, gates, reader, "whole")
