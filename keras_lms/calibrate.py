"""`keras-lms calibrate`: measure a device profile on this machine's GPU (torch), for the step-time model.

The built-in profiles (keras_lms/planning/profiles/) are published or estimated figures; a user's machine has its
own link (PCIe generation and lanes, the host's memory, NUMA placement) and its own convolution rates at the
channel counts it trains. This measures the fields of a ``DeviceProfile`` with torch, the only framework here with
explicit copy streams, and writes them as JSON that ``keras_lms.report(..., device_profile=FILE)`` and
``keras-lms report --profile FILE`` read:

- pinned host -> device and device -> host copies on a side stream (as keras-lms' torch back end copies), alone
  and concurrently (one stream per direction, both started together);
- element-wise bandwidth (an in-place multiply: read + write);
- strided layout copies: a 16-channel channels-last 3D tensor copied to channels-first and back, as Keras on
  torch does around every convolution;
- Conv3D forward + backward at 16, 32 and 64 channels (and Conv2D at 64), in float32 (TF32 allowed, as Keras
  trains by default on Ampere and later) and in float16; the profile keeps the Conv3D rates by channel count
  (``convolution_flops_per_second``: an H200 ran 16 channels 5.6x slower than 64) and their median as the rate
  of other kernels.

The measurement needs TF32 and cuDNN's autotuner on; the process's own settings are put back afterwards, so
calibrating inside a training script changes nothing it runs later.

``--smoke`` runs the same code on the CPU at tiny sizes (CI checks it end to end); its numbers describe nothing.
"""

from __future__ import annotations

import statistics
import time

CONV3D_CHANNELS = (16, 32, 64)


class _Timer:
    """Seconds of ``fn`` on ``device``: CUDA events on a stream, or wall time on the CPU."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"

    def seconds(self, fn, reps: int) -> float:
        torch = self.torch
        times = []
        for _ in range(reps + 1):  # the first run warms up (allocations, cuDNN autotuning)
            if self.cuda:
                torch.cuda.synchronize(self.device)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
        return statistics.median(times[1:])


def _copies(torch, device, nbytes: int, timer, reps: int) -> dict:
    n = nbytes // 4
    cuda = device.type == "cuda"
    host_in = torch.ones(n, dtype=torch.float32, pin_memory=cuda)
    host_out = torch.empty(n, dtype=torch.float32, pin_memory=cuda)
    dev_in = torch.empty(n, dtype=torch.float32, device=device)
    dev_out = torch.ones(n, dtype=torch.float32, device=device)
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)

    def on(stream, fn):
        if stream is None:
            return fn()
        with torch.cuda.stream(stream):
            return fn()

    def h2d():
        on(streams[0], lambda: dev_in.copy_(host_in, non_blocking=True))
        if cuda:
            torch.cuda.current_stream(device).wait_stream(streams[0])

    def d2h():
        on(streams[1], lambda: host_out.copy_(dev_out, non_blocking=True))
        if cuda:
            torch.cuda.current_stream(device).wait_stream(streams[1])

    solo_in, solo_out = nbytes / timer.seconds(h2d, reps), nbytes / timer.seconds(d2h, reps)
    if not cuda:  # one memory system: nothing to learn about concurrency
        return {"host_to_device": solo_in, "device_to_host": solo_out,
                "host_to_device_concurrent": solo_in, "device_to_host_concurrent": solo_out}
    both_in, both_out = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        ends = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        start.record()
        for stream, end, (dst, src) in zip(streams, ends, ((dev_in, host_in), (host_out, dev_out))):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                end.record(stream)
        torch.cuda.synchronize(device)
        both_in.append(start.elapsed_time(ends[0]) / 1e3)
        both_out.append(start.elapsed_time(ends[1]) / 1e3)
    # each direction's time while the other copies too (the one that ends first ran alone for its last part:
    # a slight over-estimate of the concurrent rate of the slower one)
    return {"host_to_device": solo_in, "device_to_host": solo_out,
            "host_to_device_concurrent": nbytes / statistics.median(both_in[1:]),
            "device_to_host_concurrent": nbytes / statistics.median(both_out[1:])}


def _elementwise(torch, device, nbytes: int, timer, reps: int) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return 2 * nbytes / timer.seconds(lambda: x.mul_(1.0000001), reps)


def _layout_copies(torch, device, nbytes: int, timer, reps: int) -> float:
    """Bytes/s (read + written) of Keras-on-torch's layout copies: channels-last -> channels-first -> back."""
    edge = max(2, round((nbytes / 4 / 16) ** (1 / 3)))
    x = torch.ones(1, edge, edge, edge, 16, dtype=torch.float32, device=device)

    def copies():
        first = x.permute(0, 4, 1, 2, 3).contiguous()
        first.contiguous(memory_format=torch.channels_last_3d)

    return 4 * x.numel() * 4 / timer.seconds(copies, reps)


def _conv_rate(torch, device, dims: int, channels: int, edge: int, dtype, timer, reps: int) -> float:
    """FLOP/s of one convolution's forward and backward (input and weight gradients: 3x the forward)."""
    conv = (torch.nn.Conv3d if dims == 3 else torch.nn.Conv2d)(channels, channels, 3, padding=1, bias=False)
    conv = conv.to(device=device, dtype=dtype)
    x = torch.randn(1, channels, *([edge] * dims), device=device, dtype=dtype, requires_grad=True)

    def step():
        y = conv(x)
        y.backward(torch.ones_like(y))

    flops = 3 * 2.0 * edge**dims * 3**dims * channels * channels
    return flops / timer.seconds(step, reps)


def measure_profile(device: str = "cuda", smoke: bool = False, name: str | None = None):
    """Measure a ``DeviceProfile`` on ``device`` (see the module docstring); ``smoke``: CPU-sized, any device."""
    try:
        import torch
    except ImportError as err:
        raise ValueError("keras-lms calibrate measures with torch: pip install torch (a CUDA build on the GPU "
                         "machine), then run it again.") from err
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("torch sees no CUDA device to calibrate. Run it on the GPU machine, or pass --smoke "
                         "for a CPU run of the measuring code (its numbers describe nothing).")
    if dev.type != "cuda" and not smoke:
        raise ValueError(f"keras-lms calibrate measures a GPU; device {device!r} is not one. Pass --device cuda:N, or "
                         "--smoke for a CPU run of the measuring code.")
    saved = _torch_settings(torch)
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
        return _measure(torch, dev, smoke, name)
    finally:
        _restore_torch_settings(torch, saved)


def _torch_settings(torch) -> tuple:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)


def _restore_torch_settings(torch, saved: tuple) -> None:
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark) = saved


def _measure(torch, dev, smoke: bool, name: str | None):
    from keras_lms.planning.device_profile import DeviceProfile

    timer = _Timer(torch, dev)
    reps = 2 if smoke else 5
    link_bytes, edge3, edge2 = (4 << 20, 8, 16) if smoke else (512 << 20, 96, 512)
    copies = _copies(torch, dev, link_bytes, timer, reps)
    elementwise = _elementwise(torch, dev, link_bytes, timer, reps)
    layout = _layout_copies(torch, dev, link_bytes, timer, reps)
    conv = {}
    dtypes = {"float32": torch.float32} if smoke else {"float32": torch.float32, "float16": torch.float16}
    for label, dtype in dtypes.items():
        conv[label] = {f"conv3d_{c}": _conv_rate(torch, dev, 3, c, edge3, dtype, timer, reps) for c in CONV3D_CHANNELS}
        conv[label]["conv2d_64"] = _conv_rate(torch, dev, 2, 64, edge2, dtype, timer, reps)
    flops = {label: statistics.median(v for k, v in rates.items() if k.startswith("conv3d"))
             for label, rates in conv.items()}
    if "float16" in flops:
        flops["bfloat16"] = flops["float16"]
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (--smoke)"
    measured = f"measured by keras-lms calibrate on {where}, {time.strftime('%Y-%m-%d')}"
    detail = "; ".join(f"{label} {k} {v / 1e12:.1f} TFLOP/s" for label, rates in conv.items() for k, v in rates.items())
    sources = {f: measured for f in ("host_to_device_bytes_per_second", "device_to_host_bytes_per_second",
                                     "host_to_device_concurrent_bytes_per_second",
                                     "device_to_host_concurrent_bytes_per_second", "elementwise_bytes_per_second",
                                     "layout_copy_bytes_per_second")}
    sources["flops_per_second"] = f"{measured}: median of the Conv3D rates at 16-64 channels ({detail})"
    by_channels = {label: {str(c): rates[f"conv3d_{c}"] for c in CONV3D_CHANNELS} for label, rates in conv.items()}
    if "float16" in by_channels:
        by_channels["bfloat16"] = dict(by_channels["float16"])
    sources["convolution_flops_per_second"] = (f"{measured}: Conv3D forward + backward, {edge3}^3 voxels, "
                                               "c -> c channels, by c" + ("; bfloat16 taken as float16"
                                                                          if "bfloat16" in by_channels else ""))
    if "bfloat16" in flops:
        sources["flops_per_second"] += "; bfloat16 taken as float16"
    memory = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 0
    sources["memory_bytes"] = measured
    return DeviceProfile(
        name=name or ("smoke-cpu" if smoke else where.lower().replace(" ", "-")), description=where,
        flops_per_second=flops, elementwise_bytes_per_second=elementwise,
        host_to_device_bytes_per_second=copies["host_to_device"],
        device_to_host_bytes_per_second=copies["device_to_host"],
        host_to_device_concurrent_bytes_per_second=copies["host_to_device_concurrent"],
        device_to_host_concurrent_bytes_per_second=copies["device_to_host_concurrent"],
        memory_bytes=memory, sources=sources, convolution_flops_per_second=by_channels,
        layout_copy_bytes_per_second=layout)
