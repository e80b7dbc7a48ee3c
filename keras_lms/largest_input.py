"""The largest input a training step fits in a device budget: `keras_lms.largest_input`.

Why a search over reports: whether a step fits a budget is the budget planner's answer, made per input shape
(slab sizes, sweeps, what is kept, copied or recomputed all change with the shape), so the only faithful way to
ask "how large can my volume be on this GPU?" is to ask `wrap`'s planner at each candidate shape. Each probe is
one `keras_lms.report` (a trace and a plan, no step): a few seconds for a 3D U-Net at 16 GiB on two cores. The
search grows the volume by doubling its edge until the planner refuses, then bisects between the last shape it
accepted and the first it refused: about eight probes from 64^3 to the 16 GiB cube. It assumes what the planner's
memory model has: a larger input never needs less memory (every probe is listed, so a user can see it held).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import re

import keras

from keras_lms import input_shapes
from keras_lms.config import LMSConfig, format_bytes, parse_bytes
from keras_lms.planning import BudgetError
from keras_lms.planning.device_profile import load_profile
from keras_lms.report import ActivationReport, report


@dataclasses.dataclass
class Probe:
    """One shape the search asked the planner about: `fits` the budget with the planner's margin, the peak with
    that margin (`None` where the planner refused outright), the predicted step with a device profile, and why
    it does not fit (empty where it does)."""

    input_shape: tuple
    fits: bool
    budget_peak_bytes: int | None = None
    step_seconds: float | None = None
    why_not: str = ""


@dataclasses.dataclass
class LargestInput:
    """What `keras_lms.largest_input` found.

    Args:
        input_shape: the largest sample shape (without the batch axis) whose step `wrap(model,
            device_budget=...)` plans within the budget with the planner's margin, or `None` if not even the
            smallest shape the search allows fits.
        report: the `keras_lms.ActivationReport` at `input_shape` (what is offloaded, the predicted peak and,
            with a device profile, the predicted step time), or `None`.
        refused_shape: the next larger shape the search tried, which does not fit (`None` if none was refused).
        refused_because: why it does not fit: the planner's `BudgetError`, or its predicted peak.
        plain_input_shape: the largest shape whose plain step (no keras-lms) fits the budget by the same
            rule (its predicted peak with the margin), or `None` if none does.
        batch_size: samples per step.
        device_budget: the budget in bytes.
        multiple: every grown axis is a multiple of this.
        axes: the grown axes of the sample shape.
        probes: every `Probe`, in the order the search made them.

    Example:

    ```python
    import keras
    import keras_lms

    inputs = keras.Input((None, None, 1))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Conv2D(1, 1)(x))
    found = keras_lms.largest_input(model, batch_size=1, device_budget="8MiB", input_shape=(64, 64, 1))
    print(found.to_text())
    assert found.report.totals["fits_device_budget"] and found.input_shape[0] >= found.plain_input_shape[0]
    ```
    """

    input_shape: tuple | None
    report: ActivationReport | None
    refused_shape: tuple | None
    refused_because: str
    plain_input_shape: tuple | None
    batch_size: int
    device_budget: int
    multiple: int
    axes: tuple
    probes: list

    def to_dict(self) -> dict:
        """The result as plain data (what `keras-lms largest --json` prints): shapes, the reason, the probes and,
        from the report, the predicted peak and step times."""
        totals = self.report.totals if self.report is not None else {}
        keys = ("budget_peak_bytes", "predicted_peak_bytes_wrapped", "host_bytes_per_step", "device_profile",
                "predicted_step_seconds", "predicted_step_seconds_plain", "predicted_step_seconds_offload_only")
        return {"input_shape": self.input_shape, "refused_shape": self.refused_shape,
                "refused_because": self.refused_because, "plain_input_shape": self.plain_input_shape,
                "batch_size": self.batch_size, "device_budget": self.device_budget, "multiple": self.multiple,
                "axes": self.axes, "totals": {k: totals[k] for k in keys if k in totals},
                "probes": [dataclasses.asdict(p) for p in self.probes]}

    def to_text(self) -> str:
        """The probes as a table and the answer in a sentence (what `keras-lms largest` prints)."""
        import io

        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"largest input for {format_bytes(self.device_budget)} at batch size "
                            f"{self.batch_size}: the planner asked at each shape")
        for column in ("input shape", "fits", "peak with margin", "predicted step", "why not"):
            table.add_column(column, overflow="fold")
        for p in self.probes:
            table.add_row("x".join(map(str, p.input_shape)), "yes" if p.fits else "no",
                          format_bytes(p.budget_peak_bytes) if p.budget_peak_bytes is not None else "-",
                          _seconds(p.step_seconds) if p.step_seconds is not None else "-", p.why_not[:160])
        out = io.StringIO()
        Console(file=out, width=150).print(table)
        out.write(self._summary() + "\n")
        return out.getvalue()

    def _summary(self) -> str:
        budget = format_bytes(self.device_budget)
        if self.input_shape is None:
            return f"No input fits {budget}: {self.refused_because}"
        plain = (f"plain Keras: {_shape_text(self.plain_input_shape)}" if self.plain_input_shape
                 else "plain Keras: none")
        text = f"Largest input that fits {budget}: {_shape_text(self.input_shape)} ({plain})."
        totals = self.report.totals
        if "predicted_step_seconds" in totals:
            step, plain_step = totals["predicted_step_seconds"], totals["predicted_step_seconds_plain"]
            text += (f" Predicted step on {totals['device_profile']}: {_seconds(step)}, {step / plain_step:.2f}x the "
                     f"plain step's {_seconds(plain_step)} (keras-lms report shows where the time goes).")
        if self.refused_shape is not None:
            text += f" The next, {_shape_text(self.refused_shape)}, does not fit: {self.refused_because}"
        return text


def largest_input(model, batch_size: int, device_budget, input_shape=None, axes=None, multiple=None,
                  device_profile=None, config: LMSConfig | None = None, plain: bool = True,
                  on_probe=None) -> LargestInput:
    """Find the largest input whose training step `keras_lms.wrap` plans within `device_budget`.

    The sample shape grows on `axes`, keeping their proportions, in steps of `multiple`; each probe asks the
    budget planner, as `keras_lms.report(..., device_budget=...)` does, whether the step fits with the
    planner's margin. The search doubles the shape until the planner refuses and then bisects.

    Args:
        model: a built `keras.Model` with one input, or a `keras_lms.LMSModel` (its settings are used). A model
            whose input fixes the grown axes' sizes is probed through a clone with them open.
        batch_size: samples per step per rank (a positive int).
        device_budget: bytes or a size string such as `"16GiB"`.
        input_shape: the shape to start from and whose proportions are kept (one sample, no batch axis).
            Defaults to the model's own input shape, which must then be fully known.
        axes: the sample axes that grow, e.g. `(0, 1, 2)`. Defaults to every axis but the channels.
        multiple: every grown axis is a multiple of it. Defaults to the model's down-sampling along the grown
            axes at `input_shape` (the start size over the smallest size any layer output has there, rounded
            down to a power of two): 16 for a U-Net of depth 4.
        device_profile: a device profile (as in `keras_lms.report`): plan for that device and predict the step
            time at the answer. Defaults to `None`.
        config: a `keras_lms.LMSConfig` to plan with (as in `keras_lms.report`). Defaults to `wrap`'s.
            The optimizer's state is counted as the report counts it: a compiled model's built optimizer's own,
            else two slots per weight (Adam's), so compile and build yours for an answer at its state.
        plain: also find the largest shape the plain step fits (by its predicted peak with the same margin).
            Defaults to `True`.
        on_probe: called with each `Probe` as it is made (progress). Defaults to `None`.

    Returns:
        A `LargestInput`: `.input_shape`, `.report`, `.refused_shape`, `.refused_because`, `.plain_input_shape`,
        `.probes`, `.to_text()`.

    Raises:
        TypeError: `model` is not a `keras.Model`, `config` not an `LMSConfig` or `on_probe` not callable.
        ValueError: `batch_size`, `device_budget`, `input_shape`, `axes`, `multiple` or `device_profile` is not
            valid, the model has more than one input or no known input shape, or it does not build at a probed
            shape.

    Example:

    ```python
    import keras
    import keras_lms

    inputs = keras.Input((None, None, None, 1))
    x = keras.layers.Conv3D(8, 3, padding="same", activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Conv3D(1, 1)(x))
    found = keras_lms.largest_input(model, batch_size=1, device_budget="64MiB", input_shape=(16, 16, 16, 1),
                                    multiple=8, device_profile="h100-pcie5")
    print(found.input_shape, found.report.totals["predicted_step_seconds"])
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"largest_input expects a keras.Model or a wrapped model; got {type(model).__name__}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}.")
    budget = parse_bytes(device_budget, "device_budget")
    if budget <= 0:
        raise ValueError(f"device_budget must be positive, e.g. device_budget='16GiB'; got {device_budget!r}.")
    if config is not None and not isinstance(config, LMSConfig):
        raise TypeError(f"config must be a keras_lms.LMSConfig, e.g. config=keras_lms.LMSConfig(min_bytes='1MiB'); "
                        f"got {type(config).__name__}.")
    if on_probe is not None and not callable(on_probe):
        raise TypeError(f"on_probe must be a function taking each Probe (or None); got {type(on_probe).__name__}.")
    if device_profile is not None:
        device_profile = load_profile(device_profile)  # (its error before any probe, not as a probe's)
    start = input_shapes.start_shape(model, input_shape)
    axes = input_shapes.grown_axes(axes, len(start))
    model, config = input_shapes.open_sized(model, axes, config)
    if multiple is None:
        multiple = input_shapes.down_sampling(model, batch_size, start, axes, config)
    elif isinstance(multiple, bool) or not isinstance(multiple, numbers.Integral) or multiple < 1:
        raise ValueError(f"multiple must be a positive integer (every grown axis is a multiple of it, e.g. 16 for a "
                         f"U-Net of depth 4); got {multiple!r}.")
    search = _Search(model, batch_size, budget, start, axes, int(multiple), device_profile, config, on_probe)
    n = search.largest(lambda k: search.probe(k).fits)
    plain_n = search.largest(search.plain_fits, within=n or search.first) if plain else 0
    found = search.reports.get(n)
    refused = search.refused_after(n)
    return LargestInput(
        input_shape=search.shape(n) if n else None, report=found,
        refused_shape=search.shape(refused) if refused else None,
        refused_because=search.probes[refused].why_not if refused else "",
        plain_input_shape=search.shape(plain_n) if plain_n else None, batch_size=batch_size,
        device_budget=budget, multiple=int(multiple), axes=axes, probes=search.made)


class _Search:
    """Probes on a ladder of shapes: rung ``k`` has the smallest grown axis at ``k * multiple`` and the other
    grown axes in proportion (rounded to the multiple); rung 0 fits nothing, by convention."""

    def __init__(self, model, batch_size, budget, start, axes, multiple, profile, config, on_probe):
        self.model, self.batch_size, self.budget, self.start = model, batch_size, budget, start
        self.axes, self.multiple, self.profile, self.config, self.on_probe = axes, multiple, profile, config, on_probe
        self.reference = min(axes, key=lambda a: start[a])
        self.first = max(1, round(start[self.reference] / multiple))
        self.probes, self.reports, self.made, self.plain = {}, {}, [], {}

    def shape(self, k: int) -> tuple:
        scale = k * self.multiple / self.start[self.reference]
        return tuple(self.multiple * max(1, round(d * scale / self.multiple)) if a in self.axes else d
                     for a, d in enumerate(self.start))

    def largest(self, fits, within: int | None = None) -> int:
        """The largest rung that ``fits`` (0: none): doubling from the first rung (or bisecting below
        ``within``, a rung known to fit the other search), then bisecting."""
        low, high = 0, None
        k = within if within is not None else self.first
        if fits(k):
            low = k
            if within is not None:
                return k
            while high is None:
                k *= 2
                if fits(k):
                    low = k
                else:
                    high = k
        else:
            high = k
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def refused_after(self, k: int) -> int | None:
        larger = [j for j, p in self.probes.items() if j > k and not p.fits]
        return min(larger) if larger else None

    def probe(self, k: int) -> Probe:
        if k in self.probes:
            return self.probes[k]
        shape = self.shape(k)
        batch_bytes = self.batch_size * math.prod(shape) * self._input_itemsize()
        if batch_bytes > self.budget:  # (no plan can hold less than its input batch: no need to ask)
            probe = Probe(shape, False, why_not=f"the input batch alone is {format_bytes(batch_bytes)}")
        else:
            try:
                rep = self._report(shape, self.budget)
            except BudgetError as err:
                probe = Probe(shape, False, why_not=str(err))
            else:
                totals = rep.totals
                self.plain[k] = rep.plain.budget_bytes <= self.budget
                probe = Probe(shape, totals["fits_device_budget"], totals["budget_peak_bytes"],
                              totals.get("predicted_step_seconds"))
                if probe.fits:
                    self.reports[k] = rep
                else:
                    probe.why_not = (f"predicted {format_bytes(totals['budget_peak_bytes'])} with the planner's "
                                     "margin" + (" (it fits without the margin: wrap plans it with a warning)"
                                                 if totals["fits_device_budget_without_margin"] else ""))
        self.probes[k] = probe
        self.made.append(probe)
        if self.on_probe is not None:
            self.on_probe(probe)
        return probe

    def plain_fits(self, k: int) -> bool:
        """Whether the plain step fits at rung ``k``: its predicted peak with the planner's margin (from a budget
        probe's report where one was made, else from a report without a budget)."""
        if k not in self.plain:
            self.plain[k] = self._report(self.shape(k), None).plain.budget_bytes <= self.budget
        return self.plain[k]

    def _report(self, shape: tuple, budget):
        # (the planner's warnings are about a probe, not the answer: a probe that fits only without the margin
        # says so in its ``why_not``)
        planner_log = logging.getLogger("keras_lms.planning")
        level = planner_log.level
        planner_log.setLevel(logging.ERROR)
        try:
            return report(self.model, self.batch_size, input_shape=shape, device_budget=budget,
                          config=self.config, device_profile=self.profile)
        except BudgetError:
            raise
        except (ValueError, RuntimeError, TypeError) as err:  # (how each back end's tracing says shapes clash)
            why = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(err)).split())
            raise ValueError(f"the model does not build at input shape {shape}. Give input_shape= a shape it builds "
                             "at and multiple= the step its axes must grow by (e.g. 16 for a U-Net of depth 4). "
                             f"Keras said: {why[:300]}") from err
        finally:
            planner_log.setLevel(level)

    def _input_itemsize(self) -> int:
        import numpy as np

        inputs = getattr(input_shapes.inner_model(self.model), "inputs", None) or []
        dtype = getattr(inputs[0], "dtype", None) if inputs else None
        return np.dtype(keras.backend.standardize_dtype(dtype or "float32")).itemsize


def _seconds(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def _shape_text(shape) -> str:
    return "x".join(map(str, shape))
