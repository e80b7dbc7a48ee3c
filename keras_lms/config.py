"""LMSConfig: the validated settings of a wrapped model.

Validation happens here, once, so that every bad value gets one clear message naming the fix instead of
surfacing later as a cryptic failure inside a traced training step.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
import re
from typing import Any, Callable, Sequence, Union

LayerSelector = Union[str, type, Callable[[Any], bool]]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value, name: str) -> int:
    """Turn `1048576`, `"1MiB"`, `"6GiB"` or `"500MB"` into a byte count (int >= 0); `name` is used in errors."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = operator.index(value)  # numpy / other integer-likes count as integers
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"{name} must be a non-negative integer number of bytes or a size string like '6GiB'; "
            f"got {value!r} of type {type(value).__name__}."
        )
    if isinstance(value, int):
        if value < 0:
            hint = {"min_bytes": " Use 0 to offload every eligible tensor.", "slab_bytes": " Use 0 to turn slabs off."}
            raise ValueError(f"{name} must be >= 0 bytes; got {value}.{hint.get(name, '')}")
        return value
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{name}={value!r} is not a size. Write an integer number of bytes or a number with a unit, "
            "e.g. '512MiB', '6GiB' or '1.5GB'."
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. `format_bytes(3 << 20) == '3.0 MiB'`."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _non_negative_int(value, name: str, hint: str) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = operator.index(value)  # numpy / other integer-likes count as integers
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a non-negative integer; got {value!r} of type {type(value).__name__}. {hint}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}. {hint}")
    return value


_SELECTOR_KINDS = "layer names (str), layer classes (e.g. keras.layers.Conv2D), or predicates layer -> bool"


def _selectors(value, name: str):
    if value is None:
        return None
    items = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
    if not items:
        if name == "include":
            raise ValueError(
                "include=[] selects no layer, so nothing would be offloaded. Use include=None (the default) to "
                f"consider every layer, or list what to offload: {_SELECTOR_KINDS}."
            )
        return None  # exclude=[] excludes nothing
    for item in items:
        layer_like = hasattr(item, "stateless_call") and not isinstance(item, type)
        if layer_like:
            raise TypeError(
                f"{name} entries must be {_SELECTOR_KINDS}; got the layer object {getattr(item, 'name', item)!r}. "
                f"Pass its name instead: {name}=[{getattr(item, 'name', '...')!r}]."
            )
        if not (isinstance(item, (str, type)) or callable(item)):
            raise TypeError(
                f"{name} entries must be {_SELECTOR_KINDS}; got {item!r} of type {type(item).__name__}. "
                "Layer indices are not accepted: use model.layers[i].name."
            )
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class LMSConfig:
    """The validated settings of a wrapped model: what goes to host memory, and when it comes back.

    `keras_lms.wrap(model, **settings)` builds one from its keyword arguments; build it yourself to keep one set
    of settings for several models, or to pass it to `keras_lms.report`. Every field is checked when the config
    is created, so a bad value fails here with a message naming the fix, not later inside a traced training
    step. The config is frozen (use `dataclasses.replace(config, ...)` for a changed copy) and is saved with
    the wrapped model (`LMSModel.get_config()`).

    Args:
        min_bytes: layer inputs smaller than this (bytes per training step) stay on the device. An int, or a
            size string such as `"1MiB"`, `"500MB"` or `"6GiB"`. `0` offloads every eligible tensor.
            Defaults to `1 << 20` (1 MiB).
        keep_last: the last `keep_last` layer calls of the forward pass keep their inputs on the device: their
            backward runs right after the forward, so a round trip to the host would only cost time. `0` keeps
            none. Defaults to `1`.
        include: which layers may be offloaded: `None` (every layer), or a list of layer names, layer
            classes (e.g. `keras.layers.Conv2D`) and predicates (`layer -> bool`). A name may be a nested
            model's name, meaning all its layers. An empty list is refused (it would offload nothing).
            Defaults to `None`.
        exclude: layers never offloaded, in the same forms as `include`; it wins over `include`. `None` or
            `[]` excludes nothing. Defaults to `None`.
        host_device: the device that holds offloaded tensors: a CPU device that exists, e.g. `"/CPU:0"`.
            Defaults to `"/CPU:0"`.
        prefetch: the copy back to the device starts `prefetch` layer calls before the backward pass needs the
            tensor; `0` starts it when the layer's gradient arrives. Defaults to `1`.
        device_budget: `None` (offload by the rules above), or bytes / a size string such as `"6GiB"`: the
            planner then offloads only what the predicted training step needs to fit (largest, longest-lived
            tensors first; nothing when it fits anyway). Defaults to `None`.
        lean_normalization: torch (and JAX, below): the backward of an offloaded BatchNormalization call (training,
            batch statistics) reuses the forward's saved mean and variance and runs the operations autograd
            would run for Keras' ops, on slabs of the input, instead of recomputing the layer: no input-sized
            float32 temporaries, no recompute. The forward pass, its output and the moving statistics are
            Keras' own either way; the gradient is bit-identical up to 16384 positions per call and equal up to
            rounding beyond (docs/design.md, "Lean normalisation (torch)"). `False` recomputes instead. On
            TensorFlow, BatchNormalization is made lean by `slab_bytes`. On JAX the call's backward keeps only its
            input (in its own dtype) and scale, and evaluates the batch-norm gradient from them; `False` keeps
            what JAX's own differentiation keeps (float32 input-sized residuals under mixed precision). Defaults
            to `True`.
        slab_bytes: offloaded calls of spatially local layers (stride-1 `"same"` convolutions,
            BatchNormalization, element-wise activations) whose input is larger than this are computed in slabs
            along the first spatial axis, forward and backward, with halos for the convolutions: only
            slab-sized temporaries (layout copies, float32 BatchNorm intermediates, swapped-in windows) exist on
            the device, and a convolution over a channel concatenation (a U-Net decoder) reads the
            concatenated tensors without building the concatenation. Bytes or a size string; `0` turns slabs
            off. The input gradient is exact; weight gradients and batch statistics are sums over slabs (equal
            up to summation order; docs/design.md, "Slabs"). On JAX such convolutions (with a linear activation)
            run forward and backward in windows of rows, and so do the backwards of BatchNormalization (lean) and
            transposed convolutions with kernel == strides (and the latter's forward) (XLA compiles the step;
            docs/design.md, "The JAX back end"). Defaults to `256 << 20` (256 MiB).
        device_profile: `None`, a built-in device profile's name (`"h100-pcie5"`, `"h200-pcie5"`, `"gh200"`,
            `"a100-pcie4"`), a profile JSON file (`keras-lms calibrate` writes one) or a
            `keras_lms.DeviceProfile`. The planner then decides, per tensor the back end can recompute
            (TensorFlow: windows of slab-computed calls; torch: the output of a BatchNormalization with batch
            statistics or of the activation after one), whether to copy it or recompute it where it is read,
            from the predicted step on that device (and, with `device_budget`, only while the plan fits). With
            `device_budget` it also picks, among the slab sizes that fit the budget, the one with the shortest
            predicted step (larger slabs recompute fewer halos and bring fewer windows back) instead of the
            largest of `slab_bytes` and its halvings that fits. Stored as the loaded profile. Defaults to
            `None`.

    Raises:
        TypeError: a setting has the wrong type (e.g. `keep_last=1.5`, a layer object instead of its name in
            `include`, `host_device=None`).
        ValueError: a setting has an impossible value (e.g. `min_bytes=-1`, `"6 parsecs"`, `include=[]`,
            `device_budget=0`, an empty `host_device`, an unknown `device_profile`).

    Example:

    ```python
    import dataclasses

    import keras
    import keras_lms

    config = keras_lms.LMSConfig(min_bytes="64KiB", keep_last=0, exclude=[keras.layers.Dense])
    print(config.min_bytes)                       # 65536
    smaller = dataclasses.replace(config, min_bytes=0)

    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(4, 3),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    wrapped = keras_lms.wrap(model, config=smaller)
    assert wrapped.lms_config is smaller
    ```
    """

    min_bytes: int = 1 << 20
    keep_last: int = 1
    include: Sequence[LayerSelector] | None = None
    exclude: Sequence[LayerSelector] | None = None
    host_device: str = "/CPU:0"
    prefetch: int = 1
    device_budget: int | None = None
    lean_normalization: bool = True
    slab_bytes: int = 256 << 20
    device_profile: Any = None

    def __post_init__(self):
        def set_(key, value):  # the dataclass is frozen: normalised values are written once, here
            object.__setattr__(self, key, value)

        set_("min_bytes", parse_bytes(self.min_bytes, "min_bytes"))
        set_("keep_last", _non_negative_int(self.keep_last, "keep_last", "Use 0 to offload the last layers too."))
        set_("prefetch", _non_negative_int(self.prefetch, "prefetch", "Use 0 to swap in when the gradient arrives."))
        set_("include", _selectors(self.include, "include"))
        set_("exclude", _selectors(self.exclude, "exclude"))
        set_("slab_bytes", parse_bytes(self.slab_bytes, "slab_bytes"))
        if not isinstance(self.lean_normalization, bool):
            raise TypeError(f"lean_normalization must be True or False; got {self.lean_normalization!r}.")
        if not isinstance(self.host_device, str):
            raise TypeError(f"host_device must be a device string such as '/CPU:0'; got {self.host_device!r}.")
        if not self.host_device.strip():
            raise ValueError(f"host_device must name a CPU device such as '/CPU:0'; got {self.host_device!r}.")
        if self.device_budget is not None:
            set_("device_budget", parse_bytes(self.device_budget, "device_budget"))
            if self.device_budget == 0:
                raise ValueError("device_budget must be > 0 bytes; use None to disable the planner.")
        if self.device_profile is not None:
            from keras_lms.planning.device_profile import load_profile, profile_from_dict

            profile = self.device_profile
            set_("device_profile", profile_from_dict(profile, "device_profile") if isinstance(profile, dict)
                 else load_profile(profile))

    def to_dict(self) -> dict:
        """The settings as a JSON-friendly dict (what `LMSModel.get_config()` saves).

        Returns:
            A dict with one key per field; layer classes in `include`/`exclude` become `{"class_name": ...}`.

        Raises:
            ValueError: `include` or `exclude` contains a predicate, which cannot be saved.
        """
        out = dataclasses.asdict(self)
        for key in ("include", "exclude"):
            items = out[key]
            if items is None:
                continue
            serial = []
            for item in items:
                if isinstance(item, str):
                    serial.append(item)
                elif isinstance(item, type):
                    serial.append({"class_name": item.__name__})
                else:
                    raise ValueError(
                        f"Cannot save a wrapped model whose {key} contains a predicate ({item!r}): use layer names "
                        "or classes, or save the plain model with keras_lms.unwrap(wrapped).save(...)."
                    )
            out[key] = serial
        return out

    @classmethod
    def from_dict(cls, data: dict) -> LMSConfig:
        """The inverse of `to_dict`: layer class names are looked up in `keras.layers` and Keras' registry."""
        data = dict(data)
        for key in ("include", "exclude"):
            if data.get(key) is not None:
                data[key] = tuple(_class_by_name(i["class_name"]) if isinstance(i, dict) else i for i in data[key])
        return cls(**data)


def _class_by_name(name: str) -> type:
    import keras

    cls = getattr(keras.layers, name, None)
    if cls is None:
        cls = keras.saving.get_registered_object(name)
    if cls is None:
        raise ValueError(f"Unknown layer class {name!r} in a saved keras-lms include/exclude list.")
    return cls
