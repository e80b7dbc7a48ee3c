"""Grappler's own swaps, as a GPU build of TensorFlow would make them, in a CPU-only TensorFlow.

Grappler's memory optimizer (``memory_optimizer.cc``, ``SwappingPass``) estimates a graph's GPU memory
(``GraphMemory::InferStatically``) and, when the estimate exceeds the GPU's ``memory_size``, inserts swap pairs:
``swap_out_<consumer>_<i>`` (op ``_CopyFromGpuToHost``, reading the tensor right after it is made) and
``swap_in_<consumer>_<i>`` (``_CopyFromHostToGpu``, reading the host copy, gated by a control input from a
"trigger" op chosen so that the copy back arrives just in time), and rewires the consumer to the copy back.
It does this on a real 16 GiB GPU, for plain Keras graphs too, so a simulator that gives grappler 1 TiB measures
a plain Keras that cannot swap (issue 28).

A CPU-only TensorFlow registers neither op, so every grappler pass after the memory optimizer fails on the
unknown op and leaves the graph as it was, and the virtual scheduler cannot run it. ``register_swap_ops``
registers both by their signature (one input and one output of any type, shape unchanged: what a GPU build
registers) from a tiny C++ library compiled against the installed TensorFlow on first use (about 5 s, cached
per TensorFlow version under ``~/.cache/keras-lms``). Nothing ever executes them; they exist for grappler and
the virtual scheduler. ``keras_lms/testing/timeline_peak.py`` keeps a swap-out's output in host memory.

``swap_pairs`` lists the pairs in an optimised graph: what grappler swapped, which consumer reads the copy back
and which op triggers it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess

SWAP_OUT_OP = "_CopyFromGpuToHost"
SWAP_IN_OP = "_CopyFromHostToGpu"

_SOURCE = """\
// Grappler's swap ops by signature (keras_lms/testing/grappler_swaps.py): never executed.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"

REGISTER_OP("_CopyFromGpuToHost").Input("input: T").Output("output: T").Attr("T: type")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape);
REGISTER_OP("_CopyFromHostToGpu").Input("input: T").Output("output: T").Attr("T: type")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape);
"""


class SwapOpsBuildError(RuntimeError):
    """The swap-op library could not be compiled (no C++ compiler, or TensorFlow's headers are missing)."""


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("KERAS_LMS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "keras-lms")
    return pathlib.Path(root) / "grappler-swap-ops"


def _library_path(tf) -> pathlib.Path:
    """One library per TensorFlow build (its version and include path) and per source text."""
    key = hashlib.sha256("\n".join([tf.__version__, tf.sysconfig.get_include(), _SOURCE]).encode()).hexdigest()
    return _cache_dir() / f"swap_ops-{tf.__version__}-{key[:12]}.so"


def _compile(tf, target: pathlib.Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise SwapOpsBuildError("simulating grappler's swaps needs a C++ compiler (g++) to register its two swap "
                                "ops: install g++, or simulate without gpu_memory_bytes")
    target.parent.mkdir(parents=True, exist_ok=True)
    source = target.with_suffix(".cc")
    source.write_text(_SOURCE)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    command = [compiler, "-std=c++17", "-shared", "-fPIC", "-O1", "-w", str(source), "-o", str(partial),
               *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SwapOpsBuildError(f"compiling grappler's swap ops failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
    os.replace(partial, target)  # atomic: parallel test workers never load a half-written library


def register_swap_ops() -> pathlib.Path:
    """Register ``_CopyFromGpuToHost`` / ``_CopyFromHostToGpu`` in this process (idempotent); the library's path."""
    import tensorflow as tf
    from tensorflow.python.framework import op_def_registry

    path = _library_path(tf)
    if op_def_registry.get(SWAP_OUT_OP) is None:
        if not path.exists():
            _compile(tf, path)
        tf.load_op_library(str(path))
    return path


@dataclasses.dataclass(frozen=True)
class SwapPair:
    """One swap grappler inserted: ``tensor`` goes to host and comes back for ``consumer``, after ``trigger``."""

    swap_out: str
    swap_in: str
    tensor: str  # the swapped tensor, "node:port"
    consumer: str  # the op that reads the copy back
    trigger: str  # the op whose completion starts the copy back ("" when grappler found none)


def swap_pairs(graph_def) -> list:
    """The swap pairs in an optimised graph (empty when grappler inserted none)."""
    nodes = {n.name: n for n in graph_def.node}
    readers = {}
    for node in graph_def.node:
        for raw in node.input:
            if not raw.startswith("^"):
                readers.setdefault(raw.split(":")[0], node.name)
    pairs = []
    for node in graph_def.node:
        if node.op != SWAP_IN_OP:
            continue
        data = [i for i in node.input if not i.startswith("^")]
        control = [i[1:] for i in node.input if i.startswith("^")]
        out = nodes.get(data[0].split(":")[0]) if data else None
        if out is None or out.op != SWAP_OUT_OP:
            continue
        tensor = out.input[0] if ":" in out.input[0] else f"{out.input[0]}:0"
        pairs.append(SwapPair(out.name, node.name, tensor, readers.get(node.name, ""),
                              control[0] if control else ""))
    return pairs
