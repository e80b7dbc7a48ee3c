"""``--elastic``: the segmentation examples under elastic Horovod (ranks may join, leave or die mid-run).

    horovodrun --gloo -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \\
        python examples/segmentation_3d.py --elastic --volume 64 --epochs 10

What changes against ``--horovod`` (docs/horovod.md, "Elastic training"): the model and optimizer live in a
``keras_lms.horovod.elastic.KerasState`` committed (in host memory) after every ``--commit-every`` batches and
every epoch; the data shards, callbacks and learning rate are rebuilt inside the function that
``hvd.elastic.run`` re-runs after every reset, from the *current* rank and number of ranks. That is how a dataset
is re-sharded after a reset: build the shard inside the decorated function, never outside it.
"""

from __future__ import annotations

if __package__:  # imported as examples.elastic
    from . import data as data_lib
    from .callbacks import make_callbacks
    from .runtime import Runtime
else:  # python examples/segmentation_3d.py: examples/ is on sys.path
    import data as data_lib
    from callbacks import make_callbacks
    from runtime import Runtime


def current_runtime() -> Runtime:
    """This process' place in the job *now* (it changes at every reset)."""
    import keras_lms.horovod as hvd  # only with --elastic: Horovod needs the TensorFlow back end

    return Runtime(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), hvd=hvd)


def fit_elastic(args, task, model, out, history: list, meta: dict, initial_epoch: int, log=print) -> dict:
    """Train ``model`` elastically from ``initial_epoch`` to ``args.epochs``; returns the last fit's history."""
    import keras_lms.horovod as hvd  # only with --elastic: Horovod needs the TensorFlow back end

    state = hvd.elastic.KerasState(model, batch=0, epoch=initial_epoch)
    # The learning rate follows the number of ranks (the warm-up and schedule callbacks are rebuilt, too).
    state.register_reset_callbacks([
        lambda: model.optimizer.learning_rate.assign(args.lr * hvd.size()),
        lambda: log(f"elastic reset: now {hvd.size()} rank(s); resuming at epoch {state.epoch}, batch {state.batch}"),
    ])
    result = {}

    @hvd.elastic.run
    def train(state):
        rt = current_runtime()
        train_ds, val_ds, _ = data_lib.datasets_for(args, task, rt.rank, rt.size)
        train_data, val_data = data_lib.fit_inputs(args, train_ds, val_ds)
        callbacks = [
            hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=args.commit_every),
        ] + make_callbacks(args, rt, out, history, resumed=state.epoch > 0, meta=meta, train_ds=train_ds)
        if state.epoch < args.epochs:
            with data_lib.data_errors_in_one_line(train_ds, val_ds):
                result["history"] = model.fit(train_data, validation_data=val_data, epochs=args.epochs,
                                              initial_epoch=state.epoch, callbacks=callbacks,
                                              verbose=args.verbose if rt.is_root else 0).history
        return result.get("history", {})

    return train(state)
