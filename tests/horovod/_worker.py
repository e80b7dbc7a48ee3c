"""One Horovod rank of the multi-rank test suite (run under horovodrun/mpirun, or plain python = 1 rank).

Usage: python tests/horovod/_worker.py OUTDIR

Runs every scenario in one process (TensorFlow start-up costs ~5 s per process, so one launch per
controller) and writes OUTDIR/rank<r>.json; tests/horovod/test_multirank.py asserts on those files.
Single-process references (one rank, global batch) are computed in the same process with plain Keras.
Every scenario is wrapped so one failure is recorded instead of aborting the others; an exception inside a
scenario that already entered a collective would hang, so scenarios only raise before collectives.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")  # start_timeline()/stop_timeline() in api_parity

import keras
import numpy as np

import keras_lms.horovod as lhvd

OUT = sys.argv[1]
_LAUNCHED = int(os.environ.get("HOROVOD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
# One process set per rank (a set equal to the global one is refused by Horovod), for the process_sets scenario.
PROCESS_SETS = [lhvd.ProcessSet([r]) for r in range(_LAUNCHED)] if _LAUNCHED == 2 else None
INFO = lhvd.init(process_sets=PROCESS_SETS)
R, S = lhvd.rank(), lhvd.size()
RESULTS: dict = {"info": INFO.as_dict(), "errors": {}}

N, D, B, EPOCHS, LR = 64, 8, 8, 3, 0.05  # per-rank batch B, global batch S*B
RNG = np.random.default_rng(123)
X = RNG.normal(size=(N, D)).astype("float32")
Y = (X @ RNG.normal(size=(D, 1)) + 0.1 * RNG.normal(size=(N, 1))).astype("float32")
TOKENS = RNG.integers(0, 20, size=(N, 3)).astype("int32")  # inputs for the Embedding (sparse gradient) model


def shard(a, rank=R, size=S, b=B):
    """Rank ``rank``'s part of every global batch of ``size*b`` consecutive samples (order preserved)."""
    g = size * b
    return np.concatenate([a[k * g + rank * b: k * g + (rank + 1) * b] for k in range(len(a) // g)])


def flat(weights) -> list:
    return np.concatenate([np.asarray(w, dtype="float64").ravel() for w in weights]).tolist()


def digest(weights) -> str:
    h = hashlib.sha256()
    for w in weights:
        h.update(np.ascontiguousarray(np.asarray(w)).tobytes())
    return h.hexdigest()


def dense_model(seed):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((D,))
    h = keras.layers.Dense(16, activation="tanh")(inp)
    return keras.Model(inp, keras.layers.Dense(1)(h))


def embedding_model(seed):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((3,), dtype="int32")
    h = keras.layers.Flatten()(keras.layers.Embedding(20, 4)(inp))
    return keras.Model(inp, keras.layers.Dense(1)(h))


def sgd(lr=LR, momentum=0.9):
    return keras.optimizers.SGD(lr, momentum=momentum)


class Recorder(keras.callbacks.Callback):
    """Per-epoch weight digests/values, logs as seen at this position, lr and momentum norms per batch."""

    def __init__(self):
        super().__init__()
        self.epoch_digests, self.epoch_weights, self.logs, self.first_batch_digest = [], [], [], None
        self.lr, self.mom_begin, self.mom_end = [], [], []
        self._epoch = 0

    def _mom(self):
        opt = self.model.optimizer
        ms = getattr(opt, "momentums", []) if opt.built else []
        return float(sum(np.sum(np.asarray(m) ** 2) for m in ms)) ** 0.5

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_batch_digest is None:
            self.first_batch_digest = digest(self.model.get_weights())
            opt = self.model.optimizer
            moms = [v.numpy() for v in opt.variables if "momentum" in v.name] if opt.built else []
            self.first_batch_opt = flat(moms) if moms else []
        self.lr.append([self._epoch, batch, float(np.asarray(self.model.optimizer.learning_rate))])
        self.mom_begin.append(self._mom())

    def on_train_batch_end(self, batch, logs=None):
        self.mom_end.append(self._mom())

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_digests.append(digest(self.model.get_weights()))
        self.epoch_weights.append(flat(self.model.get_weights()))
        self.logs.append({k: float(np.asarray(v)) for k, v in (logs or {}).items()})


def maxdiff_list(a, b) -> float:
    return float(max(np.max(np.abs(np.asarray(x) - np.asarray(y))) for x, y in zip(a, b)))


def reference_fit(make, x, y, batch, epochs=EPOCHS, opt=None):
    m = make(0)
    m.compile(opt or sgd(), "mse")
    m.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return flat(m.get_weights())


@functools.lru_cache(maxsize=None)
def sgd_reference() -> list:
    """The reference most scenarios compare with: `dense_model`, plain `sgd()`, one process with the global batch.

    Computed once per process (the fit is deterministic); eight scenarios used to fit it again each time."""
    return reference_fit(dense_model, X, Y, S * B)


def scenario(fn):
    name = fn.__name__
    t0 = time.time()
    try:
        RESULTS[name] = fn()
    except Exception as exc:  # recorded; the pytest side reports it
        RESULTS["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    RESULTS.setdefault("timings", {})[name] = round(time.time() - t0, 2)
    return fn


# ----------------------------------------------------------------------------------------------------------
@scenario
def equivalence():
    """fit() with DistributedOptimizer on S ranks x batch B == one process with batch S*B."""
    m = dense_model(0)
    m.compile(lhvd.DistributedOptimizer(sgd()), "mse")
    rec = Recorder()
    m.fit(shard(X), shard(Y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
          callbacks=[lhvd.BroadcastGlobalVariablesCallback(0), rec])
    return {"epoch_digests": rec.epoch_digests, "final": flat(m.get_weights()),
            "reference": sgd_reference(), "iterations": int(m.optimizer.iterations.numpy())}


@scenario
def backward_passes():
    """backward_passes_per_step=2 on S ranks x batch B/2 == one process with batch S*B (same update count).

    Explicit mean + per-update counting, and Horovod's defaults (sum, every pass counted)."""
    b = B // 2
    out = {}
    for label, kwargs, lr in [("mean_per_update", dict(average_aggregated_gradients=True, iterations="per_update"), LR),
                              ("defaults", {}, LR / 2)]:
        m = dense_model(0)
        m.compile(lhvd.DistributedOptimizer(sgd(lr), backward_passes_per_step=2, **kwargs), "mse")
        # Each rank's two consecutive micro-batches form its half of a global batch of S*B.
        m.fit(shard(X, b=B), shard(Y, b=B), batch_size=b, epochs=EPOCHS, shuffle=False, verbose=0)
        out[label] = {"final": flat(m.get_weights()), "iterations": int(m.optimizer.iterations.numpy()),
                      "n_optimizer_variables": len(m.optimizer.variables)}
    # The sum of two micro-batch means at lr/2 is one global-batch mean at lr.
    out.update(reference=sgd_reference(), updates=EPOCHS * N // (S * B),
               passes=2 * EPOCHS * N // (S * B))
    return out


@scenario
def other_optimizers():
    """Adam, and SGD inside a LossScaleOptimizer, match their single-process references too."""
    out = {}
    makers = {
        "adam": (lambda: keras.optimizers.Adam(0.01), {}),
        "loss_scale_sgd": (lambda: keras.optimizers.LossScaleOptimizer(sgd(), initial_scale=2.0 ** 8), {}),
        "sgd_clipnorm": (lambda: keras.optimizers.SGD(LR, momentum=0.9, global_clipnorm=0.5), {}),
        # Horovod's grouping and split averaging: same result, different collectives.
        "groups_2": (sgd, dict(groups=2)),
        "num_groups_3": (sgd, dict(num_groups=3)),
        "predivide_2": (sgd, dict(gradient_predivide_factor=2.0)),
        "sum_half_lr": (lambda: sgd(LR / S), dict(op=lhvd.Sum)),
    }
    for label, (make, kwargs) in makers.items():
        m = dense_model(0)
        m.compile(lhvd.DistributedOptimizer(make(), **kwargs), "mse")
        m.fit(shard(X), shard(Y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
        # The plain-SGD reference serves the grouping/predivide variants and the sum of S means at lr/S.
        same_as_sgd = make is sgd or label == "sum_half_lr"
        reference = sgd_reference() if same_as_sgd else reference_fit(dense_model, X, Y, S * B, opt=make())
        out[label] = {"final": flat(m.get_weights()), "reference": reference,
                      "class": type(m.optimizer).__name__, "distributed": lhvd.is_distributed(m.optimizer)}
    return out


@scenario
def helpers():
    return {"rank0_only": lhvd.rank0_only(["ckpt", "csv"]), "fit_verbose": lhvd.fit_verbose(1),
            "is_root": lhvd.is_root(), "info_rank": lhvd.info().rank,
            "ranks": [lhvd.size(), lhvd.rank(), lhvd.local_rank(), lhvd.local_size()]}


@scenario
def custom_loop_sparse():
    """Custom loops (tf.function and eager) with Embedding -> IndexedSlices gradients, sparse and dense."""
    import tensorflow as tf

    loss_fn = keras.losses.MeanSquaredError()

    def run(opt, graph, x, y, batch):
        m = embedding_model(0)
        step_fn = None

        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, m(xb, training=True))
            grads = tape.gradient(loss, m.trainable_variables)
            opt.apply_gradients(zip(grads, m.trainable_variables))
            return grads

        step_fn = tf.function(step) if graph else step
        kinds = None
        for _ in range(EPOCHS):
            for i in range(0, len(x), batch):
                g = step_fn(tf.constant(x[i:i + batch]), tf.constant(y[i:i + batch]))
                kinds = [type(t).__name__ for t in g]
        return flat(m.get_weights()), kinds

    ref, _ = run(keras.optimizers.SGD(LR), False, TOKENS, Y, S * B)
    out = {"reference": ref}
    variants = [("graph_sparse", True, False), ("graph_dense", True, True), ("eager_sparse", False, False)]
    for label, graph, sad in variants:
        w, kinds = run(lhvd.DistributedOptimizer(keras.optimizers.SGD(LR), sparse_as_dense=sad), graph,
                       shard(TOKENS), shard(Y), B)
        out[label] = w
        out[label + "_grad_types"] = kinds
    return out


@scenario
def fp16_compression():
    m = dense_model(0)
    m.compile(lhvd.DistributedOptimizer(sgd(), compression="fp16"), "mse")
    m.fit(shard(X), shard(Y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"final": flat(m.get_weights()), "reference": sgd_reference()}


@scenario
def metric_average():
    """Ranks see different data; MetricAverageCallback must log the mean of the per-rank values."""
    yr = Y + 3.0 * R  # per-rank targets -> per-rank loss/mae differ
    m = dense_model(0)
    m.compile(lhvd.DistributedOptimizer(sgd(0.01)), "mse", metrics=["mae"])
    raw, avg = Recorder(), Recorder()
    hist = m.fit(shard(X), shard(yr), batch_size=B, epochs=2, shuffle=False, verbose=0,
                 validation_data=(X[:16], yr[:16]),
                 callbacks=[raw, lhvd.MetricAverageCallback(), avg])
    return {"raw": raw.logs, "averaged": avg.logs,
            "history": {k: [float(v) for v in vs] for k, vs in hist.history.items()}}


@scenario
def broadcast():
    """Differently initialised ranks (weights and optimizer slots) become equal to rank 0."""
    m = dense_model(100 + R)
    opt = lhvd.DistributedOptimizer(sgd())
    m.compile(opt, "mse")
    opt.build(m.trainable_variables)
    for v in opt.momentums:
        v.assign(np.full(v.shape, 0.001 * (R + 1), dtype="float32"))
    before = digest(m.get_weights())
    root_initial = None
    if R == 0:
        root_initial = digest(m.get_weights())
    rec = Recorder()
    m.fit(shard(X), shard(Y), batch_size=B, epochs=1, shuffle=False, verbose=0,
          callbacks=[lhvd.BroadcastGlobalVariablesCallback(0), rec])
    return {"before": before, "root_initial": root_initial, "after_broadcast": rec.first_batch_digest,
            "momentum_after_broadcast": rec.first_batch_opt, "final": digest(m.get_weights())}


@scenario
def warmup():
    """LearningRateWarmupCallback: lr at every batch, and momentum buffers rescaled with the lr."""
    m = dense_model(0)
    m.compile(lhvd.DistributedOptimizer(sgd(0.123)), "mse")
    rec = Recorder()
    cb = lhvd.LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=2, verbose=0)
    hist = m.fit(shard(X), shard(Y), batch_size=B, epochs=3, shuffle=False, verbose=0, callbacks=[cb, rec])
    return {"lr": rec.lr, "mom_begin": rec.mom_begin, "mom_end": rec.mom_end,
            "steps_per_epoch": N // (S * B), "history_lr": hist.history.get("learning_rate")}


@scenario
def schedule():
    """LearningRateScheduleCallback (staircase, constant multiplier) and the LearningRateSchedule error."""
    m = dense_model(0)
    m.compile(lhvd.DistributedOptimizer(sgd(0.1)), "mse")
    rec = Recorder()
    cb = lhvd.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5, start_epoch=1)
    m.fit(shard(X), shard(Y), batch_size=B, epochs=3, shuffle=False, verbose=0, callbacks=[cb, rec])
    err = None
    m2 = dense_model(0)
    m2.compile(lhvd.DistributedOptimizer(keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(
        0.1, 10, 0.9))), "mse")
    try:  # raises in on_train_begin, before any collective, on every rank
        m2.fit(shard(X), shard(Y), batch_size=B, epochs=1, verbose=0,
               callbacks=[lhvd.LearningRateWarmupCallback(0.1, warmup_epochs=1)])
    except ValueError as exc:
        err = str(exc)
    return {"lr": rec.lr, "schedule_error": err}


@scenario
def negative_control():
    """Plain (non-distributed) optimizer on different data: ranks must diverge."""
    m = dense_model(0)
    m.compile(sgd(), "mse")
    rec = Recorder()
    m.fit(shard(X), shard(Y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[rec])
    return {"epoch_digests": rec.epoch_digests, "final": flat(m.get_weights())}


@scenario
def wrapped():
    """The same equivalence check with the model wrapped by keras_lms.wrap(min_bytes=0) on each rank."""
    try:
        import keras_lms

        wrap = keras_lms.wrap
    except Exception as exc:  # keras_lms core not importable yet
        return {"skipped": f"keras_lms.wrap not importable: {type(exc).__name__}: {exc}"}
    m = wrap(dense_model(0), min_bytes=0)
    m.compile(lhvd.DistributedOptimizer(sgd()), "mse", jit_compile=False)
    rec = Recorder()
    m.fit(shard(X), shard(Y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
          callbacks=[lhvd.BroadcastGlobalVariablesCallback(0), lhvd.MetricAverageCallback(), rec])
    plan = getattr(m, "lms_plan", None)
    n_off = sum(1 for e in plan if getattr(e, "offloaded", False)) if plan is not None else None
    # Broadcast must reach the weights of a wrapped model: differently seeded ranks become equal.
    mb = wrap(dense_model(100 + R), min_bytes=0)
    mb.compile(lhvd.DistributedOptimizer(sgd()), "mse", jit_compile=False)
    before = digest(mb.get_weights())
    rec_b = Recorder()
    mb.fit(shard(X), shard(Y), batch_size=B, epochs=1, shuffle=False, verbose=0,
           callbacks=[lhvd.BroadcastGlobalVariablesCallback(0), rec_b])
    return {"type": type(m).__name__, "epoch_digests": rec.epoch_digests, "final": flat(m.get_weights()),
            "reference": sgd_reference(), "offloaded_calls": n_off,
            "bcast_before": before, "bcast_after": rec_b.first_batch_digest, "bcast_final": rec_b.epoch_digests[-1]}


@scenario
def xla_error():
    """jit_compile=True must fail with our clear message (Horovod has no XLA ops here), not hang."""
    if S == 1:
        return {"skipped": "single rank: no collective, XLA is fine"}
    m = dense_model(0)
    m.compile(lhvd.DistributedOptimizer(sgd()), "mse", jit_compile=True)
    try:
        m.fit(shard(X), shard(Y), batch_size=B, epochs=1, verbose=0)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return {"error": None}


@scenario
def saving():
    """Rank 0 only: save a model compiled with DistributedOptimizer; load it plainly and re-wrapped."""
    if R != 0:
        return {"skipped": "rank 0 only"}
    m = dense_model(0)
    opt = lhvd.DistributedOptimizer(sgd())
    m.compile(opt, "mse")
    # No fit here (it would wait for the other ranks): give the optimizer recognisable state instead.
    opt.build(m.trainable_variables)
    opt.iterations.assign(7)
    for v in opt.momentums:
        v.assign(np.full(v.shape, 0.25, dtype="float32"))
    path = os.path.join(OUT, "model.keras")
    m.save(path)
    plain = keras.saving.load_model(path)
    rewrapped = lhvd.load_model(path)
    # Horovod's load_model order: custom_optimizers (a list of classes) second; a dict there is refused.
    class MySGD(keras.optimizers.SGD):
        pass

    mc = dense_model(0)
    mc.compile(lhvd.DistributedOptimizer(MySGD(0.01)), "mse")
    cpath = os.path.join(OUT, "custom.keras")
    mc.save(cpath)
    custom = lhvd.load_model(cpath, [MySGD])
    try:
        lhvd.load_model(cpath, {"MySGD": MySGD})
        dict_error = None
    except TypeError as exc:
        dict_error = str(exc)
    inner = sgd()
    return {
        "config": opt.get_config(),
        "inner_config": keras.optimizers.SGD.from_config(opt.get_config()).get_config(),
        "serialized": keras.saving.serialize_keras_object(opt),
        "plain_loaded": [type(plain.optimizer).__name__, lhvd.is_distributed(plain.optimizer)],
        "rewrapped": [type(rewrapped.optimizer).__name__, lhvd.is_distributed(rewrapped.optimizer)],
        "rewrapped_iterations": int(rewrapped.optimizer.iterations.numpy()),
        "rewrapped_momentum": sorted({float(x) for v in rewrapped.optimizer.momentums for x in np.ravel(v)}),
        "weights_equal": bool(np.array_equal(flat(plain.get_weights()), flat(m.get_weights()))),
        "is_sgd": isinstance(opt, keras.optimizers.SGD),
        "plain_sgd_config_keys": sorted(inner.get_config()),
        "custom_loaded": [type(custom.optimizer).__name__, isinstance(custom.optimizer, MySGD),
                          lhvd.is_distributed(custom.optimizer)],
        "dict_error": dict_error,
    }


@scenario
def memory_callback_placement():
    """Issue 11 item 7: MemoryHighWaterMark inside rank0_only (where loggers go) must not hang."""
    import keras_lms

    m = dense_model(0)
    m.compile(lhvd.DistributedOptimizer(sgd()), "mse")
    cbs = [lhvd.BroadcastGlobalVariablesCallback(0)] + lhvd.rank0_only([keras_lms.MemoryHighWaterMark()])
    h = m.fit(shard(X), shard(Y), batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=cbs)
    m2 = dense_model(0)
    m2.compile(lhvd.DistributedOptimizer(sgd()), "mse")
    h2 = m2.fit(shard(X), shard(Y), batch_size=B, epochs=1, shuffle=False, verbose=0,
                callbacks=[keras_lms.MemoryHighWaterMark(across_ranks=True)])
    try:
        lhvd.rank0_only([keras_lms.MemoryHighWaterMark(across_ranks=True)])
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"rank0_only_keys": sorted(h.history), "across_keys": sorted(h2.history), "refused": refused,
            "rss": h2.history["peak_host_rss_mib"][-1], "rss_max": h2.history.get("peak_host_rss_mib_max", [None])[-1]}


HOROVOD_KERAS_NAMES = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size",
    "rank", "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built", "Average", "Sum", "Adasum", "Compression",
    "DistributedOptimizer", "PartialDistributedOptimizer", "broadcast_global_variables", "allreduce", "allgather",
    "broadcast", "reducescatter", "load_model", "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
    "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint",
]


@scenario
def api_parity():
    """Issue 12 item 3: Horovod's Keras names, signatures and collectives on values."""
    import inspect


    out = {"missing": [n for n in HOROVOD_KERAS_NAMES if not hasattr(lhvd, n)]}
    out["allreduce_average"] = float(lhvd.allreduce(float(R + 1), name="t_average").numpy())
    out["allreduce_sum"] = lhvd.allreduce([float(R + 1), 1.0], op=lhvd.Sum, name="t_sum").numpy().tolist()
    out["allreduce_fp16"] = float(lhvd.allreduce(np.float32(R + 1), compression=lhvd.Compression.fp16,
                                                 name="t_fp16").numpy())
    out["allgather"] = lhvd.allgather(np.full((R + 1, 2), R, "int32"), name="t_gather").numpy().tolist()
    out["broadcast"] = float(lhvd.broadcast(10.0 * (R + 1), 0, name="t_bcast").numpy())
    out["reducescatter"] = lhvd.reducescatter(np.arange(4, dtype="float32") * (R + 1), op=lhvd.Sum,
                                              name="t_rs").numpy().tolist()
    out["is_initialized"] = lhvd.is_initialized()
    out["cross"] = [lhvd.cross_rank(), lhvd.cross_size()]
    timeline = os.path.join(OUT, "timeline.json")
    lhvd.start_timeline(timeline)
    lhvd.allreduce(1.0, name="t_timeline")
    lhvd.stop_timeline()
    out["timeline_bytes"] = os.path.getsize(timeline) if os.path.exists(timeline) else 0
    try:
        lhvd.broadcast_global_variables(0)
        out["bgv_error"] = None
    except RuntimeError as exc:
        out["bgv_error"] = str(exc)
    # Positional order and defaults of Horovod 0.28.1 (horovod.tensorflow.keras), where Horovod imports.
    ours = {n: list(inspect.signature(getattr(lhvd, n)).parameters) for n in (
        "DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "allreduce", "allgather", "broadcast",
        "reducescatter")}
    ours.update({n: list(inspect.signature(getattr(lhvd, n).__init__).parameters)[1:] for n in (
        "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
        "LearningRateWarmupCallback", "BestModelCheckpoint")})
    out["signatures"] = ours
    opt = lhvd.DistributedOptimizer(sgd(), "my_gradients")
    st = opt._hvd_settings
    out["named"] = st.name
    out["defaults"] = [st.average_aggregated_gradients, st.iterations, st.op == lhvd.Average]
    try:
        lhvd.DistributedOptimizer(sgd(), 2)
        out["positional_int_error"] = None
    except TypeError as exc:
        out["positional_int_error"] = str(exc)
    return out


@scenario
def local_variables():
    """register_local_var / PartialDistributedOptimizer / BroadcastGlobalVariablesCallback(local_variables=).

    One SGD step (no momentum) on rank-specific data from rank-specific weights of the last layer: the first
    layer is broadcast and averaged (identical on all ranks), the last keeps its own weights and gets its own
    gradient divided by the number of ranks (scale_local_gradients=True, Horovod's default) or not."""
    import tensorflow as tf

    out = {}
    xb, yb = shard(X)[:B], shard(Y)[:B] + R  # different data per rank
    for label in ("register", "partial", "partial_unscaled"):
        m = dense_model(0)
        last = m.layers[-1]
        last.set_weights([w + 0.1 * (R + 1) for w in last.get_weights()])  # rank-specific local weights
        if label == "register":
            opt = lhvd.DistributedOptimizer(keras.optimizers.SGD(LR))
            for v in last.trainable_weights:
                opt.register_local_var(v)
        else:
            opt = lhvd.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=[last],
                                                   scale_local_gradients=label == "partial")
        m.compile(opt, "mse")
        start = [w.copy() for w in last.get_weights()]
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(yb, m(xb, training=True))
        grads = tape.gradient(loss, last.trainable_weights)
        scale = 1.0 / S if label != "partial_unscaled" else 1.0
        expected = [w - LR * scale * np.asarray(g) for w, g in zip(start, grads)]
        m.fit(xb, yb, batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[lhvd.BroadcastGlobalVariablesCallback(0, local_variables=last.trainable_weights)])
        out[label] = {"shared": digest(m.layers[1].get_weights()), "local": digest(last.get_weights()),
                      "local_error": maxdiff_list(last.get_weights(), expected)}
    return out



@scenario
def process_sets():
    """DistributedOptimizer(process_set=...) reduces only within the set: with one set per rank, each rank
    trains alone and matches plain single-process training on its own shard."""
    if PROCESS_SETS is None:
        return {"skipped": "needs 2 ranks"}
    mine = PROCESS_SETS[R]
    m = dense_model(0)
    m.compile(lhvd.DistributedOptimizer(sgd(), process_set=mine), "mse")
    m.fit(shard(X), shard(Y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
    own = reference_fit(dense_model, shard(X), shard(Y), B)
    return {"final": flat(m.get_weights()), "own_reference": own, "set_ranks": mine.ranks,
            "included": mine.included()}


@scenario
def best_checkpoint_and_device():
    """BestModelCheckpoint writes on rank 0 only; device= on the collective callbacks; a missing path is an
    error at train begin (before any collective)."""
    m = dense_model(0)
    m.compile(lhvd.DistributedOptimizer(sgd(0.01)), "mse")
    path = os.path.join(OUT, f"best_{R}.keras")
    h = m.fit(shard(X), shard(Y), batch_size=B, epochs=2, shuffle=False, verbose=0, validation_data=(X[:16], Y[:16]),
              callbacks=[lhvd.BroadcastGlobalVariablesCallback(0, device="/cpu:0"),
                         lhvd.MetricAverageCallback(device="/cpu:0"),
                         lhvd.BestModelCheckpoint(monitor="val_loss", filepath=path)])
    try:
        m.fit(shard(X), shard(Y), batch_size=B, epochs=1, verbose=0, callbacks=[lhvd.BestModelCheckpoint()])
        missing = None
    except ValueError as exc:
        missing = str(exc)
    loaded = keras.saving.load_model(path) if os.path.exists(path) else None
    return {"written": os.path.exists(path), "val_loss": h.history["val_loss"], "missing_path_error": missing,
            "loads": loaded is not None}


@scenario
def backup_and_restore():
    """keras_lms.callbacks.BackupAndRestore per rank: a wrapped model with Dropout trained 2 epochs with backups,
    then a fresh model resumed to 3 epochs from the same directory equals 3 uninterrupted epochs, bit for bit."""
    import keras_lms

    def make():
        keras.utils.set_random_seed(7)
        inp = keras.Input((D,))
        h = keras.layers.Dropout(0.3)(keras.layers.Dense(16, activation="tanh")(inp))
        m = keras_lms.wrap(keras.Model(inp, keras.layers.Dense(1)(h)), min_bytes=0)
        m.compile(lhvd.DistributedOptimizer(sgd()), "mse", jit_compile=False)
        return m

    def fit(m, epochs, backup=None):
        cbs = [lhvd.BroadcastGlobalVariablesCallback(0)] + ([backup] if backup else [])
        ran = m.fit(shard(X), shard(Y), batch_size=B, epochs=epochs, shuffle=False, verbose=0, callbacks=cbs)
        return digest(m.get_weights()), len(ran.history["loss"])

    directory = os.path.join(OUT, "backup")
    uninterrupted, _ = fit(make(), 3)
    fit(make(), 2, keras_lms.callbacks.BackupAndRestore(directory, delete_checkpoint=False))  # "preempted" here
    resumed_model = make()
    resumed, epochs_run = fit(resumed_model, 3, keras_lms.callbacks.BackupAndRestore(directory,
                                                                                     delete_checkpoint=False))
    return {"uninterrupted": uninterrupted, "resumed": resumed, "epochs_run_after_resume": epochs_run,
            "iterations": int(resumed_model.optimizer.iterations),
            "rank_dirs": sorted(d for d in os.listdir(directory) if d.startswith("rank-"))}


@scenario
def upstream_elastic_state():
    """Horovod's own `test_elastic_state` on `keras_lms.horovod.elastic.KerasState` (tests/horovod/
    _upstream_elastic_state.py): plain, wrapped, mixed precision, and Horovod's own KerasState as the control."""
    import _upstream_elastic_state  # next to this script

    return _upstream_elastic_state.run_cases()


@scenario
def layer_name_skew():
    """Ranks whose Keras layer-name counters differ must still agree on their gradient allreduce (not hang).

    Rank 1 builds a throw-away model first, so the training model's auto-generated layer names (and with them its
    gradient tensors' names) differ from rank 0's (`dense_<n+2>` vs `dense_<n>`): a collective named after those
    tensors never matches across ranks. Last, so the skew changes no other scenario's names."""
    if S == 1:
        return {"skipped": "needs 2 ranks"}
    if R == 1:
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(2)])
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    m.compile(lhvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), "mse")
    x = np.random.default_rng(R).normal(size=(32, 4)).astype("float32")
    m.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=[lhvd.BroadcastGlobalVariablesCallback(0)])
    return {"layers": [layer.name for layer in m.layers], "weights": flat(m.get_weights())}


RESULTS["rank"], RESULTS["size"] = R, S
with open(os.path.join(OUT, f"rank{R}.json"), "w") as f:
    json.dump(RESULTS, f)
print(f"rank {R}/{S}: done, errors: {sorted(RESULTS['errors'])}", flush=True)
