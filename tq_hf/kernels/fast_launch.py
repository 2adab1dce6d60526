"""Relaunch a Triton kernel's compiled variant without Triton's per-call Python.

`fn[grid](*args, **constexprs)` binds and specializes every argument, hashes a cache key, reads the
runtime knobs and builds launch metadata on every call: ~77 us of host time for the decode attention
kernel on the H200's host, whose kernel runs ~34 us. A decode step
repeats the same launch with arguments of the same kinds, so a launcher keys a plan on everything that
decides the variant (shapes, strides, dtypes, devices, the 16-byte alignment of every pointer, the
constexprs) and gives each launch site of the plan a `LaunchSite`: the first call goes through
Triton (compiling if needed); later calls run the compiled kernel's launcher directly.

The direct call uses Triton internals (CompiledKernel.run's argument order), checked against the
versions in _VERIFIED; with any other version, the interpreter, launch hooks installed (profilers),
or another current device, every call takes Triton's own path.
"""

from __future__ import annotations

import contextlib

import torch
import triton

_VERIFIED = ("3.6.",)  # Triton versions whose CompiledKernel.run argument order this module follows
_ENABLED = triton.__version__.startswith(_VERIFIED)
# compile options of every launch: FMA contraction, as the kernels were tuned and checked on the GPU (Triton's
# default through 3.9, which warns that 3.10 turns it off unless a launch asks for it)
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


def _driver():
    return triton.runtime.driver.active


def _hooks_installed() -> bool:
    """Whether a launch enter/exit hook is installed (a HookChain with calls, or a plain callable)."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(h, "calls", h) for h in hooks)


class LaunchSite:
    """One launch of a plan: grid, constexprs and options fixed; call with the runtime arguments."""

    __slots__ = ("fn", "grid", "kwargs", "_kernel", "_suffix", "_device")

    def __init__(self, fn, grid: tuple[int, int, int], kwargs: dict):
        self.fn, self.grid, self.kwargs = fn, grid, {**kwargs, **LAUNCH_OPTIONS}
        self._kernel = self._suffix = self._device = None

    def __call__(self, *args) -> None:
        if self.direct():
            self.run_direct(*args)
            return
        compiled = self.fn[self.grid](*args, **self.kwargs)
        if self._kernel is None:
            self.adopt(compiled, len(args))

    def direct(self) -> bool:
        """Whether a call now goes straight to the compiled kernel's launcher: it was adopted, its device is the
        current one and no launch hook is installed."""
        return self._kernel is not None and _driver().get_current_device() == self._device and not _hooks_installed()

    def regrid(self, grid: tuple[int, int, int]) -> "LaunchSite":
        """This site with `grid` for its next calls: for a launch whose grid follows a length that its compiled variant
        does not depend on (the caller's plan key says which variant)."""
        self.grid = grid
        return self

    def run_direct(self, *args) -> None:
        """The compiled kernel's launcher with these runtime arguments, after direct() said yes. A pointer argument
        may be an address (addresses()) instead of a tensor: the launcher then skips the tensor's data_ptr() call
        and the driver's lookup of the pointer (cuPointerGetAttribute), one each per tensor and launch."""
        kernel = self._kernel
        g0, g1, g2 = self.grid
        kernel.run(g0, g1, g2, _driver().get_current_stream(self._device), kernel.function, kernel.packed_metadata,
                   None, None, None, *args, *self._suffix)

    def adopt(self, compiled, n_args: int) -> None:
        """Keep the compiled kernel when the direct call applies: a verified Triton, a compiled (not
        interpreted) kernel, and every constexpr after the runtime arguments, each given by keyword."""
        names = getattr(self.fn, "arg_names", None)
        if not _ENABLED or names is None or not hasattr(compiled, "packed_metadata"):
            return
        tail = names[n_args:]
        if sorted(self.fn.constexprs) != list(range(n_args, len(names))) or any(n not in self.kwargs for n in tail):
            return
        self._suffix = tuple(self.kwargs[n] for n in tail)
        self._device = _driver().get_current_device()
        self._kernel = compiled


def addresses(args: tuple) -> tuple:
    """args with every tensor replaced by its address (data_ptr()): what LaunchSite.run_direct may take for tensors
    the caller keeps alive (a held launch's lasting arguments, computed once)."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def int_key(v: int) -> tuple[bool, bool, bool]:
    """What Triton specializes an int launch argument on (unless told not to): being 1, divisibility by 16, the 32-bit
    range. A plan keyed on it adopts the variant that serves every value of the same key."""
    return v == 1, v % 16 == 0, -(1 << 31) <= v < (1 << 31)


def pointer_key(t: torch.Tensor) -> tuple:
    """What of a tensor argument decides the compiled variant when its shape and strides do not: dtype, device and
    16-byte alignment."""
    return t.dtype, t.get_device(), t.data_ptr() & 15


def variant_key(args) -> tuple:
    """pointer_key of every tensor and int_key of every int in args: what decides the compiled variant of a launch
    whose grid, not variant, follows its lengths."""
    return tuple(pointer_key(a) if isinstance(a, torch.Tensor) else int_key(a) for a in args)


def device_of(t: torch.Tensor):
    """A context making t's CUDA device the current one (Triton launches on the current device's
    current stream), or nothing when it already is: under a device_map a layer's cache lives on
    another GPU than the current device, and its launches must run on that GPU, after the work of
    its current stream that produced their inputs."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def argument_key(t) -> tuple | type:
    """What of a launcher argument decides validation and the compiled variant: a tensor's dtype,
    shape, strides, device and 16-byte alignment (Triton specializes pointers on it); else its type."""
    if isinstance(t, torch.Tensor):
        return t.dtype, t.shape, t.stride(), t.get_device(), t.data_ptr() & 15
    return type(t)


def holdable_offset(key_offset) -> bool:
    """Whether a key_offset reaches the kernel as given (None, or fp32 and contiguous): only then may a held launch
    keep it, as a converted copy would miss the caller's later in-place writes to the original."""
    return key_offset is None or (key_offset.dtype == torch.float32 and key_offset.is_contiguous())


def value_key(v) -> object:
    """A scalar launcher argument as a plan key: ints, floats, bools and None by value, else by identity."""
    return v if v is None or type(v) in (int, float, bool) else (type(v), id(v))


class PlanCache(dict):
    """Launch plans by argument key, dropped wholesale when full (prefill shapes vary with the prompt;
    decode reuses a handful)."""

    limit = 512

    def put(self, key, plan):
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan
        return plan
