"""Evaluate a backward rule a window of rows at a time, so that XLA never holds its full-size temporaries.

In the program XLA compiles for a GPU, a lean backward written on whole tensors (``lean_norm``'s batch-norm
gradient, ``lean``'s block transposed convolution) is fused into few kernels, and where its operands arrive in
different layouts (the input copied back from host channels-last, the cotangent of a cuDNN convolution
channels-first) XLA materialises a transposed, float32 copy of the whole tensor first. At the 3D U-Net's
mixed_float16 cube of 496^3 that copy of ``down0_bn1``'s centred input (7.27 GiB) was the step's peak
(docs/jax_findings.md).

Both rules are sums over the rows of an axis (the batch-norm statistics, a kernel gradient) and row-local maps
(an input gradient's rows read only the matching rows of the cotangent). `over_rows` evaluates them a window of
rows at a time: each window's slices are cut only once the previous window's partial sum or written rows exist
(``lax.optimization_barrier``), and the mapped rows are written in place into one output buffer
(``lax.dynamic_update_slice``), so only one window's temporaries exist at a time. The result equals the whole-tensor
rule up to the order of float additions.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

__all__ = ["bounds", "device_rows", "held_channels_first", "host_copy", "nbytes", "on_host", "over_rows",
           "row_axis", "window_count"]


def window_count(nbytes: int, rows: int, slab_bytes: int) -> int:
    """How many windows a rule over ``rows`` rows of ``nbytes`` runs in: ``nbytes / slab_bytes`` (1: whole)."""
    if not slab_bytes or nbytes <= slab_bytes or rows < 2:
        return 1
    return max(1, min(rows, -(-nbytes // slab_bytes)))


def bounds(rows: int, windows: int) -> list:
    """``windows`` contiguous ``(start, stop)`` row ranges covering ``rows``, of near-equal length."""
    return [(rows * i // windows, rows * (i + 1) // windows) for i in range(windows)]


def over_rows(fn: Callable, arrays: Sequence, scales: Sequence[int], rows: int, windows: int, axis: int = 1,
              out=None, halos: Sequence[int] | None = None, axes: Sequence[int] | None = None,
              overwrite: Sequence[int | None] | None = None):
    """Evaluate ``fn`` over windows of rows and combine: ``(sum of its partial sums, its rows assembled)``.

    Args:
        fn: ``fn(*slices) -> (partial_sums, piece)``; ``slices`` are ``arrays`` cut to one window's rows along
            ``axis``; ``partial_sums`` a pytree summed over the windows; ``piece`` the window's rows of the
            assembled result (a list of pieces when ``out`` is a list; None when ``out`` is None).
        arrays: the tensors sliced; array ``i`` has ``scales[i]`` rows per row of the window (a block transposed
            convolution's cotangent has ``k`` rows per input row).
        rows: rows of scale 1 along ``axis``.
        windows: how many windows (`window_count`); 1 evaluates ``fn`` on the whole arrays (widened by their
            halos).
        out: ``(shape, dtype, scale)`` of the assembled result, a list of them, or None; ``(shape, dtype, scale,
            True)`` assembles it in host memory (a window's rows are copied there as they are made: the gradient
            of an input that lives on host, `on_host`).
        halos: rows array ``i``'s slices extend beyond the window on each side (a convolution's halo), zero
            beyond the array's edges; None: none.
        axes: the axis each array is cut along, where it is not ``axis`` (an array stored channels-first); the
            assembled result is written along ``axis``.
        overwrite: per assembled result, the index of an array (scale 1, cut along ``axis``, on the device, of the
            result's shape and dtype, read by nothing after this) whose buffer it is written into instead of a new
            one (None: a new one), so a gradient takes its cotangent's place. The array's rows a window reads
            below its start were overwritten by the window before: they come from a copy of those halo rows
            taken before that write.

    An array in host memory (`on_host`: a residual the backward streams) is sliced there and only each window's
    rows are copied to the device, so the whole array never exists on the device (in the program XLA compiles for
    a GPU, each slice is an asynchronous ``dynamic-slice`` out of memory space ``S(5)``).

    Returns:
        ``(sums, assembled)``: ``sums`` the partial sums added up (in their dtype), ``assembled`` the result's rows
        written window by window (a list for a list ``out``; None without ``out``).
    """
    arrays = tuple(arrays)
    halos = tuple(halos) if halos is not None else (0,) * len(arrays)
    axes = tuple(axes) if axes is not None else (axis,) * len(arrays)
    outs = out if isinstance(out, list) else ([] if out is None else [out])

    def cut(start, stop):
        return [device_rows(x, start * s, stop * s, h, a) for x, s, h, a in zip(arrays, scales, halos, axes)]

    if windows <= 1:  # (``axis`` may then be None: a tensor with no row axis)
        return fn(*(cut(0, rows) if any(halos) else [_on_device(x) for x in arrays]))
    overwrite = list(overwrite) if overwrite is not None else [None] * len(outs)
    spans = bounds(rows, windows)
    for j, k in enumerate(overwrite):  # (a window narrower than its halo cannot carry it: a new buffer)
        if k is not None and any(b - a < halos[k] for a, b in spans):
            overwrite[j] = None
    arrays, buffers = list(arrays), []
    if outs:
        # The output buffers are made once the operands exist as the windows read them (XLA would otherwise
        # allocate them first, beside an operand and that operand's copy in another layout).
        arrays, zero = jax.lax.optimization_barrier((arrays, jnp.zeros((), jnp.float32)))
        buffers = [arrays[k] if k is not None else _to_host(jnp.broadcast_to(zero.astype(o[1]), o[0]), _host_out(o))
                   for o, k in zip(outs, overwrite)]
    carries = {k: None for k in overwrite if k is not None}  # array index -> its rows just below the window
    total = None
    for i, (start, stop) in enumerate(spans):
        if i:  # this window's slices are cut once the previous window's sum and rows exist
            arrays, total, buffers, carries = jax.lax.optimization_barrier((arrays, total, buffers, carries))
        slices = cut(start, stop)
        for k, carry in carries.items():
            if carry is not None:  # rows start - halo .. start were overwritten: the copy taken before
                upper = device_rows(arrays[k], start + halos[k], stop, halos[k], axis)
                slices[k] = jnp.concatenate([carry, upper], axis=axis)
        partial, pieces = fn(*slices)
        total = partial if total is None else jax.tree.map(jnp.add, total, partial)
        pieces = pieces if isinstance(out, list) else [pieces]
        pieces = [_to_host(p.astype(o[1]), _host_out(o)) for p, o in zip(pieces, outs)]
        for k in carries:  # the next window's lower halo, copied before this window's rows are written
            if halos[k]:
                carries[k] = jax.lax.slice_in_dim(arrays[k], stop - halos[k], stop, axis=axis)
        if carries:
            carries, pieces = jax.lax.optimization_barrier((carries, pieces))
        buffers = [jax.lax.dynamic_update_slice_in_dim(b, p, start * o[2], axis)
                   for b, p, o in zip(buffers, pieces, outs)]
        for j, k in enumerate(overwrite):
            if k is not None:
                arrays[k] = buffers[j]
    return total, (buffers if isinstance(out, list) else (buffers[0] if buffers else None))


def host_copy(x, windows: int):
    """A copy of ``x`` in host memory, made a window of rows (of axis 1) at a time when ``windows`` > 1: XLA holds
    a 5-D activation channels-first (a float32 one, and the float16 input of a convolution), and its channels-last
    host copy would otherwise be made from a transposed full-size copy on the device (the forward's peak at the 3D
    U-Net's 480^3 float32 cube, for the parked skip, and at 624^3 mixed_float16, for the head's input); a
    window's transpose is a window."""
    if windows <= 1 or x.ndim < 3:
        return jax.device_put(x, jax.memory.Space.Host)
    _, copy = over_rows(lambda rows: ((), rows), [x], [1], x.shape[1], windows, out=(x.shape, x.dtype, 1, True))
    return copy


def on_host(x) -> bool:
    """``x`` (an array or a tracer) lives in host memory (``jax.memory.Space.Host``)."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def held_channels_first(x) -> bool:
    """XLA's GPU layout assignment runs float32 3D convolutions channels-first, so a float32 5-D activation exists
    on the device channels-first, and a host copy of it in Keras' channels-last order is a transposed full-size
    temporary (4.81 GiB at the 3D U-Net's 432^3 float32 cube, at the decoder's up-sampled tensor). Stored
    channels-first (logically), the copy is the device buffer's bytes (XLA makes the transpose a bitcast)."""
    return x.ndim == 5 and x.dtype == jnp.float32 and not on_host(x)


def _on_device(x):
    return jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x


def _host_out(spec) -> bool:
    return len(spec) > 3 and bool(spec[3])


def _to_host(x, host: bool):
    return jax.device_put(x, jax.memory.Space.Host) if host else x


def device_rows(x, start: int, stop: int, halo: int, axis: int):
    """Rows ``start - halo .. stop + halo`` of ``x`` along ``axis`` on the device, zero beyond its edges (for an
    ``x`` in host memory: only those rows are copied)."""
    length = x.shape[axis]
    lo, hi = start - halo, stop + halo
    if (lo, hi) == (0, length):
        return _on_device(x)
    piece = _on_device(jax.lax.slice_in_dim(x, max(lo, 0), min(hi, length), axis=axis))
    if lo >= 0 and hi <= length:
        return piece
    padding = [(0, 0)] * x.ndim
    padding[axis] = (max(0, -lo), max(0, hi - length))
    return jnp.pad(piece, padding)


def row_axis(ndim: int, excluded: Sequence[int]) -> int | None:
    """The first axis after the batch axis not in ``excluded`` (the channel axis): the axis windows cut."""
    return next((a for a in range(1, ndim) if a not in {e % ndim for e in excluded}), None)


def nbytes(x) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
