"""What the TensorFlow step context keeps of one intercepted layer call (``CallRecord``), and the host op that
holds a tensor on the host (``host_op``), named so that tests find the transfers in the executed graph."""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from keras_lms.offload.tensorflow.slab_plan import SlabPlan

SWAP_OUT_NAME = "lms_swap_out"
SWAP_IN_NAME = "lms_swap_in"
GRAD_ARRIVAL_NAME = "lms_grad_arrival"
HOST_STAGE_SUFFIX = "host"


def host_op(tensor, name):
    """The op that holds a tensor on the host: ``EnsureShape`` (returns its input buffer, never copies).

    It must not be ``Identity``/``IdentityN``/``NoOp``: grappler's dependency optimiser removes those when that
    lowers the number of device crossings, and a host Identity between device ops is exactly that case.
    ``tests/offload/tensorflow/test_executed_graph.py`` checks on the partitioned graph TensorFlow runs that the
    ops survive.
    """
    return tf.raw_ops.EnsureShape(input=tensor, shape=tensor.shape, name=name)


@dataclasses.dataclass
class CallRecord:
    """One intercepted layer call whose backward we build: everything that backward needs, and nothing more.

    The gradient function closes over this record, so it holds no forward activation other than the host
    copies and the inputs deliberately kept on the device (in eager mode anything else would stay alive).
    """

    index: int
    unit: object
    original: object  # the unit's unpatched call
    template: object  # (args, kwargs) with the tensors blanked (common.template)
    positions: list
    hosts: list  # per input tensor: its host copy, or None when it stays on the device
    kept: list  # per input tensor: the device tensor when it stays there, else None
    masks: list
    trainable: list  # the trainable values the forward used (also inputs of the custom gradient)
    snapshot: list  # non-trainable values before the forward (same Dropout masks / BatchNorm statistics)
    compute_device: str | None
    kept_call: bool  # nothing offloaded: a kept call routed here because its gradient reads its own output
    autocast: str | None = None  # the autocast dtype of the forward call, re-entered by the recompute
    marker: tf.Tensor | None = None  # this call's gradient arrival (the trigger of prefetched swap-ins)
    moments: list = dataclasses.field(default_factory=list)  # BatchNorm (mean, variance) per _moments call
    n_outputs: int = 0
    output_key: object = None  # ref of the (first) output, to find the host copy a consumer made of it
    slabs: SlabPlan | None = None  # computed slab by slab (slabs), or None: whole
    concatenated: bool = False  # the inputs are the parts of a channel concatenation the layer reads
    sources: list = dataclasses.field(default_factory=list)  # refs of the forward input tensors (slab forward)
    moment_count: tf.Tensor | None = None  # values per channel behind a slab BatchNorm's statistics
    chain: tuple | None = None  # (BatchNorm record, activation record): the input is recomputed (slab_chains)
    fused_gradient: tf.Tensor | None = None  # an activation's input gradient, taken in its consumer's backward
    fused_moments: object = None  # a BatchNorm's first-pass totals (TotalMoments), taken in the chain's conv
    upsampling: tuple | None = None  # (scale, output rows): an up-sampler whose windows can be recomputed
    sweep: tuple | None = None  # (SweepRun, role, unit number): differentiated in a level sweep (sweep_calls)
    pooling_fold: tuple | None = None  # (pooling record, its output gradient, stride): added in this backward
