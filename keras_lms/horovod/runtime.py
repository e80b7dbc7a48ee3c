"""Process setup for data-parallel training: `init()`, rank queries and rank-0-only helpers.

Why this exists instead of a bare `hvd.init()`: with several ranks per host, each rank must

* see exactly one GPU (otherwise every rank allocates memory on every GPU and they all compute on GPU 0),
* get its share of *host* memory, because keras_lms offloads activations to host RAM and TensorFlow's pinned
  host allocator (`TF_GPU_HOST_MEM_LIMIT_IN_MB`, default 64 GiB per process) does not know about the other
  ranks on the host,
* on CPU-only hosts, get its share of the cores (TensorFlow sizes its thread pools to the whole machine in
  every process, so N ranks would each start N x cores threads).

All of these are read by TensorFlow when it initialises its devices, i.e. on the first op, the first
`tf.config.list_logical_devices()`, or the first Keras layer built. Call `init` right after
importing, before building any model. Settings the user already made (environment variables, explicit
`tf.config` calls) are left alone.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Iterable

from ._hvd import hvd, tf

_HOST_MEM_ENV = "TF_GPU_HOST_MEM_LIMIT_IN_MB"
_INFO: "HorovodInfo | None" = None


@dataclasses.dataclass(frozen=True)
class HorovodInfo:
    """What `init` found and changed (also available later as `info`)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    controller: str  # "mpi" or "gloo"
    gpu: str | None  # physical GPU pinned to this rank, e.g. "/physical_device:GPU:1"; None on CPU
    host_mem_limit_mb: int | None  # value of TF_GPU_HOST_MEM_LIMIT_IN_MB in effect (set by us or the user)
    cpu_threads: int | None  # intra-op threads set by init() (None: left to TensorFlow/user)
    env_set: dict = dataclasses.field(default_factory=dict)  # environment variables init() set
    notes: tuple = ()  # things init() could not do (e.g. TF already initialised)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _tf_runtime_initialized() -> bool:
    """Best effort: has TensorFlow already created its devices (after which device config is frozen)?"""
    try:
        from tensorflow.python.eager import context

        return context.context()._context_handle is not None  # private, but stable since TF 2.0
    except Exception:  # pragma: no cover
        return False


def init(
    comm=None,
    process_sets=None,
    *,
    pin_gpu: bool = True,
    memory_growth: bool = True,
    host_memory_fraction: float = 0.8,
    cpu_threads: int | str | None = "auto",
) -> HorovodInfo:
    """Initialise Horovod and give this rank its GPU, host-memory share and CPU threads.

    Call it right after importing, before building any model: steps 2-4 below must happen before TensorFlow
    initialises its devices. What it does, in order (each step only if the user has not already decided it):

    1. `hvd.init(comm, process_sets)` (nothing if already initialised). Controller: MPI under `mpirun` /
       `horovodrun --mpi`, Gloo under `horovodrun --gloo`; plain `python` gives a single rank of size 1.
    2. GPUs present and `pin_gpu`: `tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")` and,
       if `memory_growth`, `tf.config.experimental.set_memory_growth(gpu, True)`.
    3. `TF_GPU_HOST_MEM_LIMIT_IN_MB` (TensorFlow's limit for pinned host memory used for device <-> host
       copies, i.e. where offloaded activations live) := `total RAM * host_memory_fraction / local_size` in
       MiB, unless already set in the environment. Set on CPU-only hosts too (it is then unused).
    4. `cpu_threads="auto"` on a host without GPUs and with `local_size > 1`: intra-op threads :=
       `max(1, cores_available_to_this_process // local_size)`, inter-op threads := `min(2, that)`, unless
       `TF_NUM_INTRAOP_THREADS` is set or `tf.config.threading` was configured already.

    If TensorFlow has already initialised its devices, `init` cannot change them: it says so in a
    `RuntimeWarning` and lists it in `HorovodInfo.notes`.

    Args:
        comm: Horovod's `comm` (an MPI communicator or a list of ranks), passed to `hvd.init`. Defaults to
            `None` (all ranks).
        process_sets: Horovod process sets to register, e.g. `[ProcessSet([0, 1]), ProcessSet([2, 3])]`.
            Defaults to `None`.
        pin_gpu: give each rank one GPU (`local_rank % number of GPUs`). Defaults to `True`.
        memory_growth: let the pinned GPU's memory grow as needed instead of taking it all. Defaults to `True`.
        host_memory_fraction: the share of total RAM that the ranks on one host may pin for offloaded
            activations, divided evenly between them. Defaults to `0.8`.
        cpu_threads: `"auto"` (split the cores between CPU-only ranks, see step 4), an int (that many intra-op
            threads), or `None` (leave threading alone). Defaults to `"auto"`.

    Returns:
        A frozen `keras_lms.horovod.HorovodInfo`: rank, size, local rank and size, the controller (`"mpi"` or
        `"gloo"`), the pinned GPU, the host-memory limit, the CPU threads, the environment variables it set
        and `notes` on what it could not do. `keras_lms.horovod.info()` returns it again later.

    Raises:
        ValueError: Horovod's own errors from `hvd.init` (e.g. an unusable `comm`) pass through.

    Example:

    ```python
    import keras_lms.horovod as lhvd

    info = lhvd.init()            # under plain `python`: one rank of size 1
    print(info.rank, info.size, info.controller, info.host_mem_limit_mb)
    assert lhvd.size() == info.size and lhvd.is_root() == (lhvd.rank() == 0)
    ```
    """
    global _INFO
    notes: list[str] = []
    env_set: dict[str, str] = {}
    if not hvd.is_initialized():
        hvd.init(comm=comm, process_sets=process_sets)
    elif process_sets:
        notes.append("Horovod was already initialised: process_sets were not added (use add_process_set)")
    placement = _placement()
    lrank, lsize = placement["local_rank"], placement["local_size"]
    already = _tf_runtime_initialized()

    # 2. GPU pinning.
    gpus = tf.config.list_physical_devices("GPU")  # does not initialise the runtime
    pinned = None
    if gpus and pin_gpu:
        gpu = gpus[lrank % len(gpus)]
        try:
            tf.config.set_visible_devices([gpu], "GPU")
            if memory_growth:
                tf.config.experimental.set_memory_growth(gpu, True)
            pinned = gpu.name
        except RuntimeError as exc:
            notes.append(f"could not pin GPU (TensorFlow already initialised): {exc}")

    # 3. Per-rank host-memory limit for offloaded activations.
    if _HOST_MEM_ENV not in os.environ:
        import psutil

        mb = int(psutil.virtual_memory().total / 2**20 * float(host_memory_fraction) / max(1, lsize))
        os.environ[_HOST_MEM_ENV] = str(max(mb, 1))
        env_set[_HOST_MEM_ENV] = os.environ[_HOST_MEM_ENV]
        if already and gpus:
            notes.append(f"{_HOST_MEM_ENV} set after TensorFlow initialised its GPUs; it has no effect")
    try:
        host_mb = int(os.environ[_HOST_MEM_ENV])
    except ValueError:
        host_mb = None

    # 4. CPU threads per rank.
    threads = None
    if cpu_threads is not None:
        if cpu_threads == "auto":
            untouched = (
                "TF_NUM_INTRAOP_THREADS" not in os.environ
                and tf.config.threading.get_intra_op_parallelism_threads() == 0
            )
            if not gpus and lsize > 1 and untouched:
                try:
                    cores = len(os.sched_getaffinity(0))
                except AttributeError:  # pragma: no cover - non-Linux
                    cores = os.cpu_count() or 1
                threads = max(1, cores // lsize)
        else:
            threads = int(cpu_threads)
        if threads is not None:
            try:
                tf.config.threading.set_intra_op_parallelism_threads(threads)
                tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
            except RuntimeError as exc:
                notes.append(f"could not set CPU threads (TensorFlow already initialised): {exc}")
                threads = None

    controller = "mpi" if hvd.mpi_enabled() else "gloo"
    _INFO = HorovodInfo(
        **placement, controller=controller, gpu=pinned, host_mem_limit_mb=host_mb, cpu_threads=threads,
        env_set=env_set, notes=tuple(notes),
    )
    for note in notes:
        warnings.warn(f"keras_lms.horovod.init(): {note}", RuntimeWarning, stacklevel=2)
    return _INFO


def refresh_after_reset() -> None:
    """After an elastic reset (`hvd.shutdown(); hvd.init()`): update `info()`'s rank, size and local size.

    The GPU, threads and host-memory limit stay as `init` set them: TensorFlow's devices exist by then. The
    host-RAM guard reads Horovod's local size when it checks a plan (`keras_lms.memory.ranks_on_this_node`), and
    `KerasState.reset` makes wrapped models re-plan, so the guard sees the new number of ranks on this node.
    """
    global _INFO
    if _INFO is not None:
        _INFO = dataclasses.replace(_INFO, **_placement())


def _placement() -> dict[str, int]:
    """This process's place in the job as Horovod now sees it: `HorovodInfo`'s rank, size, local rank and size."""
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size()}


def info() -> HorovodInfo:
    """The `HorovodInfo` returned by the last `init` call."""
    if _INFO is None:
        raise RuntimeError("keras_lms.horovod.init() has not been called")
    return _INFO


def _check() -> None:
    if not hvd.is_initialized():
        raise RuntimeError("Horovod is not initialised: call keras_lms.horovod.init() first")


def size() -> int:
    """Number of ranks in the job."""
    _check()
    return hvd.size()


def rank() -> int:
    """This process' global rank (0 .. size-1)."""
    _check()
    return hvd.rank()


def local_rank() -> int:
    """This process' rank among the ranks on the same host (used to pick the GPU)."""
    _check()
    return hvd.local_rank()


def local_size() -> int:
    """Number of ranks on this host."""
    _check()
    return hvd.local_size()


def is_root(root_rank: int = 0) -> bool:
    """True on the rank that should write checkpoints, logs and plots."""
    return rank() == root_rank


def cross_rank() -> int:
    """This host's index among the hosts of the job (Horovod's `cross_rank`)."""
    _check()
    return hvd.cross_rank()


def cross_size() -> int:
    """Number of hosts with a rank of the same local rank as this one (Horovod's `cross_size`)."""
    _check()
    return hvd.cross_size()


def rank0_only(callbacks: Iterable | None, root_rank: int = 0) -> list:
    """Return `list(callbacks)` on the root rank and `[]` on every other rank.

    Use for callbacks that write files or print (ModelCheckpoint, CSVLogger, TensorBoard, ...), so N ranks do
    not write the same file N times::

        callbacks = [lhvd.BroadcastGlobalVariablesCallback(0), lhvd.MetricAverageCallback()]
        callbacks += lhvd.rank0_only([keras.callbacks.ModelCheckpoint(...), keras.callbacks.CSVLogger(...)])

    Put them *after* MetricAverageCallback so they see averaged metrics.

    A callback that runs a Horovod collective (`BroadcastGlobalVariablesCallback`, `MetricAverageCallback`,
    `keras_lms.MemoryHighWaterMark(across_ranks=True)`) must run on every rank, or rank 0 waits forever for
    the others: such a callback is refused here, with a `ValueError` on every rank.
    """
    callbacks = list(callbacks or [])
    collective = [type(cb).__name__ for cb in callbacks if getattr(cb, "_hvd_collective", False)]
    if collective:
        raise ValueError(
            f"rank0_only() got {', '.join(collective)}, which run(s) a collective across all ranks; on rank 0 "
            "alone it would wait forever for the others. Pass it to fit() on every rank (outside rank0_only)"
            + (", or use MemoryHighWaterMark() without across_ranks=True to log each rank's own memory"
               if "MemoryHighWaterMark" in collective else "") + "."
        )
    return callbacks if is_root(root_rank) else []


def fit_verbose(verbose: int | str = "auto", root_rank: int = 0) -> int | str:
    """`verbose` on the root rank, `0` elsewhere (for `model.fit(verbose=lhvd.fit_verbose(1))`)."""
    return verbose if is_root(root_rank) else 0
