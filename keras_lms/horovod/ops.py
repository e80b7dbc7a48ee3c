"""Horovod's Keras-level names, so `import keras_lms.horovod as hvd` works in a Horovod Keras script.

`allreduce`/`allgather`/`broadcast`/`reducescatter` take any tensor-compatible value (numbers, lists,
NumPy arrays, tensors) and return a `tf.Tensor`, with the arguments of `horovod.tensorflow.keras`
(0.28.1). One difference: `name` names the *collective* (Horovod's Keras layer gives it to a constant it
creates, and the collective is then named after that constant, so the names and their ordering still have
to match across ranks). The constants and process-set functions are Horovod's own objects. `broadcast_variables`
overwrites variables in place (the collective under `BroadcastGlobalVariablesCallback` and `KerasState.sync`).
"""

from __future__ import annotations

from ._hvd import from_wire, hvd, tf, to_wire

Average = hvd.Average
Sum = hvd.Sum
Adasum = hvd.Adasum
Compression = hvd.Compression
ProcessSet = hvd.ProcessSet
global_process_set = hvd.global_process_set
add_process_set = hvd.add_process_set
remove_process_set = hvd.remove_process_set
shutdown = hvd.shutdown
is_initialized = hvd.is_initialized
start_timeline = hvd.start_timeline
stop_timeline = hvd.stop_timeline
mpi_threads_supported = hvd.mpi_threads_supported
mpi_enabled = hvd.mpi_enabled
mpi_built = hvd.mpi_built
gloo_enabled = hvd.gloo_enabled
gloo_built = hvd.gloo_built
nccl_built = hvd.nccl_built
ddl_built = hvd.ddl_built
ccl_built = hvd.ccl_built
cuda_built = hvd.cuda_built
rocm_built = hvd.rocm_built


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Reduce `value` over all ranks (`op`: `Average` by default, or `Sum`); same shape everywhere."""
    return hvd.allreduce(tf.convert_to_tensor(value), average=average, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, op=op, compression=compression, name=name,
                         ignore_name_scope=name is not None)


def allgather(value, name=None):
    """Concatenate `value` of every rank along the first axis (the first dimension may differ)."""
    return hvd.allgather(tf.convert_to_tensor(value), name=name, ignore_name_scope=name is not None)


def broadcast(value, root_rank, name=None):
    """`value` of `root_rank` on every rank."""
    return hvd.broadcast(tf.convert_to_tensor(value), root_rank, name=name, ignore_name_scope=name is not None)


def reducescatter(value, name=None, op=Average):
    """Reduce `value` over all ranks and give each rank its slice of the first axis."""
    return hvd.reducescatter(tf.convert_to_tensor(value), op=op, name=name, ignore_name_scope=name is not None)


def broadcast_global_variables(root_rank):
    """Not available in TensorFlow 2 / Keras 3: there is no collection of "global variables" to broadcast.

    Horovod's own version raises in eager mode, too. Raises `RuntimeError` naming the replacements.
    """
    raise RuntimeError(
        "broadcast_global_variables() has no meaning in TensorFlow 2 / Keras 3 (there is no global variable "
        "collection; horovod.tensorflow raises the same in eager mode). Use "
        "keras_lms.horovod.BroadcastGlobalVariablesCallback(root_rank) in fit(), or "
        f"keras_lms.horovod.broadcast_variables(model.variables + optimizer.variables, root_rank={root_rank!r})."
    )


def broadcast_variables(variables, root_rank: int = 0, device: str = "") -> None:
    """Overwrite `variables` on every rank with their values on `root_rank` (by value, in place).

    All broadcasts are issued inside one `tf.function` so Horovod can fuse them, with explicit names that
    are identical on every rank (the variable's position in the list). `device`: where the broadcast ops
    are placed (`""`: Horovod's choice).
    """
    variables = list(variables)
    if not variables or hvd.size() == 1:
        return
    values = [to_wire(tf.convert_to_tensor(v)) for v in variables]
    dtypes = [tf.as_dtype(v.dtype) for v in variables]

    @tf.function(autograph=False)
    def _bcast(tensors):
        with tf.device(device or None):
            return [hvd.broadcast(t, root_rank, name=f"keras_lms_broadcast_{i}") for i, t in enumerate(tensors)]

    for var, value, dtype in zip(variables, _bcast(values), dtypes):
        var.assign(from_wire(value, dtype))
