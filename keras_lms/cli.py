"""The `keras-lms` command: `keras-lms report MODEL.keras --batch-size N [--device h100-pcie5]`,
`keras-lms largest MODEL.keras --batch-size N --budget 16GiB` (the largest input that fits),
`keras-lms calibrate --out profile.json` (a device profile measured on this GPU) and `keras-lms info`."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys


def _fail(message: str) -> int:
    print(f"keras-lms: {message}", file=sys.stderr)
    return 2


def _parse_input_shape(text: str | None):
    if not text:
        return None
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"--input-shape {text!r} is not a shape: give one sample's dimensions as positive integers "
                         "separated by commas, without the batch axis, e.g. --input-shape 128,128,128,1.")
    return dims


def _check_writable(path: str, flag: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        why = "it is a directory" if os.path.isdir(path) else f"{directory!r} is not a writable directory"
        raise ValueError(f"{flag} {path!r} cannot be written: {why}. Give a file path in an existing, writable "
                         f"directory, e.g. {flag} report.png.")


def _load(path: str):
    import zipfile

    import keras

    import keras_lms  # noqa: F401 - registers LMSModel for loading

    if path.endswith(".keras") and not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not a readable .keras file (damaged or incompletely written: a .keras file is "
                         "a zip archive). Save the model again, or use an earlier copy.")
    try:
        return keras.models.load_model(path, compile=False)
    except (OSError, KeyError, EOFError, zipfile.BadZipFile, ValueError) as err:
        raise ValueError(f"cannot load the model in {path}: {err}. Is it a complete .keras file written by "
                         "model.save(...)?") from err


def _report(args) -> int:
    import keras_lms

    if not os.path.isfile(args.model):
        return _fail(f"no such model file: {args.model}")
    if not args.link_gbps > 0 or args.link_gbps == float("inf"):
        return _fail(f"--link-gbps must be a positive bandwidth in GB/s, e.g. --link-gbps 16; got {args.link_gbps:g}.")
    input_shape = _parse_input_shape(args.input_shape)
    if args.plot:
        _check_writable(args.plot, "--plot")
    profile = args.device or args.profile
    if profile is not None:
        from keras_lms.planning.device_profile import load_profile

        profile = load_profile(profile)  # refuse a bad profile before loading the model
    model = _load(args.model)
    rep = keras_lms.report(model, batch_size=args.batch_size, input_shape=input_shape,
                           device_budget=args.budget, link_gbps=args.link_gbps, device_profile=profile)
    if args.json:
        print(rep.to_json())
    else:
        print(rep.to_text(max_rows=args.max_rows))
    if args.plot:
        try:
            rep.plot(args.plot)
        except OSError as err:
            return _fail(f"--plot {args.plot!r} could not be written: {err}")
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _parse_axes(text: str | None):
    if not text:
        return None
    try:
        return tuple(int(a) for a in text.split(","))
    except ValueError:
        raise ValueError(f"--axes {text!r} is not a list of axes: give the sample axes that grow, separated by "
                         "commas, e.g. --axes 0,1,2 for a volume's three spatial axes.") from None


def _largest(args) -> int:
    import keras_lms

    if not os.path.isfile(args.model):
        return _fail(f"no such model file: {args.model}")
    input_shape, axes = _parse_input_shape(args.input_shape), _parse_axes(args.axes)
    profile = args.device or args.profile
    if profile is not None:
        from keras_lms.planning.device_profile import load_profile

        profile = load_profile(profile)  # refuse a bad profile before loading the model
    model = _load(args.model)

    def progress(probe):
        if not args.json:
            verdict = "fits" if probe.fits else "does not fit"
            print(f"  {'x'.join(map(str, probe.input_shape))}: {verdict}", file=sys.stderr, flush=True)

    found = keras_lms.largest_input(model, batch_size=args.batch_size, device_budget=args.budget,
                                    input_shape=input_shape, axes=axes, multiple=args.multiple,
                                    device_profile=profile, plain=not args.no_plain, on_probe=progress)
    print(json.dumps(found.to_dict(), indent=2) if args.json else found.to_text())
    return 0 if found.input_shape is not None else 1


def _installed_version(package: str):
    """The installed version of ``package``, or None (read from its metadata: nothing is imported)."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def info_dict(quiet: bool = False) -> dict:
    """Versions, Horovod build flags, devices and host RAM (what a bug report needs); ``quiet`` holds
    TensorFlow's start-up lines back when it is imported here (another Keras back end is active)."""
    import keras
    import psutil

    import keras_lms
    from keras_lms.planning.device_profile import builtin_profiles
    from keras_lms.quiet_startup import quiet_tensorflow_startup

    out = {
        "keras_lms": keras_lms.__version__,
        "python": platform.python_version(),
        "keras": keras.__version__,
        "keras_backend": keras.backend.backend(),
        "host_ram_total_gib": round(psutil.virtual_memory().total / 2**30, 2),
        "host_ram_available_gib": round(psutil.virtual_memory().available / 2**30, 2),
        "cpu_count": os.cpu_count(),
        "device_profiles": builtin_profiles(),
    }
    try:
        with quiet_tensorflow_startup(quiet):
            import tensorflow as tf

        out["tensorflow"] = tf.__version__
        out["devices"] = [d.name for d in tf.config.list_logical_devices()]
    except ImportError:
        out["tensorflow"] = None
    out["jax"] = _installed_version("jax")
    try:  # the devices of the active Keras back end (its distribution API; torch's Keras has none)
        out["keras_devices"] = [str(d) for d in keras.distribution.list_devices()]
    except (AttributeError, NotImplementedError, RuntimeError):
        out["keras_devices"] = None
    try:
        import horovod

        with quiet_tensorflow_startup(quiet):
            import horovod.tensorflow as hvd

        out["horovod"] = horovod.__version__
        out["horovod_build"] = {name: bool(getattr(hvd, f"{name}_built")()) for name in
                                ("mpi", "gloo", "nccl", "ddl", "ccl", "cuda", "rocm") if hasattr(hvd, f"{name}_built")}
    except ImportError as err:
        out["horovod"] = None
        out["horovod_error"] = str(err)
    return out


def _calibrate(args) -> int:
    from keras_lms.calibrate import measure_profile

    _check_writable(args.out, "--out")
    profile = measure_profile(args.device, smoke=args.smoke, name=args.name)
    profile.save(args.out)
    print(f"device profile {profile.name!r} written to {args.out}:")
    print(f"  host->device {profile.host_to_device_bytes_per_second / 1e9:.1f} GB/s "
          f"({profile.host_to_device_concurrent_bytes_per_second / 1e9:.1f} with both directions busy), "
          f"device->host {profile.device_to_host_bytes_per_second / 1e9:.1f} GB/s "
          f"({profile.device_to_host_concurrent_bytes_per_second / 1e9:.1f})")
    print("  convolutions " + ", ".join(f"{d} {r / 1e12:.1f} TFLOP/s" for d, r in profile.flops_per_second.items())
          + f"; element-wise {profile.elementwise_bytes_per_second / 1e9:.0f} GB/s")
    print(f"use it with: keras-lms report MODEL.keras --batch-size N --profile {args.out}")
    return 0


def _info(args) -> int:
    data = info_dict(quiet=not args.verbose)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="keras-lms info", show_header=False)
    table.add_column("what")
    table.add_column("value", overflow="fold")
    for key, value in data.items():
        table.add_row(key, ", ".join(value) if isinstance(value, list) else json.dumps(value)
                      if isinstance(value, dict) else str(value))
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-lms", description="Large Model Support for Keras 3.")
    parser.add_argument("--verbose", action="store_true",
                        help="keep TensorFlow's start-up logs (absl, oneDNN, cpu_feature_guard) on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="per-layer activation memory of a saved model, with and without LMS")
    rep.add_argument("model", help="a .keras file (plain or wrapped)")
    rep.add_argument("--batch-size", type=int, required=True)
    rep.add_argument("--budget", default=None, help="device budget, e.g. 6GiB: show what the planner offloads")
    rep.add_argument("--input-shape", default=None, help="one sample's shape, e.g. 128,128,128,1")
    rep.add_argument("--link-gbps", type=float, default=16.0, help="host link bandwidth for the transfer estimate")
    rep.add_argument("--plot", default=None, help="write the memory timeline PNG here")
    rep.add_argument("--json", action="store_true", help="print JSON instead of the table")
    rep.add_argument("--max-rows", type=int, default=None, help="show at most this many layer calls")
    where = rep.add_mutually_exclusive_group()
    where.add_argument("--device", default=None,
                       help="predict step times on a built-in device profile (a100-pcie4, h100-pcie5, ...)")
    where.add_argument("--profile", default=None, help="predict step times on a profile file (keras-lms calibrate)")
    rep.set_defaults(func=_report)
    big = sub.add_parser("largest", help="the largest input whose training step fits a device budget")
    big.add_argument("model", help="a .keras file (plain or wrapped)")
    big.add_argument("--batch-size", type=int, required=True)
    big.add_argument("--budget", required=True, help="device budget, e.g. 16GiB")
    big.add_argument("--input-shape", default=None,
                     help="one sample's shape to start from, whose proportions are kept, e.g. 64,64,64,1 (default: "
                          "the model's own)")
    big.add_argument("--axes", default=None, help="the sample axes that grow, e.g. 0,1,2 (default: all but channels)")
    big.add_argument("--multiple", type=int, default=None,
                     help="grown axes are multiples of this (default: the model's down-sampling, e.g. 16)")
    big.add_argument("--no-plain", action="store_true", help="skip the search for plain Keras' largest input")
    big.add_argument("--json", action="store_true", help="print JSON instead of the table")
    where = big.add_mutually_exclusive_group()
    where.add_argument("--device", default=None, help="plan for a built-in device profile and predict the step time")
    where.add_argument("--profile", default=None, help="plan for a profile file (keras-lms calibrate)")
    big.set_defaults(func=_largest)
    cal = sub.add_parser("calibrate", help="measure a device profile (host link, convolutions) on this GPU, with torch")
    cal.add_argument("--out", required=True, help="the profile JSON file to write")
    cal.add_argument("--device", default="cuda", help="the torch device to measure (default cuda)")
    cal.add_argument("--name", default=None, help="the profile's name (default: the GPU's name)")
    cal.add_argument("--smoke", action="store_true", help="tiny sizes on any device, the CPU included (a check of "
                                                         "the measuring code; its numbers describe nothing)")
    cal.set_defaults(func=_calibrate)
    info = sub.add_parser("info", help="versions, Horovod build flags, devices, host RAM")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=_info)
    return parser


def main(argv=None) -> int:
    """Run the command. TensorFlow's start-up logs are quieted by `keras_lms/__init__.py` (before TensorFlow is
    imported) unless `--verbose` is given."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, MemoryError) as err:
        verdict = "does not fit: " if type(err).__name__ == "BudgetError" else ""
        print(f"keras-lms: {verdict}{err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
