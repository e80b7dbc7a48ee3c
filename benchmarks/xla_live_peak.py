"""What is live on the device at the peak of a program XLA compiled: the buffers, from an XLA dump.

    XLA_FLAGS="--xla_dump_to=/tmp/xd --xla_dump_hlo_as_text" KERAS_BACKEND=jax JAX_PLATFORMS=cpu \\
        .venv-jax/bin/python benchmarks/jax_compiled_memory.py --max-cube --variants wrap --cube-range 384,384
    python benchmarks/xla_live_peak.py /tmp/xd --module jit_step

Why: ``memory_analysis()`` gives one number (device temp), and the live-range dump XLA writes beside it
(``*-live-range.txt``) ranks host buffers (memory space ``S(5)``: every ``copy-start`` to host) with device ones,
so its own "peak" is not the device's. This joins the dump's buffer assignment (which buffers are device memory,
their sizes) with its live ranges (first and last instruction of each) and prints the device-only peak, where it
is in the instruction sequence, and the largest buffers live there. On the 3D U-Net at 384^3 float32 it showed
that the wrapped step's peak is in the forward at the decoder's first convolution (docs/jax_findings.md), which the
report's and the earlier notes' reading ("a layer's backward") had missed.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

from rich.console import Console
from rich.table import Table

GIB = float(1 << 30)
_ALLOCATION = re.compile(r"allocation (\d+): size (\d+)(.*)")
_VALUE = re.compile(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_INSTRUCTION = re.compile(r"\s+(\d+):(\S+)")
_RANGE = re.compile(r"\s+(\S+):(\d+)-(\d+)")


def _one(folder: pathlib.Path, module: str, suffix: str) -> pathlib.Path:
    found = sorted(folder.glob(f"*{module}*gpu_after_optimizations-{suffix}"))
    if len(found) != 1:
        raise SystemExit(f"expected one *{module}*gpu_after_optimizations-{suffix} in {folder}, found {len(found)}; "
                         "pass --module with the jitted function's name")
    return found[0]


def device_buffers(assignment: pathlib.Path) -> dict:
    """Value name -> (bytes, shape, slot) for every value in a device allocation (color 0, not memory space S(5)).

    ``slot`` is ``(allocation, offset)``: values that share one are the same memory at different times, and one of
    them may be defined by the instruction that last reads another (an in-place update: a dynamic-update-slice
    writes into its operand's buffer), so their live ranges touch without the memory being there twice.
    """
    buffers, color, allocation = {}, 0, None
    for line in assignment.read_text().splitlines():
        match = _ALLOCATION.match(line)
        if match:
            found = re.search(r"color (\d+)", match.group(3))
            color, allocation = (int(found.group(1)) if found else 0), int(match.group(1))
            continue
        match = _VALUE.match(line)
        if match and color == 0 and ":S(5)" not in match.group(4):
            buffers[match.group(1)] = (int(match.group(2)), match.group(4), (allocation, int(match.group(3))))
    return buffers


def live_ranges(dump: pathlib.Path) -> tuple:
    """(instruction index -> name, value name -> (first, last) instruction) from a ``*-live-range.txt``."""
    sequence, ranges, section = {}, {}, None
    for line in dump.read_text().splitlines():
        if "InstructionSequence" in line:
            section = "sequence"
        elif "BufferLiveRange" in line:
            section = "ranges"
        elif "Live ranges at" in line:
            break
        elif section == "sequence" and (match := _INSTRUCTION.match(line)):
            sequence[int(match.group(1))] = match.group(2)
        elif section == "ranges" and (match := _RANGE.match(line)):
            # a non-tuple value is "name{}" here and "name" in the buffer assignment
            ranges[match.group(1).replace("{}", "")] = (int(match.group(2)), int(match.group(3)))
    return sequence, ranges


def device_peak(buffers: dict, sequence: dict, ranges: dict, after: int = -1) -> tuple:
    """(peak bytes, instruction index, [(bytes, name, shape, (first, last)), ...] live there, largest first).

    Memory is counted per slot (`device_buffers`): at each instruction a slot holds the largest of its values live
    there, so an in-place update's operand and result count once. ``after``: the peak among later instructions
    only (the backward's, once the forward's is known).
    """
    length = max(sequence) + 2 if sequence else 1
    slots = {}  # slot -> [(first, last, bytes)]
    for name, (first, last) in ranges.items():
        if name in buffers:
            slots.setdefault(buffers[name][2], []).append((first, last, buffers[name][0]))
    live = [0] * length
    for values in slots.values():
        occupied = {}
        for first, last, size in values:
            for t in range(first, min(last, length - 1) + 1):
                occupied[t] = max(occupied.get(t, 0), size)
        for t, size in occupied.items():
            live[t] += size
    at = max(range(max(0, after + 1), length), key=live.__getitem__)
    there = sorted(((buffers[n][0], n, buffers[n][1], r) for n, r in ranges.items()
                    if n in buffers and r[0] <= at <= r[1]), reverse=True)
    return live[at], at, there


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump", type=pathlib.Path, help="the --xla_dump_to folder")
    parser.add_argument("--module", default="jit_step", help="the jitted function's name in the dump's file names")
    parser.add_argument("--top", type=int, default=12, help="how many of the live buffers to list")
    parser.add_argument("--after", type=int, default=-1, help="the peak after this instruction (e.g. the backward's)")
    args = parser.parse_args(argv)
    buffers = device_buffers(_one(args.dump, args.module, "buffer-assignment.txt"))
    sequence, ranges = live_ranges(_one(args.dump, args.module, "live-range.txt"))
    peak, at, there = device_peak(buffers, sequence, ranges, args.after)
    table = Table(title=f"device buffers live at instruction {at} ({sequence.get(at)}): {peak / GIB:.2f} GiB")
    for column in ("GiB", "buffer", "shape (layout)", "live from", "to"):
        table.add_column(column, justify="right" if column in ("GiB", "live from", "to") else "left")
    for size, name, shape, (first, last) in there[:args.top]:
        table.add_row(f"{size / GIB:.2f}", name, shape, f"{first} {sequence.get(first, '')}", str(last))
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
