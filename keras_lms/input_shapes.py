"""The sample shapes `keras_lms.largest_input` grows: where it starts, which axes grow, the step they grow by (the
model's down-sampling) and a model that takes those sizes. Apart from the search because each is a question
about the model, not about the planner."""

from __future__ import annotations

import math
import numbers

import keras

from keras_lms.report import report


def start_shape(model, input_shape) -> tuple:
    inputs = getattr(inner_model(model), "inputs", None) or []
    if len(inputs) > 1:
        raise ValueError(f"largest_input grows one input; model {model.name!r} has {len(inputs)}. Use "
                         "keras_lms.report(..., input_shape=...) at the shapes you want to compare.")
    if input_shape is None:
        own = tuple(inputs[0].shape[1:]) if inputs else ()
        if not own or any(d is None for d in own):
            raise ValueError(f"model {model.name!r} does not record a full input shape ({own or 'none'}): give "
                             "largest_input a start shape, e.g. input_shape=(64, 64, 64, 1).")
        input_shape = own
    dims = list(input_shape) if isinstance(input_shape, (list, tuple)) else None
    if not dims or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 for d in dims):
        raise ValueError("input_shape must be one sample's shape without the batch axis, a tuple of positive "
                         f"integers such as (64, 64, 64, 1); got {input_shape!r}.")
    return tuple(int(d) for d in dims)


def grown_axes(axes, rank: int) -> tuple:
    if axes is None:
        channels_first = keras.config.image_data_format() == "channels_first"
        return tuple(range(1, rank)) if channels_first and rank > 1 else tuple(range(max(rank - 1, 1)))
    values = list(axes) if isinstance(axes, (list, tuple)) else None
    if (not values or len(set(values)) != len(values)
            or any(isinstance(a, bool) or not isinstance(a, numbers.Integral) or not 0 <= a < rank for a in values)):
        raise ValueError(f"axes must be distinct sample axes from 0 to {rank - 1} (the batch axis is not one), e.g. "
                         f"axes=(0, 1, 2) for a volume's three spatial axes; got {axes!r}.")
    return tuple(sorted(int(a) for a in values))


def down_sampling(model, batch_size: int, start: tuple, axes: tuple, config) -> int:
    """The largest power of two that the model's layers divide the grown axes by (at ``start``): the start
    size over the smallest size any layer output of the input's rank has on that axis."""
    rep = report(model, batch_size, input_shape=start, config=config)
    rank = len(start) + 1
    factor = None
    for a in axes:
        sizes = [s[a + 1] for row in rep.rows for s in row["output_shape"] if len(s) == rank and s[a + 1]]
        ratio = start[a] / min(sizes) if sizes else 1
        power = 2 ** max(0, math.floor(math.log2(max(ratio, 1))))
        factor = power if factor is None else min(factor, power)
    return factor or 1


def open_sized(model, axes: tuple, config) -> tuple:
    """``(model, config)`` to probe: the model itself where its input leaves the grown axes open, else a clone
    with them open (``keras.models.clone_model``: the same layers' configs, names and dtype policies; weights do
    not matter to a plan), compiled with the model's optimizer so that its state counts as the model's. A wrapped
    model's clone is planned with its settings. Why: a model saved for one input size refuses every other, and
    it is the one a user has when asking how large it could go."""
    from keras_lms.model import LMSModel

    inner = inner_model(model)
    if isinstance(model, LMSModel) and config is None:
        config = model.lms_config
    inputs = getattr(inner, "inputs", None)
    if not inputs:  # (a subclassed model records no input: it takes what its call takes)
        return model, config
    shape = tuple(inputs[0].shape[1:])
    if max(axes) >= len(shape) or all(shape[a] is None for a in axes):  # (another rank: report's to refuse)
        return model, config
    opened = tuple(None if a in axes else d for a, d in enumerate(shape))
    try:
        clone = keras.models.clone_model(inner, input_tensors=keras.Input(opened, dtype=inputs[0].dtype))
    except Exception as err:  # (subclassed models, layers without configs: Keras' own reasons, named below)
        raise ValueError(f"model {model.name!r} takes input shape {shape} only, and cannot be rebuilt with the grown "
                         f"axes open ({type(err).__name__}: {err}). Build it on an input with those sizes left "
                         "open, e.g. keras.Input((None, None, None, 1)) for a fully convolutional 3D model.") from err
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        clone.compile(optimizer=optimizer)
    return clone, config


def inner_model(model):
    return getattr(model, "inner_model", model)
