"""Compile a JAX function for an NVIDIA H100 without one, and read what the compiled program holds in memory.

A CPU run proves nothing about host offload: JAX lowers a ``device_put`` to host memory to an identity on CPU,
XLA's CPU pipeline strips memory-space annotations, and the CPU executable's ``memory_analysis()`` reports every
``host_*`` field as 0. XLA can, however, build the real GPU program on a machine without a GPU ("deviceless
compile"): with the CUDA PJRT plugin installed (``pip install "jax[cuda12]"``) and ``JAX_PLATFORMS=cpu``,
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`` describes a GPU from a
target description, and a function lowered with arguments placed on that description's device compiles to the
program an H100 would run, scheduled and buffer-assigned by XLA's GPU pipeline.

``h100_target_config.txtpb`` (package data) is that description for an H100 80GB HBM3 (published device facts;
XLA keeps similar files under ``xla/tools/hlo_opt/gpu_specs/``).

    info = compile_for_h100(step, *example_args)   # example_args: arrays or jax.ShapeDtypeStruct
    info.temp_bytes, info.host_temp_bytes, info.host_copies

``CompiledMemory.host_copies`` counts the asynchronous copies whose result lives in host memory space
``S(5)`` (device -> host) and those that read from it (host -> device) in the optimised HLO: they are what is
left of an offload after XLA's host-offloading and scheduling passes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re
import time
from typing import Any, Callable

import jax

__all__ = ["CompiledMemory", "GpuCompileUnavailable", "compile_for_h100", "compile_keras_step", "h100_device",
           "h100_target_config", "keras_train_step"]

TARGET_CONFIG = "h100_target_config.txtpb"


class GpuCompileUnavailable(RuntimeError):
    """The deviceless GPU compile cannot run here (no jax CUDA plugin, or it failed to describe the GPU)."""


def h100_target_config() -> str:
    """The text of the H100 target description shipped with keras-lms."""
    return importlib.resources.files(__package__).joinpath(TARGET_CONFIG).read_text()


@functools.lru_cache(maxsize=4)
def h100_device(device_memory_size: int | None = None):
    """A (deviceless) H100 from the CUDA plugin's topology description: compile for it, never run on it.

    Args:
        device_memory_size: bytes of device memory the compiler assumes (default: the H100's 80 GB). XLA's
            scheduler sizes its memory limit from it (``xla_gpu_memory_limit_slop_factor`` percent of it).

    Raises:
        GpuCompileUnavailable: the jax CUDA plugin is not installed, or it cannot describe the target.
    """
    config = h100_target_config()
    if device_memory_size is not None:
        config = re.sub(r"device_memory_size: \d+", f"device_memory_size: {int(device_memory_size)}", config)
    try:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
    except Exception as error:  # the plugin raises RuntimeError / ValueError / ImportError depending on version
        raise GpuCompileUnavailable(
            "A deviceless H100 compile needs the jax CUDA plugin (pip install 'jax[cuda12]'): "
            f"{type(error).__name__}: {error}"
        ) from error
    return topology.devices[0]


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """What one compiled program holds (bytes), from ``Compiled.memory_analysis()`` and its optimised HLO.

    Attributes:
        temp_bytes: device temporaries (XLA's buffer assignment: activations, gradients, workspace).
        argument_bytes: device arguments (parameters, optimizer state, the batch).
        output_bytes: device outputs (aliased with donated arguments when ``alias_bytes`` says so).
        alias_bytes: output bytes that reuse donated argument buffers.
        host_temp_bytes: temporaries in host memory (``S(5)``): what the offload keeps on host.
        to_host_copies: ``copy-start`` ops whose result is in memory space ``S(5)`` (device -> host).
        to_device_copies: ``copy-start`` ops that read an ``S(5)`` operand (host -> device).
        compile_seconds: wall time of lowering and compiling.
    """

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    host_temp_bytes: int
    to_host_copies: int
    to_device_copies: int
    compile_seconds: float

    @property
    def host_copies(self) -> int:
        """All asynchronous copies that touch host memory space ``S(5)``, both directions."""
        return self.to_host_copies + self.to_device_copies


_COPY_START = re.compile(r"=\s*\(([^=]*?)\)\s*copy-start\((.*?)\)")


def count_host_copies(hlo_text: str) -> tuple[int, int]:
    """(device -> host, host -> device) ``copy-start`` ops in optimised HLO text.

    A copy-start's result is the tuple ``(destination, source, context)``; its first shape carries ``S(5)`` when
    the copy goes to host memory, its operand's shape when it comes from there.
    """
    to_host = to_device = 0
    for line in hlo_text.splitlines():
        if "copy-start(" not in line:
            continue
        match = _COPY_START.search(line)
        if not match:
            continue
        result, operand = match.groups()
        destination = result.split("}")[0] if "}" in result else result
        if "S(5)" in destination:
            to_host += 1
        elif "S(5)" in operand or "S(5)" in result:
            to_device += 1
    return to_host, to_device


def _placed(value, device):
    """``value`` (an array or a ShapeDtypeStruct) as a ShapeDtypeStruct committed to ``device``."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)


def compile_for_h100(fn: Callable, *args: Any, donate_argnums=(), compiler_options: dict | None = None,
                     return_compiled: bool = False, device_memory_size: int | None = None):
    """Compile ``fn(*args)`` for the deviceless H100 and measure the program.

    Args:
        fn: a pure JAX function (what ``jax.jit`` accepts).
        *args: pytrees of arrays or ``jax.ShapeDtypeStruct``; only shapes and dtypes are used, each leaf is placed
            on the H100's device memory.
        donate_argnums: as ``jax.jit``'s (a training step donates its state, as Keras' ``fit`` does).
        compiler_options: XLA debug options for this compile (``{"xla_gpu_...": value}``).
        return_compiled: also return the ``jax.stages.Compiled`` (for its HLO text).
        device_memory_size: see `h100_device`.

    Returns:
        A `CompiledMemory`, or ``(CompiledMemory, Compiled)`` when ``return_compiled``.

    Raises:
        GpuCompileUnavailable: see `h100_device`.
    """
    device = h100_device(device_memory_size)
    placed = jax.tree.map(lambda v: _placed(v, device), args)
    start = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*placed)
    compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    to_host, to_device = count_host_copies(compiled.as_text())
    info = CompiledMemory(
        temp_bytes=int(stats.temp_size_in_bytes), argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes), alias_bytes=int(stats.alias_size_in_bytes),
        host_temp_bytes=int(stats.host_temp_size_in_bytes), to_host_copies=to_host, to_device_copies=to_device,
        compile_seconds=seconds,
    )
    return (info, compiled) if return_compiled else info


def keras_train_step(model) -> Callable:
    """One training step of a compiled Keras model as a pure function (what Keras' JAX ``fit`` jits).

    ``step(trainable, non_trainable, optimizer_vars, metrics_vars, x, y)`` runs the forward pass, the loss, the
    gradients (``jax.value_and_grad`` of the model's ``compute_loss_and_updates``) and the optimizer update
    (``optimizer.stateless_apply``), and returns ``(loss, trainable, non_trainable, optimizer_vars, metrics_vars)``.
    The model must be compiled (optimizer and loss) and its optimizer built.
    """

    def step(trainable, non_trainable, optimizer_vars, metrics_vars, x, y):
        grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
        (loss, aux), grads = grad_fn(trainable, non_trainable, metrics_vars, x, y, None, training=True,
                                     optimizer_variables=optimizer_vars)
        _, _, non_trainable, metrics_vars = aux
        trainable, optimizer_vars = model.optimizer.stateless_apply(optimizer_vars, grads, trainable)
        return loss, trainable, non_trainable, optimizer_vars, metrics_vars

    return step


def keras_step_arguments(model, x, y) -> tuple:
    """The arguments of `keras_train_step` as ShapeDtypeStructs: the model's state, then the batch ``(x, y)``."""
    spec = lambda v: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype)  # noqa: E731
    return ([spec(v) for v in model.trainable_variables], [spec(v) for v in model.non_trainable_variables],
            [spec(v) for v in model.optimizer.variables], [spec(v) for v in model.metrics_variables],
            spec(x), spec(y))


def compile_keras_step(model, x, y, **options):
    """`compile_for_h100` of `keras_train_step` (state donated, as ``fit`` does) for a batch shaped like ``(x, y)``.

    Trace under whatever stand-in calls should be in the program (``with host_residuals.host_residuals(...)``).
    ``options`` go to `compile_for_h100`.
    """
    return compile_for_h100(keras_train_step(model), *keras_step_arguments(model, x, y), donate_argnums=(0, 1, 2, 3),
                            **options)
