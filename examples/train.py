"""The training run of the segmentation examples, top to bottom: flags, data, model, fit, artefacts.

:func:`run` is what ``segmentation_3d.py`` and ``segmentation_2d.py`` call with their :class:`~examples.cli.Task`;
:func:`dry_run` (``--dry-run``) builds and saves the model and prints its activation report instead of training.
"""

from __future__ import annotations

import pathlib
import time

import keras_lms

if __package__:  # imported as examples.train (python -m examples.segmentation_3d, the tests)
    from . import data as data_lib
    from .artefacts import write_artefacts
    from .callbacks import make_callbacks
    from .cli import Task, parse_args
    from .elastic import fit_elastic
    from .runtime import Runtime, broadcast_int, build_model, setup_runtime, wrap_kwargs
    from .state import CHECKPOINT, STATE, jsonable, read_state
else:  # python examples/segmentation_3d.py: examples/ is on sys.path
    import data as data_lib
    from artefacts import write_artefacts
    from callbacks import make_callbacks
    from cli import Task, parse_args
    from elastic import fit_elastic
    from runtime import Runtime, broadcast_int, build_model, setup_runtime, wrap_kwargs
    from state import CHECKPOINT, STATE, jsonable, read_state


def run(task: Task, argv=None) -> dict | None:
    """Parse flags, train, write artefacts; returns the summary on rank 0 (None elsewhere)."""
    args = parse_args(task, argv)
    rt = setup_runtime(args)
    out = pathlib.Path(args.out)
    if rt.is_root:
        out.mkdir(parents=True, exist_ok=True)

    train_ds, val_ds, channels = data_lib.datasets_for(args, task, rt.rank, rt.size)

    if args.dry_run:
        return dry_run(args, task, channels, rt, out) if rt.is_root else None

    state = read_state(out, args, task) if args.resume else None
    if args.resume and state is None:
        rt.log(f"--resume: no {CHECKPOINT} + {STATE} in {out}; starting from scratch.")
    # Elastic: no collective may run before hvd.elastic.run's sync (a joining worker would pair it with the
    # others' sync); the state's sync gives every rank rank 0's epoch instead.
    saved_epoch = state["epoch"] if state else 0
    initial_epoch = saved_epoch if args.elastic else broadcast_int(rt, saved_epoch)
    # Every rank that can read the checkpoint loads it; a rank that cannot (no shared file system) starts from
    # fresh weights, which BroadcastGlobalVariablesCallback replaces by rank 0's before the first update.
    restore = out / CHECKPOINT if initial_epoch and (out / CHECKPOINT).exists() else None
    model, base = build_model(args, task, channels, rt, restore)
    history = list(state.get("history", [])) if state else []
    if initial_epoch:
        rt.log(f"Resuming from {out / CHECKPOINT} after epoch {initial_epoch}.")

    global_batch = args.batch_size * rt.size
    rt.log(f"{task.name}: input {task.spatial_shape(args) + (channels,)}, {rt.size} rank(s) x batch "
           f"{args.batch_size} = global batch {global_batch}, {train_ds.steps} steps/epoch, "
           f"{'LMS ' + str(wrap_kwargs(args) or 'defaults') if args.lms else 'no LMS'}, "
           f"data: {args.data_dir or 'synthetic'}, out: {out}")
    meta = {"example": task.name, "args": vars(args)}

    t0 = time.perf_counter()
    fit_history = {}
    if args.elastic:  # the data, callbacks and rank are rebuilt at every reset
        fit_history = fit_elastic(args, task, model, out, history, meta, initial_epoch, log=rt.log)
        rt = type(rt)(rank=rt.hvd.rank(), size=rt.hvd.size(), local_rank=rt.hvd.local_rank(), hvd=rt.hvd)
    elif initial_epoch < args.epochs:
        train_data, val_data = data_lib.fit_inputs(args, train_ds, val_ds)
        callbacks = make_callbacks(args, rt, out, history, resumed=bool(initial_epoch), meta=meta,
                                   train_ds=train_ds)
        with data_lib.data_errors_in_one_line(train_ds, val_ds):
            fit_history = model.fit(train_data, validation_data=val_data, epochs=args.epochs,
                                    initial_epoch=initial_epoch, callbacks=callbacks,
                                    verbose=args.verbose if rt.is_root else 0).history
    else:
        rt.log(f"Already trained for {initial_epoch} >= --epochs {args.epochs} epochs; nothing to train.")
    train_seconds = time.perf_counter() - t0
    if not rt.is_root:
        return None
    return write_artefacts(args, task, model, base, val_ds, history, fit_history, train_seconds, rt, out,
                           initial_epoch, channels)


def dry_run(args, task: Task, channels: int, rt: Runtime, out: pathlib.Path) -> dict:
    """Build and save the model for these flags, print what keras-lms predicts for one training step."""
    model, _ = build_model(args, task, channels, Runtime(), None)  # a single-rank optimizer is enough here
    model.optimizer.build(model.trainable_variables)  # saved with its slots: loads without warnings
    model.save(out / "model.keras")
    rep = keras_lms.report(model, batch_size=args.batch_size)
    rep.plot(out / "activation_report.png")
    text = rep.to_text()
    (out / "activation_report.txt").write_text(text + "\n")
    print(text)
    print(f"model written to {out / 'model.keras'}; e.g. keras-lms report {out / 'model.keras'} "
          f"--batch-size {args.batch_size} --budget 6GiB --plot {out / 'report.png'}")
    return {k: jsonable(v) for k, v in rep.totals.items()}
