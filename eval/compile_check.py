"""Compile the Triton kernels for a GPU that is not here (default sm_90a, the H200) and report the
shared memory each launch variant needs: what the interpreter cannot tell.

The attention launch is planned on CPU tensors with the H200's DeviceTraits (plan_attention) and the
store's launch captured; each variant is compiled by the installed Triton (its bundled ptxas) with the
specialisations a real launch gets (16-byte divisibility of pointers and of ints that are
multiples of 16). Against the GPU's own compiler version (`pip install --target DIR triton==3.6.0`,
then `PYTHONPATH=DIR`), the figures matched Nsight Compute on the H200 (102,400 B for 4bit decode at
head_dim 128), and they found 3-bit keys at head_dim 256 needing 262,144 B (fixed).

    python -m eval.compile_check [--presets 4bit,k3v4] [--head-dims 128,256] [--modes decode] [--levers on]

--tests PATH... compiles every kernel launch those (CPU) tests make instead: a stand-in CUDA driver for sm_90a
makes each launch compile with the specialisations a real launch gets and run nothing, with the H200's launch
choices. The tests' numeric checks then fail (nothing ran) and are not reported; a launch that does not compile
is. Triton 3.6's layout pass rejected a store kernel variant this way that the interpreter and the variants
above compiled.

    python -m eval.compile_check --tests tests/kernels/test_kernel_store.py tests/kernels/test_held_launch.py
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from contextlib import contextmanager

import torch

H200_SHARED_LIMIT = 232448  # bytes of shared memory one program may use on an H200 (sm_90a)
NO_SPECIALIZE = ("recent_from", "Lq", "num_splits", "prefix_len")  # the attention kernel's do_not_specialize
TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32",
         torch.int64: "i64", torch.float32: "fp32"}


@contextmanager
def captured_launches():
    """The store launcher's launch on CPU tensors, recorded, not run."""
    from tq_hf.kernels import store

    seen: dict = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def record(*args, **kwargs):
                seen[self.name] = (args, kwargs)
            return record

    saved = store._store_kernel
    store._store_kernel = Recorder("store")
    try:
        yield seen
    finally:
        store._store_kernel = saved


def compile_shared(fn, args: tuple, kwargs: dict, arch: int) -> int:
    """Compile `fn` for CUDA `arch` with these launch arguments; its shared memory in bytes."""
    return compile_variant(fn, args, kwargs, arch).metadata.shared


def compile_variant(fn, args: tuple, kwargs: dict, arch: int):
    """`fn` compiled for CUDA `arch` with these launch arguments (Triton's CompiledKernel: asm, metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tq_hf.kernels.fast_launch import LAUNCH_OPTIONS

    kwargs = dict(kwargs)
    # the options every launch passes (fast_launch.LAUNCH_OPTIONS), as given where a plan's constants carry them
    options = {"num_warps": kwargs.pop("num_warps", 4), **{k: kwargs.pop(k, v) for k, v in LAUNCH_OPTIONS.items()}}
    if kwargs.get("maxnreg"):
        options["maxnreg"] = kwargs.pop("maxnreg")
    if "num_stages" in kwargs:
        options["num_stages"] = kwargs.pop("num_stages")
    if kwargs.get("launch_pdl"):  # programmatic dependent launch (LaunchConfig.pdl): the launch's attribute
        options["launch_pdl"] = kwargs.pop("launch_pdl")
    signature, constexprs, attrs, values = {}, {}, {}, iter(args)
    for index, param in enumerate(fn.params):
        if param.is_constexpr:
            constexprs[param.name] = kwargs[param.name]
            signature[param.name] = "constexpr"
            continue
        value = next(values)
        if isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPES[value.dtype]
        else:
            signature[param.name] = "fp32" if isinstance(value, float) else "i32"
        if isinstance(value, torch.Tensor) or (type(value) is int and value % 16 == 0 and param.name not in NO_SPECIALIZE):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def variants(presets: list[str], head_dims: list[int], modes=("decode", "prefill"), levers=(False, True)):
    """(tag, kernel function, args, kwargs) for each launch the GPU would make."""
    from tq_hf.config import TurboQuantConfig
    from tq_hf.kernels import attention, plan_attention, store, store_kv
    from tq_hf.kernels.device import H200
    from tq_hf.layout import BlockLayout

    real_store = store._store_kernel
    hk, group, rows = 2, 4, 3
    for preset, d, mode, on in itertools.product(presets, head_dims, modes, levers):
        options = dict(key_centering=True, value_rotation=True, exact_prefix_tokens=4, recent_window=32) if on else \
            dict(key_centering=False, value_rotation=False, exact_prefix_tokens=0, recent_window=0)
        rotation = "hadamard" if d & (d - 1) == 0 else "random"
        layout = BlockLayout(TurboQuantConfig.from_preset(preset, rotation=rotation, **options), hk, d)
        pool, table = layout.allocate(64, "cpu"), torch.arange(60, dtype=torch.int32).view(rows, 20)
        query = torch.randn(rows, hk * group, 1 if mode == "decode" else 100, d, dtype=torch.bfloat16)
        extra = {}
        if on:
            prefix, ring = torch.randn(rows, hk, 4, d, dtype=torch.bfloat16), torch.randn(rows, hk, 32, d, dtype=torch.bfloat16)
            extra = dict(key_offset=torch.randn(rows, hk, d), prefix_keys=prefix, prefix_values=prefix,
                         recent_keys=ring, recent_values=ring, recent_from=0, kv_start=torch.tensor([0, 3, 1]),
                         sliding_window=200, sinks=torch.randn(hk * group), softcap=30.0)
        tag = f"{preset} head_dim {d} {'levers' if on else 'plain'}"
        seq_lens = torch.tensor([300, 250, 120])
        recent_from = extra.pop("recent_from", 0)
        plan = plan_attention(query, pool, layout, table, seq_lens, 0.1, max_seq_len=320, device_traits=H200, **extra)
        args, _, _ = attention.kernel_arguments(plan, query, pool, table, seq_lens, torch.empty_like(query),
                                                kv_start=extra.get("kv_start"), sinks=extra.get("sinks"),
                                                key_offset=extra.get("key_offset"),
                                                prefix_keys=extra.get("prefix_keys"),
                                                prefix_values=extra.get("prefix_values"),
                                                recent_keys=extra.get("recent_keys"),
                                                recent_values=extra.get("recent_values"), recent_from=recent_from)
        kwargs = {**plan.constants, "BLOCK_N": plan.block_n, "num_stages": plan.num_stages}
        if mode == "decode":
            with captured_launches() as seen:
                kv = torch.randn(rows * 5, hk, d, dtype=torch.float16)
                store_kv(pool, layout, kv, kv, torch.arange(rows * 5), key_offset=extra.get("key_offset"))
        yield f"attention {mode} {tag} (BLOCK_M {kwargs['BLOCK_M']}, BLOCK_N {kwargs['BLOCK_N']})", \
            plan.kernel, args, kwargs
        if mode == "decode":
            yield f"store {tag}", real_store, *seen["store"]


class _CompileOnlyDriver:
    """The active Triton driver for CPU tensors: a CUDA target of `arch` on device 0, stream 0."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextmanager
def compile_only(arch: int = 90):
    """Within the block, a Triton launch on CPU tensors compiles for CUDA `arch` and runs nothing; launches plan
    with the H200's traits and take Triton's own path (the direct relaunch needs a driver's launcher)."""
    import triton
    import triton.runtime.jit as jit

    from tq_hf.kernels import fast_launch
    from tq_hf.kernels.device import H200, assumed_traits

    saved_run, saved_enabled = jit.JITFunction.run, fast_launch._ENABLED
    saved_driver = triton.runtime.driver._active  # (None without a GPU: reset_active would look for one)

    def compile_without_running(self, *args, grid, warmup, **kwargs):
        return saved_run(self, *args, grid=grid, warmup=True, **kwargs)

    triton.runtime.driver.set_active(_CompileOnlyDriver(arch))
    jit.JITFunction.run, fast_launch._ENABLED = compile_without_running, False
    try:
        with assumed_traits(torch.device("cpu"), H200):
            yield
    finally:
        jit.JITFunction.run, fast_launch._ENABLED = saved_run, saved_enabled
        triton.runtime.driver._active = saved_driver


def compile_error(exc: BaseException) -> str | None:
    """The compiler's complaint when `exc` (or its cause) is a failed compilation, else None."""
    from triton.compiler.errors import CompilationError

    while exc is not None:
        if isinstance(exc, CompilationError) or "PassManager::run failed" in str(exc) or "ptxas" in str(exc):
            return f"{type(exc).__name__}: {str(exc)[:300]}"
        exc = exc.__cause__ or exc.__context__
    return None


class _CompileReport:
    """pytest plugin: each test's compile failures (other failures are the numbers of launches that never ran)."""

    def __init__(self, arch: int):
        self.arch, self.failures, self.tests = arch, {}, 0

    def pytest_sessionstart(self, session):
        self._context = compile_only(self.arch)
        self._context.__enter__()

    def pytest_sessionfinish(self, session, exitstatus):
        self._context.__exit__(None, None, None)

    def pytest_runtest_makereport(self, item, call):
        if call.when == "call":
            self.tests += 1
            error = compile_error(call.excinfo.value) if call.excinfo is not None else None
            if error:
                self.failures[item.nodeid] = error


def check_tests(paths: list[str], arch: int) -> int:
    """Compile every launch of the tests at `paths`; print the failures; 1 if any."""
    import pytest

    report = _CompileReport(arch)
    pytest.main(["-q", "--tb=no", "-rN", "-p", "no:cacheprovider", "--no-header", "-o", "addopts=", *paths],
                plugins=[report])
    for nodeid, error in report.failures.items():
        print(f"FAILED TO COMPILE {nodeid}: {error}")
    print(f"{report.tests} tests run compile-only for sm_{arch}: "
          + (f"{len(report.failures)} with launches that do not compile" if report.failures else "every launch compiled"))
    return 1 if report.failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.compile_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="4bit,k8v4,k3v4,3bit")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--modes", default="decode,prefill", help="decode (attention + store) and/or prefill")
    ap.add_argument("--levers", default="off,on", help="off: the plain format; on: centering, rotation, prefix, ring, window...")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200, sm_90a)")
    ap.add_argument("--limit", type=int, default=H200_SHARED_LIMIT, help="shared memory per program, bytes")
    ap.add_argument("--tests", nargs="+", metavar="PATH", help="compile every launch these tests make instead")
    args = ap.parse_args(argv)
    if args.tests:
        os.environ["TRITON_INTERPRET"] = "0"  # (read when the kernels are defined: before tq_hf.kernels is imported)
        return check_tests(args.tests, args.arch)
    import triton

    print(f"Triton {triton.__version__}, sm_{args.arch}, limit {args.limit} B")
    failed = 0
    levers = tuple(x == "on" for x in args.levers.split(","))
    for tag, fn, fargs, fkwargs in variants(args.presets.split(","), [int(x) for x in args.head_dims.split(",")],
                                             tuple(args.modes.split(",")), levers):
        try:
            shared = compile_shared(fn, fargs, fkwargs, args.arch)
        except Exception as exc:  # report every variant, then fail
            failed += 1
            print(f"{tag}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        over = shared > args.limit and tag.startswith("store")  # the attention launcher steps down; the store cannot
        failed += over
        note = " (over the limit: the attention launcher steps down)" if shared > args.limit and not over else \
            " OVER THE LIMIT" if over else ""
        print(f"{tag}: shared {shared} B{note}", flush=True)
    print("all variants compiled" if not failed else f"{failed} variant(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
