"""Artefacts of a finished segmentation run: plots, activation report, sample prediction and ``summary.json``.

:func:`write_artefacts` writes them to ``--out`` on rank 0 and :func:`print_summary` prints the summary (also
what ``examples/summary.py`` prints from a run's ``summary.json``).
"""

from __future__ import annotations

import math
import pathlib
import statistics

import numpy as np

import keras_lms

if __package__:  # imported as examples.artefacts (python -m examples.segmentation_3d, the tests)
    from .cli import Task
    from .runtime import wrap_kwargs
    from .state import CHECKPOINT, jsonable, write_json
else:  # python examples/segmentation_3d.py: examples/ is on sys.path
    from cli import Task
    from runtime import wrap_kwargs
    from state import CHECKPOINT, jsonable, write_json


def _series(history: list, key: str) -> list:
    return [row.get(key) for row in history]


def _last(history: list, *keys):
    for key in keys:
        for row in reversed(history):
            if row.get(key) is not None:
                return row[key], key
    return None, None


def _max(history: list, *keys):
    for key in keys:
        values = [row[key] for row in history if row.get(key) is not None]
        if values:
            return max(values)
    return None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(history: list, path: pathlib.Path, title: str) -> pathlib.Path:
    """Three panels per epoch: loss, Dice/IoU (train and validation), memory high-water marks."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    epochs = [row["epoch"] for row in history]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("loss", [("loss", "train"), ("val_loss", "validation")], None),
        ("Dice / IoU (threshold 0.5)", [("dice", "Dice train"), ("val_dice", "Dice validation"),
                                        ("iou", "IoU train"), ("val_iou", "IoU validation")], (0, 1)),
        ("memory per rank (MiB)", [("peak_device_mib", "peak device"), ("peak_host_rss_mib", "peak host RSS"),
                                   ("offloaded_mib", "offloaded per step")], None),
    ]
    for ax, (label, series, ylim) in zip(axes, panels):
        for key, name in series:
            values = _series(history, key)
            if any(v is not None for v in values):
                ax.plot(epochs, [np.nan if v is None else v for v in values], marker="o", label=name)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(label)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _display(image: np.ndarray) -> np.ndarray:
    """A standardised image (H, W, C) as something imshow shows well: grey or RGB in [0, 1]."""
    lo, hi = np.percentile(image, (1, 99))
    shown = np.clip((image - lo) / max(hi - lo, 1e-6), 0, 1)
    return shown[..., 0] if shown.shape[-1] != 3 else shown


def plot_sample(image, truth, prob, path: pathlib.Path, title: str) -> pathlib.Path:
    """Image / ground truth / prediction of one 2D slice (arrays (H, W, C), (H, W), (H, W))."""
    plt = _plt()
    step = max(1, int(math.ceil(max(truth.shape) / 1024)))  # 2048-pixel tiles: show at most ~1024 pixels
    image, truth, prob = image[::step, ::step], truth[::step, ::step], prob[::step, ::step]
    pred = prob > 0.5
    inter, total = float((pred & (truth > 0.5)).sum()), float(pred.sum() + (truth > 0.5).sum())
    dice = 2 * inter / total if total else 1.0
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.6))
    shown = _display(image)
    axes[0].imshow(shown, cmap=None if shown.ndim == 3 else "gray")
    axes[0].set_title("image")
    axes[1].imshow(truth, cmap="viridis", vmin=0, vmax=1)
    axes[1].set_title("ground truth")
    axes[2].imshow(prob, cmap="viridis", vmin=0, vmax=1)
    if pred.any() and not pred.all():
        axes[2].contour(pred.astype(float), levels=[0.5], colors="red", linewidths=0.8)
    axes[2].set_title(f"prediction (red: > 0.5), slice Dice {dice:.3f}")
    for ax in axes:
        ax.set_axis_off()
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sample_prediction(model, dataset, task: Task, path: pathlib.Path) -> pathlib.Path:
    """Predict the first validation batch; plot the sample (and, in 3D, the axial slice) with most lesion."""
    x, y = dataset[0]
    prob = np.asarray(model.predict(x, batch_size=len(x), verbose=0), dtype=np.float32)
    i = int(np.argmax(y.reshape(len(y), -1).sum(axis=1)))
    image, truth, p = x[i], y[i, ..., 0], prob[i, ..., 0]
    where = ""
    if task.ndim == 3:
        z = int(np.argmax(truth.reshape(truth.shape[0], -1).sum(axis=1)))
        image, truth, p = image[z], truth[z], p[z]
        where = f", slice {z}"
    return plot_sample(image, truth, p, path, f"{task.name}: validation sample {i}{where}")

def write_artefacts(args, task, model, base, val_ds, history, fit_history, train_seconds, rt, out,
                    initial_epoch, channels) -> dict:
    """Plots, activation report, summary.json (rank 0)."""
    artefacts = {}
    if history:
        artefacts["training_curves"] = str(plot_curves(
            history, out / "training_curves.png",
            f"{task.name}: {rt.size} rank(s), batch {args.batch_size}/rank, {'LMS' if args.lms else 'no LMS'}"))
    rep = keras_lms.report(model, batch_size=args.batch_size)
    artefacts["activation_report"] = str(rep.plot(out / "activation_report.png"))
    (out / "activation_report.txt").write_text(rep.to_text() + "\n")
    report_totals = {k: jsonable(v) for k, v in rep.totals.items()}
    artefacts["sample_prediction"] = str(sample_prediction(model, val_ds, task, out / "sample_prediction.png"))
    if (out / CHECKPOINT).exists():
        artefacts["checkpoint"] = str(out / CHECKPOINT)
    if (out / "training_log.csv").exists():
        artefacts["training_log"] = str(out / "training_log.csv")

    final_dice, dice_key = _last(history, "val_dice", "dice")
    final_iou, _ = _last(history, "val_iou", "iou")
    final_loss, _ = _last(history, "val_loss", "loss")
    rates = [v for v in fit_history.get("samples_per_s", []) if v is not None]
    steady = rates[1:] if len(rates) > 1 else rates
    offloaded = getattr(model, "offloaded_bytes_per_step", 0) or 0
    summary = {
        "example": task.name,
        "final_dice": final_dice,
        "dice_source": dice_key,
        "final_iou": final_iou,
        "final_loss": final_loss,
        "samples_per_s": statistics.median(steady) if steady else None,
        "train_seconds": round(train_seconds, 2),
        "peak_device_mib": _max(history, "peak_device_mib_max", "peak_device_mib"),
        "peak_host_rss_mib": _max(history, "peak_host_rss_mib_max", "peak_host_rss_mib"),
        "offloaded_mib_per_step": offloaded / 2**20,
        "epochs_completed": history[-1]["epoch"] if history else initial_epoch,
        "initial_epoch": initial_epoch,
        "ranks": rt.size,
        "batch_size_per_rank": args.batch_size,
        "global_batch_size": args.batch_size * rt.size,
        "input_shape": list(task.spatial_shape(args) + (channels,)),
        "lms": bool(args.lms),
        "lms_settings": wrap_kwargs(args) if args.lms else None,
        "data": args.data_dir or "synthetic",
        "activation_report": report_totals,
        "artefacts": artefacts,
    }
    write_json(out / "summary.json", summary)
    print_summary(summary, out)
    return summary

def _fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def print_summary(s: dict, out: pathlib.Path) -> None:
    dice_name = "validation Dice" if s["dice_source"] == "val_dice" else "training Dice"
    lines = [
        "",
        f"== {s['example']} summary ({s['ranks']} rank(s), global batch {s['global_batch_size']}, "
        f"{s['epochs_completed']} epoch(s), {'LMS' if s['lms'] else 'no LMS'}) ==",
        f"final {dice_name}:    {_fmt(s['final_dice'], '.3f')}   (IoU {_fmt(s['final_iou'], '.3f')}, "
        f"loss {_fmt(s['final_loss'], '.4f')})",
        f"throughput:             {_fmt(s['samples_per_s'], '.2f')} samples/s (all ranks, steady state); "
        f"training took {s['train_seconds']:.0f} s",
        f"peak device memory:     {_fmt(s['peak_device_mib'], '.0f')} MiB per rank",
        f"peak host memory (RSS): {_fmt(s['peak_host_rss_mib'], '.0f')} MiB per rank",
        f"offloaded per step:     {s['offloaded_mib_per_step']:.1f} MiB per rank",
    ]
    rep = s.get("activation_report")
    if rep:
        lines.append(f"activation report:      {rep['device_activation_bytes_plain'] / 2**20:.1f} MiB of saved "
                     f"activations without LMS, {rep['device_activation_bytes_wrapped'] / 2**20:.1f} MiB with")
    lines.append(f"artefacts in {out}/: " + ", ".join(pathlib.Path(p).name for p in s["artefacts"].values())
                 + ", summary.json")
    print("\n".join(lines), flush=True)
