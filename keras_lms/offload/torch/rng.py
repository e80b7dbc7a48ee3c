"""torch's global RNG states, captured at a forward call and restored around its recompute."""

from __future__ import annotations

import contextlib

import torch


class _RngState:
    """torch's global RNG states at the forward call, re-used by the recompute (as torch.utils.checkpoint does).

    Keras' torch Dropout without a seed draws its mask from torch's global generator, not from a Keras
    SeedGenerator variable, so the variable snapshot alone would not reproduce it.
    """

    __slots__ = ("cpu", "cuda")

    def __init__(self, cpu, cuda):
        self.cpu, self.cuda = cpu, cuda

    @classmethod
    def capture(cls, tensors):
        cuda = {}
        if torch.cuda.is_available():
            devices = {t.device.index for t in tensors if t.is_cuda}
            devices.add(torch.cuda.current_device())
            cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
        return cls(torch.get_rng_state(), cuda)

    @contextlib.contextmanager
    def restored(self):
        with torch.random.fork_rng(devices=sorted(self.cuda), enabled=True):
            torch.set_rng_state(self.cpu)
            for device, state in self.cuda.items():
                torch.cuda.set_rng_state(state, device)
            yield
