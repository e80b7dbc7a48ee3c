"""The static activation report: what a training step keeps on the device, with and without LMS.

`keras_lms.report(model, batch_size)` traces the model once (no data, no step), applies the same policy
and budget planner as `wrap` and predicts per layer call and in total what lives on the device and what
moves over the host link. `keras-lms report` prints it from the command line.
"""

from __future__ import annotations

import dataclasses
import io
import json

import keras

from keras_lms import planning
from keras_lms.config import LMSConfig, format_bytes, parse_bytes
from keras_lms.planning.device_profile import load_profile
from keras_lms.report_times import plan_times, row_decision, times_table


@dataclasses.dataclass
class ActivationReport:
    """What one training step keeps on the device, with and without LMS: returned by `keras_lms.report`.

    All byte counts are per training step and per rank, at `batch_size`.

    Args:
        model_name: the reported model's name.
        batch_size: samples per step per rank.
        link_gbps: the host-link bandwidth used for `transfer_seconds_per_step` (GB/s).
        rows: one dict per layer call, in forward order, with keys `index`, `layer`, `class`, `output_shape`,
            `output_bytes`, `input_bytes`, `offloaded`, `offloaded_bytes` and `reason` (the same decision as
            `LMSModel.lms_plan`).
        totals: a dict with `device_activation_bytes_plain` and `device_activation_bytes_wrapped` (activations
            kept on the device for the backward pass), `host_bytes_per_step`, `transfer_bytes_per_step`,
            `transfer_seconds_per_step`, `static_bytes` (weights, gradients and optimizer state),
            `predicted_peak_bytes_plain`, `predicted_peak_bytes_wrapped`, and, when a budget is set,
            `device_budget`, `budget_peak_bytes` (the wrapped peak with the planner's margin),
            `fits_device_budget` (with the margin) and `fits_device_budget_without_margin` (at the largest
            volumes the planner meets a budget only without its margin, within what wrap's defaults need).
        plain: the simulated device-memory timeline of the plain step (`keras_lms.planning.StepMemory`).
        wrapped: the same with LMS.
        device_budget: the budget the plan was made for, or `None`.
        times: with a `device_profile`, the predicted step time (`keras_lms.planning.StepTime`) of the plain
            step (infinite memory), the plan (`"as planned"`) and the offload-only plan (every tensor the
            per-call rules allow offloaded, no budget narrowing); empty without one.
        device_profile: the `keras_lms.DeviceProfile` the times are predicted for, or `None`.

    Rows also carry `decision` (`"keep"`, `"copy"`: its inputs' host copies come back for its backward, or
    `"copy+recompute"`: they come back and its forward is recomputed from them) and the call's
    `device_to_host_bytes` / `host_to_device_bytes` over the host link; with a `device_profile`, also
    `predicted_wait_seconds` (how long the device waits for the call's copies back, forward and backward: the
    step's exposed copy time, call by call) and `predicted_recompute_seconds` (what the plan's recompute adds to
    the call's forward and backward). Totals split the traffic into
    `device_to_host_bytes_per_step` and `host_to_device_bytes_per_step` (a copy comes back once per backward
    that reads it, slab windows with their halos).

    Example:

    ```python
    import json

    import keras
    import keras_lms

    inputs = keras.Input((64, 64, 3))
    x = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
    x = keras.layers.Conv2D(16, 3, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(x)))
    rep = keras_lms.report(model, batch_size=8)
    print(rep.totals["predicted_peak_bytes_plain"], rep.totals["predicted_peak_bytes_wrapped"])
    print(rep.rows[0]["layer"], rep.rows[0]["reason"])
    assert json.loads(rep.to_json())["batch_size"] == 8
    ```
    """

    model_name: str
    batch_size: int
    link_gbps: float
    rows: list
    totals: dict
    plain: planning.StepMemory
    wrapped: planning.StepMemory
    device_budget: int | None = None
    times: dict = dataclasses.field(default_factory=dict)
    device_profile: object = None

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON: `model`, `batch_size`, `link_gbps`, `totals`, `rows` and both timelines.

        Args:
            indent: passed to `json.dumps` (`None`: one line).

        Returns:
            A JSON string.
        """
        return json.dumps({"model": self.model_name, "batch_size": self.batch_size, "link_gbps": self.link_gbps,
                           "totals": self.totals, "rows": self.rows,
                           "times": {name: t.to_dict() for name, t in self.times.items()},
                           "device_profile": self.device_profile.to_dict() if self.device_profile else None,
                           "timeline_plain": self.plain.timeline, "timeline_wrapped": self.wrapped.timeline},
                          indent=indent)

    def to_text(self, max_rows: int | None = None) -> str:
        """A table of the layer calls and the totals, as plain text (what `keras-lms report` prints).

        Args:
            max_rows: show at most this many layer calls (`None`: all).

        Returns:
            The text, 150 columns wide.
        """
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"keras-lms activation report: {self.model_name}, batch size {self.batch_size}")
        timed = bool(self.times)  # with a device profile: where each call's time goes
        columns = ["#", "layer", "class", "output shape", "output", "inputs", "to host", "back", "decision"]
        columns += ["waits ms", "recompute ms"] if timed else []
        for column in (*columns, "why"):
            table.add_column(column, overflow="fold")
        rows = self.rows if max_rows is None else self.rows[:max_rows]
        for r in rows:
            times = [f"{r[key] * 1e3:.1f}" for key in ("predicted_wait_seconds", "predicted_recompute_seconds")
                     if timed]
            table.add_row(str(r["index"]), r["layer"], r["class"], str(r["output_shape"]),
                          format_bytes(r["output_bytes"]), format_bytes(r["input_bytes"]),
                          format_bytes(r["device_to_host_bytes"]), format_bytes(r["host_to_device_bytes"]),
                          r["decision"], *times, r["reason"])
        if max_rows is not None and len(self.rows) > max_rows:
            table.add_row("...", f"{len(self.rows) - max_rows} more calls", *[""] * (len(columns) - 1))
        t = self.totals
        summary = Table(title="per step, per rank", show_header=False)
        summary.add_column("what")
        summary.add_column("bytes", justify="right")
        for label, key in (("activations kept for backward on device, plain", "device_activation_bytes_plain"),
                           ("activations kept for backward on device, with LMS", "device_activation_bytes_wrapped"),
                           ("weights + gradients + optimizer state", "static_bytes"),
                           ("predicted device peak, plain", "predicted_peak_bytes_plain"),
                           ("predicted device peak, with LMS", "predicted_peak_bytes_wrapped"),
                           ("host memory needed", "host_bytes_per_step"),
                           ("copied to host", "device_to_host_bytes_per_step"),
                           ("copied back to the device", "host_to_device_bytes_per_step"),
                           ("moved over the host link", "transfer_bytes_per_step")):
            summary.add_row(label, format_bytes(t[key]))
        summary.add_row(f"transfer time at {self.link_gbps:g} GB/s", f"{t['transfer_seconds_per_step'] * 1e3:.1f} ms")
        if self.device_budget is not None:
            summary.add_row("device budget", format_bytes(self.device_budget))
            verdict = ("yes" if t["fits_device_budget"] else "without the planner's margin only"
                       if t["fits_device_budget_without_margin"] else "no")
            summary.add_row("fits the device budget", f"{verdict} ({format_bytes(t['budget_peak_bytes'])} with the "
                                                      "planner's margin)")
        buffer = io.StringIO()
        console = Console(file=buffer, width=150, force_terminal=False, color_system=None)
        console.print(table)
        console.print(summary)
        if self.times:
            console.print(times_table(self.times, self.device_profile))
        return buffer.getvalue()

    def plot(self, path, title: str | None = None):
        """Write a PNG of device memory through the forward and backward pass, plain vs with LMS.

        Needs matplotlib (`pip install "keras-lms[plot]"`). The budget, when set, is drawn as a line.

        Args:
            path: the file to write.
            title: the plot's title (default: model name and batch size).

        Returns:
            `path`.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        mib = float(1 << 20)
        n = len(self.plain.timeline) // 2
        xs = range(len(self.plain.timeline))
        fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
        ax.plot(xs, [(self.plain.static_bytes + v) / mib for v in self.plain.timeline], label="plain",
                color="tab:red")
        ax.plot(xs, [(self.wrapped.static_bytes + v) / mib for v in self.wrapped.timeline],
                label="with keras-lms", color="tab:blue")
        ax.axhline(self.plain.static_bytes / mib, color="gray", lw=0.8, ls=":", label="weights+grads+optimizer")
        if self.device_budget is not None:
            ax.axhline(self.device_budget / mib, color="black", ls="--", label="device budget")
        ax.axvline(n - 0.5, color="gray", lw=0.8)
        ax.text(n * 0.5, ax.get_ylim()[1] * 0.97, "forward", ha="center", va="top")
        ax.text(n * 1.5, ax.get_ylim()[1] * 0.97, "backward", ha="center", va="top")
        ax.set_xlabel("layer call (forward, then backward)")
        ax.set_ylabel("device memory (MiB)")
        ax.set_title(title or f"{self.model_name}, batch size {self.batch_size}")
        ax.legend(loc="upper right", bbox_to_anchor=(1.0, 0.9), fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path


def report(model_or_wrapped, batch_size: int, input_shape=None, dtype=None, device_budget=None,
           link_gbps: float = 16.0, config: LMSConfig | None = None, device_profile=None) -> ActivationReport:
    """Predict a training step's device and host memory, with and without LMS, without running it.

    The model is traced once with symbolic inputs (no data, no training step). The same policy and budget
    planner as `keras_lms.wrap` decide what would be offloaded, and a simulation of the step gives the
    activations kept on the device, the predicted device peak, the host memory needed and the bytes moved
    over the host link, per layer call and in total. `keras-lms report MODEL.keras --batch-size N` prints it
    from the command line.

    Args:
        model_or_wrapped: a built `keras.Model`, or a `keras_lms.LMSModel` (then its settings are used).
        batch_size: samples per step per rank (a positive int).
        input_shape: one sample's shape without the batch axis, e.g. `(128, 128, 128, 1)`: for models that do
            not record their input shape, or to report another input size. Defaults to the model's own.
        dtype: the input dtype with `input_shape`. Defaults to `"float32"`.
        device_budget: bytes or a size string such as `"6GiB"`: report what the budget planner would offload
            for this budget (overrides the config's `device_budget`). Defaults to `None`.
        link_gbps: the host-link bandwidth for the transfer-time estimate, in GB/s. Defaults to `16.0` (PCIe 4
            x16).
        config: the `keras_lms.LMSConfig` to report with. Defaults to the wrapped model's settings, or
            `LMSConfig()` (the defaults of `wrap`) for a plain model.
        device_profile: a built-in device profile's name (`"h100-pcie5"`, `"h200-pcie5"`, `"gh200"`,
            `"a100-pcie4"`), a profile JSON file (`keras-lms calibrate` writes one) or a
            `keras_lms.DeviceProfile`: also predict the step's time on that device, plain, as planned,
            offload-only and recompute-all (`.times`, and `predicted_*_seconds` in `.totals`). For a plain model
            without `config`, the plan is the one `wrap(model, device_profile=...)` makes (what to recompute is
            chosen for that device); with `config` or a wrapped model, their own plan is timed on the device.
            Defaults to `None` (bytes only).

    Returns:
        A `keras_lms.ActivationReport`: `.rows`, `.totals`, `.to_text()`, `.to_json()`, `.plot(path)`.

    Raises:
        TypeError: `model_or_wrapped` is not a `keras.Model`, or `config` is not an `LMSConfig`.
        ValueError: `batch_size`, `input_shape`, `link_gbps` or `device_profile` is not valid, or the model is
            not built or does not record its input shape and no `input_shape` was given.
        keras_lms.BudgetError: `device_budget` cannot be met even with full offload.

    Example:

    ```python
    import keras
    import keras_lms

    inputs = keras.Input((None, None, 3))        # any image size: give it with input_shape=
    x = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
    x = keras.layers.Conv2D(16, 3, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(x)))
    rep = keras_lms.report(model, batch_size=8, input_shape=(64, 64, 3),
                           config=keras_lms.LMSConfig(min_bytes="64KiB"))
    print(rep.to_text())
    larger = keras_lms.report(model, batch_size=8, input_shape=(128, 128, 3), device_budget="64MiB")
    print(larger.totals["predicted_peak_bytes_wrapped"], larger.totals["host_bytes_per_step"])
    ```
    """
    from keras_lms import offload
    from keras_lms.model import LMSModel

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}.")
    if not isinstance(model_or_wrapped, keras.Model):
        raise TypeError(f"report expects a keras.Model or a wrapped model; got {type(model_or_wrapped).__name__}.")
    if isinstance(link_gbps, bool) or not isinstance(link_gbps, (int, float)) or not 0 < link_gbps < float("inf"):
        raise ValueError(
            f"link_gbps must be a positive number of GB/s (the host link's bandwidth, e.g. 16 for PCIe 4 x16); "
            f"got {link_gbps!r}."
        )
    profile = None if device_profile is None else load_profile(device_profile)
    if config is not None and not isinstance(config, LMSConfig):
        raise TypeError(
            f"config must be a keras_lms.LMSConfig, e.g. config=keras_lms.LMSConfig(min_bytes='1MiB'); "
            f"got {type(config).__name__}."
        )
    if input_shape is not None:
        dims = list(input_shape) if isinstance(input_shape, (list, tuple)) else None
        import numbers

        if not dims or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 for d in dims):
            raise ValueError(
                "input_shape must be one sample's shape without the batch axis, a tuple of positive integers "
                f"such as (128, 128, 128, 1); got {input_shape!r}."
            )
        input_shape = tuple(int(d) for d in dims)
    explicit_settings = config is not None or isinstance(model_or_wrapped, LMSModel)
    if isinstance(model_or_wrapped, LMSModel):
        wrapped = model_or_wrapped
        config = config or wrapped.lms_config
        model, structure = wrapped.inner_model, wrapped.lms_structure
        optimizer = getattr(wrapped, "optimizer", None)
    else:
        model, structure = model_or_wrapped, planning.model_structure(model_or_wrapped)
        optimizer = getattr(model, "optimizer", None)
        config = config or LMSConfig()
    if device_budget is not None:
        config = dataclasses.replace(config, device_budget=parse_bytes(device_budget, "device_budget"))
    if profile is not None and config.device_profile is None and not explicit_settings:
        config = dataclasses.replace(config, device_profile=profile)  # plan as wrap(device_profile=) would
    if not model.built:
        raise ValueError(f"Model {model.name!r} is not built; build it or pass input_shape= to report().")
    backend = offload.active_backend()
    if input_shape is not None:
        specs = backend.spec_for(tuple([batch_size, *input_shape]), dtype or "float32")
    else:
        specs = backend.example_inputs(model, batch_size)
        if specs is None:
            raise ValueError(f"Model {model.name!r} does not record its input shape: pass input_shape=(...).")
    step = planning.plan_step(backend, model, structure, config, specs, {}, batch_size, optimizer)
    plan, static = step.entries, step.static_bytes
    plain, with_lms = step.plain_memory(), step.wrapped_memory()
    traffic = step.link_traffic()
    rows = [dict(index=e.index, layer=e.layer, **{"class": e.layer_class},
                 output_shape=list(map(list, e.output_shapes)),
                 output_bytes=e.output_bytes, input_bytes=e.bytes, offloaded=e.offloaded,
                 offloaded_bytes=e.offloaded_bytes, decision=row_decision(step, e.index),
                 device_to_host_bytes=traffic.out_bytes[e.index],
                 host_to_device_bytes=traffic.forward_in_bytes[e.index] + traffic.backward_in_bytes[e.index],
                 reason=e.reason) for e in plan]
    saved_plain, saved_wrapped = _saved_bytes(step)
    host = planning.host_bytes_per_step(plan)
    transfer = traffic.total_bytes  # each copy out once, each copy back as often as a backward reads it
    totals = dict(
        device_activation_bytes_plain=saved_plain,
        device_activation_bytes_wrapped=saved_wrapped,
        host_bytes_per_step=host,
        device_to_host_bytes_per_step=traffic.device_to_host_bytes,
        host_to_device_bytes_per_step=traffic.host_to_device_bytes,
        transfer_bytes_per_step=transfer,
        transfer_seconds_per_step=transfer / (link_gbps * 1e9),
        static_bytes=static,
        predicted_peak_bytes_plain=plain.peak_bytes,
        predicted_peak_bytes_wrapped=with_lms.peak_bytes,
    )
    if config.device_budget is not None:
        totals["device_budget"] = config.device_budget
        totals["budget_peak_bytes"] = with_lms.budget_bytes  # the peak with planning.BUDGET_MARGIN
        totals["fits_device_budget"] = with_lms.budget_bytes <= config.device_budget
        totals["fits_device_budget_without_margin"] = with_lms.peak_bytes <= config.device_budget
    times = {}
    if profile is not None:
        times = plan_times(step, profile)
        planned = times["as planned"]
        for row in rows:  # where the plan's time goes, call by call
            row.update(predicted_wait_seconds=planned.call_waits[row["index"]],
                       predicted_recompute_seconds=planned.call_recomputes[row["index"]])
        totals.update(device_profile=profile.name,
                      predicted_compute_seconds=planned.compute_seconds,
                      predicted_recompute_seconds=planned.recompute_seconds,
                      predicted_copy_out_seconds=planned.device_to_host_seconds,
                      predicted_copy_in_seconds=planned.host_to_device_seconds,
                      predicted_exposed_copy_seconds=planned.exposed_seconds,
                      predicted_step_seconds=planned.step_seconds,
                      predicted_step_seconds_plain=times["plain"].step_seconds,
                      predicted_step_seconds_offload_only=times["offload-only"].step_seconds,
                      recompute_flops=planned.recompute_flops, prefetch=step.prefetch)
    return ActivationReport(model.name, batch_size, link_gbps, rows, totals, plain, with_lms, config.device_budget,
                            times, profile)


def _saved_bytes(step: planning.StepPlan):
    """Bytes of distinct layer inputs the backward pass reads: plain, and those still on the device with LMS."""
    plain, kept = {}, {}
    for call, entry in zip(step.calls, step.entries):
        if not step.facts.backward_reads(call.unit)[0]:
            continue
        for key, shape, dtype, off in zip(call.keys, call.shapes, call.dtypes, entry.tensor_offloaded):
            size = planning.tensor_bytes(shape, dtype, step.batch_size)
            plain[key] = size
            if not off:
                kept[key] = size
    return sum(plain.values()), sum(kept.values())
