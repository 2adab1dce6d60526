"""What the launch heuristics need to know about the device a launch runs on, as one explicit value.

The launchers pick tile sizes, split counts and code decoders from these traits; by default they are read
from the pool's device (`device_traits`). Tests and eval harnesses pass their own (for example `H200`) to
see a GPU's choices on CPU tensors without running anything there.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

INTERPRETER_SMS = 4  # the Triton interpreter: a few splits, so the split path is exercised cheaply


@dataclasses.dataclass(frozen=True)
class DeviceTraits:
    """num_sms: streaming multiprocessors, which size the split counts. runs_ptx: launches compile to PTX, so
    the inline-asm decoders can run (not under the interpreter). tuned_for_gpu: take a GPU's launch heuristics
    (long tiles, register caps); the interpreter gets small tiles."""

    num_sms: int
    runs_ptx: bool
    tuned_for_gpu: bool

    def __post_init__(self):
        if type(self.num_sms) is not int or self.num_sms < 1:
            raise ValueError(f"DeviceTraits.num_sms must be a positive int, got {self.num_sms!r}")
        for name in ("runs_ptx", "tuned_for_gpu"):
            if type(getattr(self, name)) is not bool:
                raise TypeError(f"DeviceTraits.{name} must be a bool, got {getattr(self, name)!r}")


# An H200 (132 SMs) as its launches see it; with CPU tensors the launch choices of that GPU, for tests and
# eval.compile_check (the interpreter cannot run PTX, so such plans are inspected or compiled, not run).
H200 = DeviceTraits(num_sms=132, runs_ptx=True, tuned_for_gpu=True)
INTERPRETER = DeviceTraits(num_sms=INTERPRETER_SMS, runs_ptx=False, tuned_for_gpu=False)

_TRAITS: dict[torch.device, DeviceTraits] = {}


def device_traits(device: torch.device) -> DeviceTraits:
    """The traits of a real device (cached): a CUDA GPU's SM count, PTX and GPU heuristics; else the interpreter's."""
    traits = _TRAITS.get(device)
    if traits is None:
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            traits = DeviceTraits(num_sms=sms, runs_ptx=True, tuned_for_gpu=True)
        else:
            traits = INTERPRETER
        _TRAITS[device] = traits
    return traits


@contextlib.contextmanager
def assumed_traits(device: torch.device, traits: DeviceTraits):
    """Within the block, launches on `device` plan with `traits`: for harnesses that run a GPU's launch choices on
    CPU tensors through code that passes no traits (eval.host_overhead through the cache and attention glue)."""
    saved = _TRAITS.get(device)
    _TRAITS[device] = traits
    try:
        yield
    finally:
        if saved is None:
            _TRAITS.pop(device, None)
        else:
            _TRAITS[device] = saved
