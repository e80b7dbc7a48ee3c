"""What torch's eager kernels move per layer call, counted where they run, against the step-time model's facts.

``TorchFacts.eager_bytes`` says how many bytes Keras' torch ops read and write for one call of a BatchNormalization,
a Dropout, a max pooling or a channels-last convolution (element-wise passes, and the strided layout copies around
convolutions and pooling). Those numbers come from Keras' own code: they change when Keras changes how it calls
torch. This counts them in the ops that run: a ``TorchDispatchMode`` sees every aten op of one forward and one
backward of the layer, and sums the bytes its tensors read and write (an in-place op's destination once; views and
allocations move nothing). It fails loudly when Keras changes the ops, and the control shows the count sees the
difference between Keras' BatchNormalization and the generic one-read-one-write count.
"""

import collections
import math

import keras
import pytest

from keras_lms.planning.call_costs import call_cost
from tests.planning.calls import raw_call

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from keras_lms.offload.torch.step_memory import TorchFacts  # noqa: E402

FREE = {  # views, metadata and allocations: no bytes move
    "view", "_unsafe_view", "permute", "expand", "t", "transpose", "alias", "as_strided", "slice", "select",
    "unsqueeze", "squeeze", "detach", "_reshape_alias", "split", "split_with_sizes", "unbind", "empty",
    "empty_strided", "new_empty_strided", "empty_like", "lift_fresh", "scalar_tensor", "_to_copy", "zeros",
    "ones", "full", "new_zeros", "new_ones", "zeros_like", "ones_like",
}
KERNELS = {"convolution", "convolution_backward"}  # counted in FLOPs by the model, not bytes
LAYOUT = {"clone", "copy_", "contiguous"}  # copies: a convolution's or a pooling's layout changes


class ByteCensus(TorchDispatchMode):
    """Bytes read plus written by the aten ops that run, by kind (element-wise or layout copy)."""

    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in FREE or name in KERNELS:
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        written = {t.untyped_storage().data_ptr() for t in outs}
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
               and t.untyped_storage().data_ptr() not in written]  # an in-place op's destination: written once
        moved = sum(t.numel() * t.element_size() for t in ins + outs)
        self.bytes["layout" if name in LAYOUT and _changes_layout(args, outs) else "elementwise"] += moved
        self.ops[name] += 1
        return out


def _changes_layout(args, outs) -> bool:
    """A copy whose source and destination strides differ (a permute made contiguous, a channels-last copy),
    as opposed to a copy of the same layout, which runs at the element-wise rate."""
    tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
    source = tensors[-1]  # clone(x) / contiguous(x): x; copy_(dst, src): src
    return any(source.stride() != out.stride() for out in outs)


def census(layer, shapes):
    """(forward, backward) censuses of one training call of ``layer`` on inputs of ``shapes``, and its RawCall."""
    xs = [torch.randn(*shape, requires_grad=True) for shape in shapes]
    args = xs[0] if len(xs) == 1 else xs
    layer(args)  # build
    kwargs = {"training": True} if isinstance(layer, (keras.layers.BatchNormalization, keras.layers.Dropout)) else {}
    with ByteCensus() as forward:
        y = layer(args, **kwargs)
    with ByteCensus() as backward:
        y.backward(torch.ones_like(y))
    call = raw_call(layer, [(f"x{i}", tuple(s[1:])) for i, s in enumerate(shapes)], [("y", tuple(y.shape[1:]))])
    return forward, backward, call


E = 16
CASES = {
    "batch_norm": (lambda: keras.layers.BatchNormalization(), [(1, E, E, E, 16)]),
    "dropout": (lambda: keras.layers.Dropout(0.2), [(1, E, E, E, 16)]),
    "max_pool": (lambda: keras.layers.MaxPooling3D(2), [(1, E, E, E, 16)]),
    "conv_16_16": (lambda: keras.layers.Conv3D(16, 3, padding="same"), [(1, E, E, E, 16)]),
    "conv_16_32_relu": (lambda: keras.layers.Conv3D(32, 3, padding="same", activation="relu"), [(1, E, E, E, 16)]),
    "conv_1_16": (lambda: keras.layers.Conv3D(16, 3, padding="same"), [(1, E, E, E, 1)]),
    "conv_1x1_sigmoid": (lambda: keras.layers.Conv3D(1, 1, activation="sigmoid"), [(1, E, E, E, 16)]),
    "conv2d_no_bias": (lambda: keras.layers.Conv2D(8, 3, padding="same", use_bias=False), [(2, 32, 32, 8)]),
    "transposed": (lambda: keras.layers.Conv3DTranspose(16, 2, strides=2), [(1, E // 2, E // 2, E // 2, 32)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_facts_count_what_keras_torch_ops_move(case):
    make, shapes = CASES[case]
    layer = make()
    forward, backward, call = census(layer, shapes)
    cost = call_cost(call, batch_size=shapes[0][0], facts=TorchFacts())
    counted = {"forward": cost.forward_bytes, "backward": cost.backward_bytes,
               "forward layout": cost.forward_layout_bytes, "backward layout": cost.backward_layout_bytes}
    measured = {"forward": forward.bytes["elementwise"], "backward": backward.bytes["elementwise"],
                "forward layout": forward.bytes["layout"], "backward layout": backward.bytes["layout"]}
    problem = (f"{case}: facts {counted}, torch ran {measured} (ops: forward {dict(forward.ops)}, backward "
               f"{dict(backward.ops)}). Keras' torch ops changed: update keras_lms/offload/torch/step_memory.py "
               "eager_bytes.")
    slack = 512  # per-channel statistics and scalars the facts leave out
    for kind in ("forward", "backward", "forward layout"):
        assert counted[kind] == pytest.approx(measured[kind], rel=0.10, abs=slack), problem
    # A convolution's input gradient: cuDNN writes it in the input's (channels-last) layout; the CPU's 3D and
    # transposed kernels write it (and a transposed kernel's gradient) channels-first and torch copies it back.
    # The facts count the GPU's.
    cpu_copy = 0
    if case.startswith(("conv_", "transposed")):
        cpu_copy = 2 * sum(math.prod(s) * 4 for s in shapes) + 2 * math.prod(layer.kernel.shape) * 4
    assert counted["backward layout"] - slack <= measured["backward layout"] <= counted["backward layout"] + cpu_copy \
        + slack, problem


def test_the_census_tells_keras_batch_norm_from_the_generic_count():
    # the control: the generic count (one read of the input per pass and one write) is far from what runs
    forward, backward, call = census(keras.layers.BatchNormalization(), [(1, E, E, E, 16)])
    generic = call_cost(call)
    assert forward.bytes["elementwise"] + forward.bytes["layout"] > 2.5 * generic.forward_bytes
    assert backward.bytes["elementwise"] > 4 * generic.backward_bytes
