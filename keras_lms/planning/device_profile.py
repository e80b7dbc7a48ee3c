"""Device profiles: how fast a GPU computes and how fast its host link copies, as data with their sources.

A plan's step time depends on two machines' worth of numbers: the device's compute rates (convolutions and
matmuls per dtype, HBM bandwidth for element-wise work) and the host link's bandwidth in each direction, alone
and with both directions busy (PCIe copies slow each other down: nvbandwidth #53). They are data, not code:
the built-in profiles are JSON files in `keras_lms/planning/profiles/`, each number with its source beside it,
and `keras-lms calibrate` measures the same fields on the user's GPU and writes a file that `wrap` and
`report` accept (`device_profile="h100-pcie5"` or `device_profile="my_gpu.json"`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from importlib import resources

RATE_FIELDS = ("elementwise_bytes_per_second", "host_to_device_bytes_per_second", "device_to_host_bytes_per_second",
               "host_to_device_concurrent_bytes_per_second", "device_to_host_concurrent_bytes_per_second")
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """A device and its host link, for the step-time model: what `keras_lms.report(..., device_profile=)` and
    `keras-lms report --device NAME` / `--profile FILE` predict step times with.

    The built-in profiles (`keras_lms.planning.device_profile.builtin_profiles()`: `a100-pcie4`, `h100-pcie5`,
    `h200-pcie5`, `gh200`) give each number's source in `sources`; `keras-lms calibrate --out FILE` measures
    one on your GPU (torch), and `DeviceProfile.load(FILE)` reads it back.

    Args:
        name: a short name (`"h100-pcie5"`).
        description: what machine it describes.
        flops_per_second: achieved rate of convolutions and matmuls per compute dtype (`"float32"` means
            TF32 tensor cores where the framework uses them).
        convolution_flops_per_second: optional, per compute dtype, the convolution rate by channel count
            (`{"float32": {"16": 21.5e12, "32": 54.3e12, "64": 119.7e12}}`): small channel counts run far below
            a GPU's peak (an H200 ran Conv3D at 16 channels 5.6x slower than at 64). A convolution is charged at
            the rate of its larger channel count, interpolated log-log between the measured counts and held
            at the ends; without a table (or for its missing dtypes) at `flops_per_second`.
        layout_copy_bytes_per_second: optional, bytes read plus written per second by strided layout copies
            (Keras on torch copies a channels-last convolution's input to channels-first and back); 0 means
            the element-wise rate. Such copies ran at ~1 TB/s on an H200 whose element-wise rate is 3.75.
        elementwise_bytes_per_second: bytes read plus written per second by memory-bound kernels
            (normalisation, activations, pooling, additions, concatenations).
        host_to_device_bytes_per_second / device_to_host_bytes_per_second: pinned copies over the host link,
            one direction at a time.
        host_to_device_concurrent_bytes_per_second / device_to_host_concurrent_bytes_per_second: the same
            while the other direction copies too.
        memory_bytes: the device's memory (informational; `device_budget` is what plans are made for).
        sources: field name -> where its number comes from.

    Raises:
        ValueError: a rate is not a positive number, or `flops_per_second` gives no `"float32"` rate or an
            unknown dtype.

    Example:

    ```python
    import keras_lms

    h100 = keras_lms.DeviceProfile.load("h100-pcie5")
    print(h100.host_to_device_bytes_per_second / 1e9, "GB/s:", h100.sources["host_to_device_bytes_per_second"])
    slower = keras_lms.DeviceProfile(**{**h100.to_dict(), "name": "h100-x8",
                                        "host_to_device_bytes_per_second": 17e9})
    assert slower.flops_rate("float16") == 200e12
    ```
    """

    name: str
    description: str
    flops_per_second: dict
    elementwise_bytes_per_second: float
    host_to_device_bytes_per_second: float
    device_to_host_bytes_per_second: float
    host_to_device_concurrent_bytes_per_second: float
    device_to_host_concurrent_bytes_per_second: float
    memory_bytes: int = 0
    sources: dict = dataclasses.field(default_factory=dict)
    convolution_flops_per_second: dict = dataclasses.field(default_factory=dict)
    layout_copy_bytes_per_second: float = 0.0

    def __post_init__(self):
        problems = []
        if not isinstance(self.convolution_flops_per_second, dict):
            problems.append("convolution_flops_per_second must map compute dtypes to {channels: FLOP/s}")
        else:
            for dtype, table in self.convolution_flops_per_second.items():
                if (dtype not in COMPUTE_DTYPES or not isinstance(table, dict) or not table
                        or not all(_channel_count(c) and _positive(r) for c, r in table.items())):
                    problems.append(f"convolution_flops_per_second[{dtype!r}] = {table!r} (dtypes: "
                                    f"{', '.join(COMPUTE_DTYPES)}; a non-empty {{channels: FLOP/s}} table with "
                                    "positive integer channel counts and positive rates)")
        if not isinstance(self.flops_per_second, dict) or "float32" not in self.flops_per_second:
            problems.append("flops_per_second must map compute dtypes to FLOP/s and give at least 'float32'")
        else:
            for dtype, rate in self.flops_per_second.items():
                if dtype not in COMPUTE_DTYPES or not _positive(rate):
                    problems.append(f"flops_per_second[{dtype!r}] = {rate!r} (dtypes: {', '.join(COMPUTE_DTYPES)}; "
                                    "rates: positive numbers)")
        if self.layout_copy_bytes_per_second != 0 and not _positive(self.layout_copy_bytes_per_second):
            problems.append(f"layout_copy_bytes_per_second = {self.layout_copy_bytes_per_second!r} is not a positive "
                            "number (or 0: the element-wise rate)")
        for field in RATE_FIELDS:
            if not _positive(getattr(self, field)):
                problems.append(f"{field} = {getattr(self, field)!r} is not a positive number")
        if problems:
            raise ValueError(f"device profile {self.name!r} is not valid: " + "; ".join(problems) + ". Fix the "
                             "profile file, or measure one with `keras-lms calibrate --out profile.json`.")

    def flops_rate(self, dtype: str, channels: int = 0) -> float:
        """FLOP/s for convolutions and matmuls computed in `dtype` (float32 for other dtypes); with `channels`
        (a convolution's larger channel count) from `convolution_flops_per_second` where it has `dtype`."""
        table = self.convolution_flops_per_second.get(dtype) if channels else None
        if not table:
            return float(self.flops_per_second.get(dtype, self.flops_per_second["float32"]))
        points = sorted((int(c), float(r)) for c, r in table.items())
        if channels <= points[0][0]:
            return points[0][1]
        for (c0, r0), (c1, r1) in zip(points, points[1:]):
            if channels <= c1:  # log-log between the two measured channel counts
                f = math.log(channels / c0) / math.log(c1 / c0)
                return math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
        return points[-1][1]

    def layout_copy_rate(self) -> float:
        """Bytes/s of strided layout copies: `layout_copy_bytes_per_second`, or the element-wise rate."""
        return float(self.layout_copy_bytes_per_second or self.elementwise_bytes_per_second)

    def to_dict(self) -> dict:
        """The profile's fields, as `save` writes them."""
        return dataclasses.asdict(self)

    @staticmethod
    def load(profile) -> "DeviceProfile":
        """A profile from a built-in name, a JSON file's path, or a profile (`load_profile`)."""
        return load_profile(profile)

    def save(self, path) -> str:
        """Write the profile as JSON (the format `load_profile` reads); returns `path`."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")
        return path


def _positive(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _channel_count(value) -> bool:
    try:
        return int(value) > 0 and str(int(value)) == str(value).strip()
    except (TypeError, ValueError):
        return False


def builtin_profiles() -> list:
    """Names of the profiles that ship with keras-lms (`keras_lms/planning/profiles/*.json`)."""
    folder = resources.files("keras_lms.planning") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def profile_from_dict(data: dict, origin: str = "profile") -> DeviceProfile:
    """A `DeviceProfile` from a JSON object; unknown or missing fields are refused with their names."""
    if not isinstance(data, dict):
        raise ValueError(f"{origin} does not hold a JSON object with a device profile's fields.")
    names = {f.name for f in dataclasses.fields(DeviceProfile)}
    required = {f.name for f in dataclasses.fields(DeviceProfile)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown, missing = sorted(set(data) - names), sorted(required - set(data))
    if unknown or missing:
        raise ValueError(f"{origin} is not a device profile: " + "; ".join(
            ([f"unknown field(s) {unknown}"] if unknown else []) + ([f"missing field(s) {missing}"] if missing else []))
            + f". A profile has the fields {sorted(names)}; `keras-lms calibrate --out FILE` writes one.")
    return DeviceProfile(**data)


def load_profile(profile) -> DeviceProfile:
    """A `DeviceProfile` from a built-in name (`"h100-pcie5"`), a JSON file's path, or a profile itself."""
    if isinstance(profile, DeviceProfile):
        return profile
    if not isinstance(profile, (str, os.PathLike)):
        raise TypeError(f"device_profile must be a built-in profile name ({', '.join(builtin_profiles())}), a path "
                        f"to a profile JSON file or a keras_lms.DeviceProfile; got {type(profile).__name__}.")
    text = os.fspath(profile)
    if text in builtin_profiles():
        source = resources.files("keras_lms.planning") / "profiles" / f"{text}.json"
        return profile_from_dict(json.loads(source.read_text()), f"built-in profile {text!r}")
    if not os.path.isfile(text):
        raise ValueError(f"device_profile {text!r} is neither a built-in profile ({', '.join(builtin_profiles())}) "
                         "nor a profile file. Give one of those names, or a file written by `keras-lms calibrate`.")
    try:
        with open(text) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"device profile file {text!r} is not valid JSON ({err}); `keras-lms calibrate --out "
                         f"{text}` writes a valid one.") from err
    return profile_from_dict(data, f"device profile file {text!r}")
