"""The ``keras-lms`` command: ``keras-lms report MODEL.keras --batch-size N`` and ``keras-lms info``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys


def _report(args) -> int:
    import keras

    import keras_lms

    if not os.path.exists(args.model):
        print(f"keras-lms: no such model file: {args.model}", file=sys.stderr)
        return 2
    model = keras.models.load_model(args.model, compile=False)
    input_shape = tuple(int(d) for d in args.input_shape.split(",")) if args.input_shape else None
    rep = keras_lms.report(model, batch_size=args.batch_size, input_shape=input_shape,
                           device_budget=args.budget, link_gbps=args.link_gbps)
    if args.json:
        print(rep.to_json())
    else:
        print(rep.to_text(max_rows=args.max_rows))
    if args.plot:
        rep.plot(args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def info_dict() -> dict:
    """Versions, Horovod build flags, devices and host RAM (what a bug report needs)."""
    import keras
    import psutil

    import keras_lms

    out = {
        "keras_lms": keras_lms.__version__,
        "python": platform.python_version(),
        "keras": keras.__version__,
        "keras_backend": keras.backend.backend(),
        "host_ram_total_gib": round(psutil.virtual_memory().total / 2**30, 2),
        "host_ram_available_gib": round(psutil.virtual_memory().available / 2**30, 2),
        "cpu_count": os.cpu_count(),
    }
    try:
        import tensorflow as tf

        out["tensorflow"] = tf.__version__
        out["devices"] = [d.name for d in tf.config.list_logical_devices()]
    except ImportError:
        out["tensorflow"] = None
    try:
        import horovod
        import horovod.tensorflow as hvd

        out["horovod"] = horovod.__version__
        out["horovod_build"] = {name: bool(getattr(hvd, f"{name}_built")()) for name in
                                ("mpi", "gloo", "nccl", "ddl", "ccl", "cuda", "rocm") if hasattr(hvd, f"{name}_built")}
    except ImportError as err:
        out["horovod"] = None
        out["horovod_error"] = str(err)
    return out


def _info(args) -> int:
    data = info_dict()
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
    rep.set_defaults(func=_report)
    info = sub.add_parser("info", help="versions, Horovod build flags, devices, host RAM")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=_info)
    return parser


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, MemoryError) as err:
        print(f"keras-lms: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
