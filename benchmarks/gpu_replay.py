"""The step-time model against a recorded GPU run: today's predictions beside the steps that were measured.

    KERAS_BACKEND=torch python -m benchmarks.gpu_replay docs/gpu_runs/2026-12-04-h200
    KERAS_BACKEND=torch python -m benchmarks.gpu_replay docs/gpu_runs/2026-12-04-h200 --profile other.json --out /tmp/r

Why: a GPU is lent to few sessions, so a change to the step-time model must be checkable on a CPU against what a
GPU already measured. ``benchmarks/gpu_bench.py`` recorded, per edge, the measured step of the plain model, the
offload-only plan (``wrap`` defaults) and the time-aware plan (``wrap(device_profile=<calibrated>)``) with the
bytes each copied; ``benchmarks/gpu_step_profile.py`` recorded where the plain step's GPU time went, by kernel
class. This plans the same models again on the CPU (planning needs shapes only), predicts them with the model as
it is now on ``--profile`` (default: the run's ``profile-by-channels.json`` if there is one, else its
``profile.json``), and prints measured / predicted per plan, the report's prediction at the time of the run
beside it, and the plain step's kernel classes against the model's. The replayed plans must be the plans that ran:
their predicted bytes are checked against the bytes the offloader counted on the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_lms
from benchmarks.gpu_bench_measure import build_pair, wrap_time_aware
from keras_lms.planning import copy_back_leads
from keras_lms.planning.call_costs import call_cost
from keras_lms.planning.device_profile import load_profile

GIB = 1 << 30


def _predicted(wrapped, batch: int, profile) -> tuple:
    rep = keras_lms.report(wrapped, batch_size=batch, device_profile=profile)
    return rep.times["plain"], rep.times["as planned"]


@contextlib.contextmanager
def planned_as_it_ran(run: dict):
    """Plan as the recorded run's planner did: runs recorded before per-call copy-back leads
    (``planning.copy_back_leads``, session 28) started every copy back at the plan's depth, and replaying them
    with leads would predict a plan that never ran (the 168^3 time-aware plan: 110 ms with leads, 119 without,
    192 measured)."""
    saved = copy_back_leads.COPY_BACK_LEADS
    copy_back_leads.COPY_BACK_LEADS = bool(run["meta"].get("copy_back_leads", False))
    try:
        yield
    finally:
        copy_back_leads.COPY_BACK_LEADS = saved


def replay_timing(run: dict, profile, planned_for) -> list:
    """Per recorded edge and plan: measured ms, predicted ms then and now, and the bytes check."""
    with planned_as_it_ran(run):
        return _replay_timing(run, profile, planned_for)


def _replay_timing(run: dict, profile, planned_for) -> list:
    meta, rows = run["meta"]["args"], []
    for entry in run["timing"]:
        edge = entry["edge"]
        model, wrapped = build_pair(edge, argparse.Namespace(**meta), wrap=True)  # as gpu_bench built them
        plain, offload_only = _predicted(wrapped, meta["batch"], profile)
        _, timed = _predicted(wrap_time_aware(model, meta["min_bytes"], planned_for), meta["batch"], profile)
        for plan, measured, then, now, copied in (
                ("plain", entry["plain_ms"], entry.get("predicted_plain_ms"), plain, 0.0),
                ("offload-only", entry["lms_ms"], entry.get("predicted_lms_ms"), offload_only, entry["d2h_gib"]),
                ("time-aware", entry.get("timed_ms"), entry.get("predicted_timed_ms"), timed,
                 entry.get("timed_d2h_gib"))):
            if measured is None:
                continue
            rows.append({"edge": edge, "plan": plan, "measured_ms": measured, "predicted_then_ms": then,
                         "predicted_ms": now.step_seconds * 1e3,
                         "measured_over_predicted": measured / (now.step_seconds * 1e3),
                         "exposed_ms": now.exposed_seconds * 1e3,
                         "same_plan": copied is None or abs(now.device_to_host_bytes / GIB - copied) < 1e-3})
    return rows


def model_classes(edge: int, meta: dict, profile) -> dict:
    """The plain step's predicted seconds by kind of work: convolutions, element-wise, layout copies."""
    from keras_lms import offload, planning

    _, wrapped = build_pair(edge, argparse.Namespace(**meta), wrap=True)
    backend = offload.active_backend()
    step = planning.plan_step(backend, wrapped.inner_model, wrapped.lms_structure, wrapped.lms_config,
                              backend.example_inputs(wrapped.inner_model, meta["batch"]), {}, meta["batch"], None)
    classes = {"convolution": 0.0, "element-wise": 0.0, "layout copies": 0.0}
    for call in step.calls:
        cost = call_cost(call, meta["batch"], step.facts)
        flops = cost.forward_flops + cost.backward_flops
        classes["convolution"] += flops / profile.flops_rate(cost.dtype, cost.channels)
        classes["element-wise"] += (cost.forward_bytes + cost.backward_bytes) / profile.elementwise_bytes_per_second
        layout = cost.forward_layout_bytes + cost.backward_layout_bytes
        classes["layout copies"] += layout / profile.layout_copy_rate()
    return classes


def compare_classes(summary: dict, predicted: dict) -> list:
    """The plain step's measured kernel classes (gpu_step_profile) against the model's."""
    measured = summary["modes"]["plain"]["by_class_s"]
    groups = {"convolution": ("convolution",),
              "element-wise": ("element-wise", "reductions", "normalization", "other"),
              "layout copies": ("copies (permute/contiguous)", "layout (cuDNN)")}
    rows = [{"class": name, "measured_ms": sum(measured.get(k, 0.0) for k in keys) * 1e3,
             "predicted_ms": predicted[name] * 1e3, "measured_classes": list(keys)} for name, keys in groups.items()]
    busy = summary["modes"]["plain"]["compute_busy_s"]
    rows.append({"class": "GPU busy (all compute kernels)", "measured_ms": busy * 1e3,
                 "predicted_ms": sum(predicted.values()) * 1e3, "measured_classes": ["compute_busy_s"]})
    return rows


def markdown(rows: list, classes: list, profile_name: str) -> str:
    lines = [f"Predicted on `{profile_name}`; *then* is the report's prediction in the GPU run itself.", "",
             "| edge | plan | measured ms | predicted ms then | predicted ms now | measured / now | same plan |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        then = "-" if r["predicted_then_ms"] is None else f"{r['predicted_then_ms']:.1f}"
        lines.append(f"| {r['edge']}^3 | {r['plan']} | {r['measured_ms']:.1f} | {then} | {r['predicted_ms']:.1f} | "
                     f"{r['measured_over_predicted']:.2f} | {'yes' if r['same_plan'] else 'NO'} |")
    if classes:
        lines += ["", "| plain step, by kind of work | measured ms | predicted ms |", "|---|---|---|"]
        lines += [f"| {c['class']} | {c['measured_ms']:.1f} | {c['predicted_ms']:.1f} |" for c in classes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a gpu_bench output folder (results.json, profile.json, step_profile/)")
    parser.add_argument("--profile", help="the profile to predict on (default: the run's profile-by-channels.json "
                                          "or profile.json)")
    parser.add_argument("--out", help="write replay.json and replay.md into this folder")
    args = parser.parse_args(argv)
    run_dir = pathlib.Path(args.run)
    run = json.loads((run_dir / "results.json").read_text())
    default = run_dir / "profile-by-channels.json"
    profile = load_profile(args.profile or str(default if default.exists() else run_dir / "profile.json"))
    planned_for = load_profile(str(run_dir / "profile.json"))  # what the GPU run made its time-aware plan for
    rows = replay_timing(run, profile, planned_for)
    classes = []
    summary_path = run_dir / "step_profile" / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        meta = dict(run["meta"]["args"], depth=summary["depth"], base_filters=summary["base_filters"],
                    batch=summary["batch"])
        classes = compare_classes(summary, model_classes(summary["edge"], meta, profile))
    text = markdown(rows, classes, profile.name)
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_text(json.dumps({"profile": profile.name, "timing": rows, "classes": classes},
                                                    indent=1) + "\n")
        (out / "replay.md").write_text(text)
    return 0 if all(r["same_plan"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
