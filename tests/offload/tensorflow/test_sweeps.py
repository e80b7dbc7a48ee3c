"""Level sweeps (keras_lms/offload/tensorflow/sweeps.py, sweep_calls.py): runs of Conv -> BatchNorm -> ReLU units
differentiated in passes over slab windows recomputed from the run's input, against the plain model on the same
weights and seeds. The bytes and convolution FLOPs they move and recompute are measured in the executed graph by
tests/offload/tensorflow/test_link_traffic.py (the time-aware cases sweep; their "no sweeps" controls do not)."""

import collections

import keras
import numpy as np
import pytest

import keras_lms
from keras_lms.offload.tensorflow import pooling_folds, sweep_calls, sweeps
from keras_lms.offload.tensorflow.step_memory import FACTS
from tests.offload.tensorflow.test_slabs import SLAB, SLAB_TOL, bn_unet2d, float16_step_errors
from tests.oracle import compare_step

pytestmark = pytest.mark.tensorflow(reason="sweeps are the TensorFlow back end's slab mechanism")


def unet2d_biased(size=32, filters=4):
    """build_unet's blocks (Conv with bias -> BatchNorm -> ReLU -> Conv with a fused relu): one unit per level
    (m = 1), Dropout after the bottleneck (not local: it ends a run). 2D, because TensorFlow's CPU MaxPool3D
    has no float64 kernel; its own head (build_unet's is float32 in every policy)."""
    layers = keras.layers

    def block(x, f):
        x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(f, 3, padding="same")(x)))
        return layers.Conv2D(f, 3, padding="same", activation="relu")(x)

    inp = keras.Input((size, size, 1))
    skip = block(inp, filters)
    x = layers.Dropout(0.2)(block(layers.MaxPooling2D()(skip), 2 * filters))
    x = layers.Conv2DTranspose(filters, 2, strides=2, padding="same")(x)
    x = block(layers.Concatenate()([x, skip]), filters)
    return keras.Model(inp, layers.Conv2D(1, 1, activation="sigmoid")(x))


CASES = {  # name -> (model, input, slab size, units per run)
    "unet2d_two_units": (bn_unet2d, lambda: np.random.default_rng(3).random((4, 32, 32, 1)), SLAB, 2),
    "unet2d_one_unit_bias_dropout": (unet2d_biased, lambda: np.random.default_rng(0).random((4, 32, 32, 1)),
                                     SLAB, 1),
}


@pytest.fixture
def passes(monkeypatch):
    """Counts the passes that ran (A: the last activation's backward; B: each BatchNorm's)."""
    seen = collections.Counter()
    first, second = sweep_calls.SweepCalls._sweep_first_pass, sweep_calls.SweepCalls._sweep_second_pass

    def spy_first(self, run, *args):
        seen["A"] += 1
        seen["units"] = max(seen["units"], run.size)
        seen[f"windows {len(run.bounds)}"] += 1
        return first(self, run, *args)

    def spy_second(self, *args):
        seen["B"] += 1
        return second(self, *args)

    monkeypatch.setattr(sweep_calls.SweepCalls, "_sweep_first_pass", spy_first)
    monkeypatch.setattr(sweep_calls.SweepCalls, "_sweep_second_pass", spy_second)
    return seen


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(sweeps, "FORCED", True)


def swept_runs(plan) -> set:
    return {e.sweep for e in plan if e.sweep is not None}


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
@pytest.mark.parametrize("name", CASES)
def test_sweeps_are_exact_in_float64(name, dtype_policy, forced, passes):
    build, data, slab, units = CASES[name]
    keras.utils.set_random_seed(0)
    model = build()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=slab)
    runs = swept_runs(wrapped.plan(batch_size=len(data())))
    assert len(runs) >= 2 and {len(r) for r in runs} == {3 * units}, runs
    result = compare_step(model, wrapped, data())
    # ran: one pass A per run, one pass B per BatchNorm (the control below runs none)
    assert passes["A"] == len(runs) and passes["B"] == len(runs) * units and passes["units"] == units, passes
    assert max(result["grads"].values()) <= 1e-12 and max(result["state"].values()) <= 1e-12, result
    assert result["loss"] <= 1e-14 and result["outputs"] <= 1e-12, result


@pytest.fixture
def held_cuts(monkeypatch):
    """Holds every unit of every forced sweep (sweeps.HELD_FORCED) and counts the held rows the passes cut, per
    unit number."""
    monkeypatch.setattr(sweeps, "HELD_FORCED", True)
    cuts = collections.Counter()
    cut = sweep_calls._held_rows

    def spy(run, j, a, b):
        cuts[j] += 1
        return cut(run, j, a, b)

    monkeypatch.setattr(sweep_calls, "_held_rows", spy)
    return cuts


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
@pytest.mark.parametrize("name", CASES)
def test_held_units_are_exact_in_float64(name, dtype_policy, forced, held_cuts, passes):
    """sweeps.Sweep.held: pass A keeps the units' convolution outputs, the later passes slice them instead of
    convolving again; the step's values stay the plain model's (the control is the test above, nothing held)."""
    build, data, slab, units = CASES[name]
    keras.utils.set_random_seed(0)
    model = build()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=slab)
    plan = wrapped.plan(batch_size=len(data()))
    held = {e.sweep: e.sweep_held for e in plan if e.sweep}
    assert held and all(h == tuple(range(1, units + 1)) for h in held.values()), held
    assert all("held on the device between the passes" in plan[i].reason for run in held for i in run)
    result = compare_step(model, wrapped, data())
    # pass B_j cuts unit j's rows (and, for j > 1, unit j-1's); per run and window at least once per held unit
    assert passes["A"] == len(held) and sorted(held_cuts) == list(range(1, units + 1)), (passes, held_cuts)
    assert max(result["grads"].values()) <= 1e-12 and max(result["state"].values()) <= 1e-12, result
    assert result["loss"] <= 1e-14 and result["outputs"] <= 1e-12, result


def test_held_units_match_the_plain_model_in_float32_and_float16(forced, held_cuts, passes):
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    result = compare_step(model, keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB),
                          np.random.default_rng(3).random((4, 32, 32, 1)))
    assert passes["A"] >= 2 and held_cuts[1] and held_cuts[2], (passes, held_cuts)
    assert max(result["grads"].values()) <= SLAB_TOL and max(result["state"].values()) <= SLAB_TOL, result
    before = sum(held_cuts.values())
    try:
        plain_error, held_error = float16_step_errors(
            lambda m: keras_lms.wrap(m, min_bytes=0, keep_last=0, slab_bytes=SLAB))
    finally:
        keras.config.set_dtype_policy("float32")
    assert sum(held_cuts.values()) > before  # (build_unet's blocks: one unit per run, held)
    assert 0 < plain_error < 0.1 and held_error <= 1.25 * plain_error, (plain_error, held_error)


def test_no_sweep_without_a_profile_or_when_disabled(passes, monkeypatch):
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    assert not swept_runs(keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB).plan(batch_size=4))
    monkeypatch.setattr(sweeps, "ENABLED", False)
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB, device_profile="h100-pcie5")
    assert not swept_runs(wrapped.plan(batch_size=4))
    compare_step(model, wrapped, np.random.default_rng(3).random((4, 32, 32, 1)))
    assert passes["A"] == passes["B"] == 0  # the control: the per-call slab backward ran


@pytest.mark.parametrize("name", CASES)
def test_sweeps_match_the_plain_model_in_float32(name, forced, passes):
    build, data, slab, _ = CASES[name]
    keras.utils.set_random_seed(0)
    model = build()
    result = compare_step(model, keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=slab), data())
    assert passes["A"] >= 2
    assert max(result["grads"].values()) <= SLAB_TOL and max(result["state"].values()) <= SLAB_TOL, result
    assert result["loss"] <= 1e-6


def test_the_planner_sweeps_on_a_pcie_profile():
    """The time-aware plan sweeps the slab-computed levels where that shortens the predicted step on
    H100-PCIe5 (recomputing from the level's input costs less than the host link), and says so per call."""
    keras.utils.set_random_seed(0)
    wrapped = keras_lms.wrap(bn_unet2d(), min_bytes=0, keep_last=0, slab_bytes=SLAB, device_profile="h100-pcie5")
    plan = wrapped.plan(batch_size=4)
    runs = swept_runs(plan)
    assert runs, plan
    for run in runs:
        classes = [plan[i].layer_class for i in run]
        assert classes == ["Conv2D", "BatchNormalization", "ReLU"] * (len(run) // 3)
        assert all("level sweep" in plan[i].reason and "h100-pcie5" in plan[i].reason for i in run)
        # inside the run nothing is copied: its calls' activations are recomputed in the passes
        assert all(plan[i].decision == "recompute" and plan[i].new_host_bytes == 0 for i in run[1:]), plan


def test_a_budget_with_room_gets_windows_as_thick_as_the_slabs(passes, monkeypatch):
    """``plan_sweep_windows``: where the memory model, with the budget margin, has room for them, a sweep's
    windows are as thick as its units' slabs (half as many windows, half the halo rows recomputed); without a
    budget they stay half a slab thick. The step runs the planned windows, and stays exact. (Without folded
    poolings where no level is swept, ``pooling_folds``: with them this small model's budgeted plan takes other
    slabs and keeps calls instead, and the windows are not comparable.)"""
    monkeypatch.setattr(pooling_folds, "ENABLED", False)
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    common = dict(min_bytes=0, keep_last=0, slab_bytes=SLAB, device_profile="h100-pcie5")
    default = keras_lms.wrap(model, **common)
    thin = {e.sweep: e.sweep_windows for e in default.plan(batch_size=4) if e.sweep}
    # (room above the default's peak for windows twice as thick; 1.15x was enough before the level-0 pooling's
    # gradient was folded into the sweep, which lowered the default's peak by a fifth)
    budget = int(keras_lms.report(default, batch_size=4).totals["predicted_peak_bytes_wrapped"] * 1.4)
    wrapped = keras_lms.wrap(model, device_budget=budget, **common)
    plan = wrapped.plan(batch_size=4)
    thick = {e.sweep: e.sweep_windows for e in plan if e.sweep}
    # (with the budget the planner may keep a level on the device, which is then not swept: the runs it does
    # sweep are compared)
    assert thick and all(thin[run] == 2 * windows for run, windows in thick.items()), (thin, thick)
    assert all(f"over {thick[plan[i].sweep]} slab windows" in plan[i].reason for run in thick for i in run)
    assert keras_lms.report(wrapped, batch_size=4).totals["budget_peak_bytes"] <= budget
    result = compare_step(model, wrapped, np.random.default_rng(3).random((4, 32, 32, 1)))
    assert {k: v for k, v in passes.items() if k.startswith("windows")} == {
        f"windows {w}": list(thick.values()).count(w) for w in set(thick.values())}, passes
    assert max(result["grads"].values()) <= SLAB_TOL and max(result["state"].values()) <= SLAB_TOL, result


def test_a_budget_with_room_holds_units_and_the_step_is_faster(monkeypatch):
    """``plan_sweep_windows(holds=True)`` on the finished plan: with room in the budget a sweep holds its units'
    convolution outputs (the plan says which, and why), the predicted step is shorter than the same budget's plan
    without holds (the control), the memory model still fits, and the step runs them and matches plain. (Without
    folded poolings where no level is swept: with them this small model's budgeted plan keeps calls instead.)"""
    monkeypatch.setattr(pooling_folds, "ENABLED", False)
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    common = dict(min_bytes=0, keep_last=0, slab_bytes=SLAB, device_profile="h100-pcie5")
    peak = keras_lms.report(keras_lms.wrap(model, **common), batch_size=4).totals["predicted_peak_bytes_wrapped"]
    budget = int(peak * 1.5)

    def planned():
        wrapped = keras_lms.wrap(model, device_budget=budget, **common)
        rep = keras_lms.report(wrapped, batch_size=4, device_profile="h100-pcie5")
        return wrapped, wrapped.plan(batch_size=4), rep

    wrapped, plan, rep = planned()
    held = {e.sweep: e.sweep_held for e in plan if e.sweep and e.sweep_held}
    assert held, plan
    assert all("held on the device between the passes" in plan[i].reason for run in held for i in run)
    assert rep.totals["budget_peak_bytes"] <= budget
    cuts = collections.Counter()
    cut = sweep_calls._held_rows
    monkeypatch.setattr(sweep_calls, "_held_rows", lambda run, j, a, b: cuts.update([j]) or cut(run, j, a, b))
    result = compare_step(model, wrapped, np.random.default_rng(3).random((4, 32, 32, 1)))
    assert set(cuts) == set().union(*held.values()), cuts
    assert max(result["grads"].values()) <= SLAB_TOL and max(result["state"].values()) <= SLAB_TOL, result
    monkeypatch.setattr(sweeps, "hold_options", lambda calls, units: ())  # the control: nothing may be held
    _, control_plan, control = planned()
    assert not any(e.sweep_held for e in control_plan)
    held_time, control_time = rep.times["as planned"], control.times["as planned"]
    # (-2% at this size before the pooling's gradient was folded into the sweep; now the tiny step waits on its
    # copies either way, and the holds shorten its recompute)
    assert held_time.recompute_seconds < control_time.recompute_seconds
    assert held_time.step_seconds <= control_time.step_seconds


def test_only_the_runs_input_comes_back_for_a_sweep(forced):
    """The traffic model: a swept run's calls bring nothing back for their own backward; the passes read the
    run's input windows (charged to the last activation and the BatchNorms), and fewer bytes in all."""
    keras.utils.set_random_seed(0)
    wrapped = keras_lms.wrap(bn_unet2d(), min_bytes=0, keep_last=0, slab_bytes=SLAB)
    report = keras_lms.report(wrapped, batch_size=4, input_shape=(32, 32, 1))
    plan = wrapped.plan(batch_size=4)
    runs = sorted(swept_runs(plan))
    assert runs
    by_layer = {r["layer"]: r for r in report.rows}
    for run in runs:
        conv1, bn1, act1, conv2, bn2, act2 = (plan[i] for i in run)
        for entry in (act1, conv2):  # (conv1's forward may read a skip's windows from its copy)
            assert by_layer[entry.layer]["host_to_device_bytes"] == 0, entry
        assert by_layer[act2.layer]["host_to_device_bytes"] > 0  # pass A reads the input's windows
        assert by_layer[bn1.layer]["host_to_device_bytes"] > 0 and by_layer[bn2.layer]["host_to_device_bytes"] > 0


def test_mixed_precision_sweeps_add_no_error_beyond_float16(mixed_precision, forced, passes):
    """Against the same step in float32 (no Dropout), the swept float16 step is as close as the plain float16
    step, as slabs are (tests/offload/tensorflow/test_slabs.py)."""
    plain_error, swept_error = float16_step_errors(
        lambda model: keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB))
    assert passes["A"] >= 1
    assert 0 < plain_error < 0.1 and swept_error <= 1.25 * plain_error, (plain_error, swept_error)


def test_sweep_candidates_need_exact_row_convolutions_and_single_readers(forced):
    """Where a run stops: a BatchNorm whose output a second layer reads, a fused activation, Dropout."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 32, 2))
    c = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inp)
    b = keras.layers.BatchNormalization()(c)
    r = keras.layers.ReLU()(b)
    side = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(r)  # fused activation: no unit
    c2 = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(side)
    b2 = keras.layers.BatchNormalization()(c2)
    out = keras.layers.Add()([keras.layers.ReLU()(b2), b2])  # b2 read twice: no unit
    model = keras.Model(inp, keras.layers.GlobalAveragePooling2D()(out))
    plan = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes="4KiB").plan(batch_size=2)
    runs = swept_runs(plan)
    assert [[plan[i].layer_class for i in run] for run in runs] == [["Conv2D", "BatchNormalization", "ReLU"]]
    assert FACTS.forced_sweeps() is True


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
def test_a_long_run_is_split_and_stays_exact(dtype_policy, forced, passes):
    """Three units in a row: a run of two (sweeps.MAX_UNITS) and one of one, whose first convolution recomputes
    its input from the first run's last BatchNorm input copy (a fused chain across the runs)."""
    keras.utils.set_random_seed(0)
    x = inp = keras.Input((32, 32, 2))
    for _ in range(3):
        x = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3, padding="same")(x)))
    model = keras.Model(inp, keras.layers.Conv2D(1, 1)(x))
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes="8KiB")
    plan = wrapped.plan(batch_size=2)
    assert sorted(len(r) for r in swept_runs(plan)) == [3, 6], plan
    between = [e for e in plan if e.recompute_from is not None and not (e.sweep and e.recompute_from[0] in e.sweep)]
    assert between and all(plan[e.recompute_from[0]].new_host_bytes > 0 for e in between)  # that copy is read
    result = compare_step(model, wrapped, np.random.default_rng(1).random((2, 32, 32, 2)))
    assert passes["A"] == 2 and passes["B"] == 3, passes
    assert max(result["grads"].values()) <= 1e-12 and max(result["state"].values()) <= 1e-12, result


def test_a_run_the_step_cannot_sweep_falls_back_with_a_warning(forced, passes, monkeypatch, caplog):
    """If the traced step lacks what the passes need (here: forced), the run's calls keep their per-call slab
    backward, the step stays right, and the log says why."""
    monkeypatch.setattr(sweep_calls, "_unsweepable", lambda records: "a reason for the test")
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB)
    assert swept_runs(wrapped.plan(batch_size=4))
    with caplog.at_level("WARNING", logger="keras_lms.offload.tensorflow.sweep_calls"):
        result = compare_step(model, wrapped, np.random.default_rng(3).random((4, 32, 32, 1)).astype("float32"))
    assert passes["A"] == passes["B"] == 0
    assert "runs call by call instead: a reason for the test" in caplog.text
    assert max(result["grads"].values()) <= SLAB_TOL, result


def test_unmarking_a_run_keeps_the_reasons_added_after_it():
    """refine_sweeps may turn a run off after the recomputed tensors' notes were appended to the same reasons:
    only the sweep's own note goes."""
    from types import SimpleNamespace

    from keras_lms.planning import sweep_plan
    from keras_lms.planning.plan import PlanEntry

    calls = [SimpleNamespace(unit=SimpleNamespace(name=n)) for n in ("conv", "bn", "relu")]
    entries = [PlanEntry(i, c.unit.name, "X", [], [], 0, True, f"offloaded {i}") for i, c in enumerate(calls)]
    run = sweeps.Sweep(((0, 1, 2),), 8, (8, 4))
    config = SimpleNamespace(device_profile=SimpleNamespace(name="h100-pcie5"))
    sweep_plan._mark_sweeps(calls, entries, [run], {0: 8}, config)
    assert all(e.sweep == (0, 1, 2) and e.sweep_windows == 8 and "level sweep" in e.reason for e in entries)
    for e in entries:
        e.reason += "; a later note"
    sweep_plan._mark_sweeps(calls, entries, [run], {0: 4}, config)  # thicker windows: the note says so
    assert all(e.sweep_windows == 4 and "over 4 slab windows" in e.reason
               and e.reason.endswith("(faster on h100-pcie5)") for e in entries)
    sweep_plan._mark_sweeps(calls, entries, [run], {}, config)
    assert [e.reason for e in entries] == [f"offloaded {i}; a later note" for i in range(3)]
    assert all(e.sweep is None and e.sweep_windows is None for e in entries)


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
@pytest.mark.parametrize("fold", [True, False])
def test_the_skip_poolings_gradient_is_taken_in_the_first_pass(dtype_policy, forced, passes, fold, monkeypatch):
    """``Sweep.folded``: the max pooling that reads a swept encoder level's output (beside the decoder's
    concatenation) hands its output gradient to the run's pass A, which adds the pooling's input gradient window
    by window; the step stays exact. The control (``FOLD_POOLING = False``) differentiates the pooling itself."""
    monkeypatch.setattr(sweeps, "FOLD_POOLING", fold)
    seen = collections.Counter()
    take, rows = sweep_calls.SweepCalls._fold_into_sweep, sweep_calls.SweepCalls._folded_pooling_rows
    monkeypatch.setattr(sweep_calls.SweepCalls, "_fold_into_sweep",
                        lambda self, *args: seen.update(["handed"]) or take(self, *args))
    monkeypatch.setattr(sweep_calls.SweepCalls, "_folded_pooling_rows",
                        lambda self, *args: seen.update(["windows"]) or rows(self, *args))
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB)
    plan = wrapped.plan(batch_size=4)
    folded = {e.sweep: e.sweep_folded for e in plan if e.sweep_folded}
    result = compare_step(model, wrapped, np.random.default_rng(3).random((4, 32, 32, 1)))
    if fold:
        assert len(folded) == 1 and all(stride == 2 for _, stride in folded.values()), folded
        pooling = next(iter(folded.values()))[0]
        assert "taken in" in plan[pooling].reason and "level sweep" in plan[pooling].reason
        windows = next(e.sweep_windows for e in plan if e.sweep in folded)
        assert seen == {"handed": 1, "windows": windows}, (seen, windows)
    else:
        assert not folded and not seen
    assert max(result["grads"].values()) <= 1e-12 and max(result["state"].values()) <= 1e-12, result
    assert result["loss"] <= 1e-14 and result["outputs"] <= 1e-12, result


def _executed_backward_ops(model, x, op_type) -> int:
    """How many ``op_type`` nodes the backward of one step runs in the graph grappler optimises (one device)."""
    from tests.offload.tensorflow.executed_graph import run_step

    executed = run_step(model, x, device=None)
    return sum(1 for name in executed.backward if executed.nodes[name].op == op_type)


@pytest.mark.parametrize("held", [False, True], ids=["recomputed", "held"])
def test_pass_b_runs_no_activation_of_its_own_unit(forced, held, monkeypatch):
    """The step-time model charges pass B_j BatchNorm j's element-wise work and not activation j's
    (``slab_costs.sweep_traffic``), because ``sweep_calls`` never calls activation j there: per window, pass A
    activates both units of a two-unit run, pass B_2 the unit below (its output is convolution 2's input and
    gives activation 1's gradient), pass B_1 none (it reads the run's input). In the graph grappler optimises,
    the backward runs the ReLU kernel 3 times per window, held units or not; the model charged 5 before
    (session 30). The forward's ReLUs are not counted (not downstream of the output gradient)."""
    monkeypatch.setattr(sweeps, "HELD_FORCED", held)
    layers = keras.layers
    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 32, 1))
    x = inp
    for _ in range(2):
        x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(4, 3, padding="same", use_bias=False)(x)))
    model = keras.Model(inp, layers.Dense(1)(layers.GlobalAveragePooling2D()(x)))
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB)
    plan = wrapped.plan(batch_size=4)
    (run,) = swept_runs(plan)
    windows = plan[run[0]].sweep_windows
    assert len(run) == 6 and windows >= 2 and bool(plan[run[0]].sweep_held) == held, plan[run[0]]
    relus = _executed_backward_ops(wrapped, np.random.default_rng(0).random((4, 32, 32, 1)), "Relu")
    assert relus == 3 * windows, (relus, windows)
