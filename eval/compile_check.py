"""Compile the Triton kernels for a GPU that is not here (default sm_90a, the H200) and report the
shared memory each launch variant needs: what the interpreter cannot tell.

The attention launch is planned on CPU tensors with the H200's DeviceTraits (plan_attention) and the
store's launch captured; each variant is compiled by the installed Triton (its bundled ptxas) with the
specialisations a real launch gets (16-byte divisibility of pointers and of ints that are
multiples of 16). Against the GPU's own compiler version (`pip install --target DIR triton==3.6.0`,
then `PYTHONPATH=DIR`), the figures matched Nsight Compute on the H200 (102,400 B for 4bit decode at
head_dim 128), and they found 3-bit keys at head_dim 256 needing 262,144 B (fixed).

    python -m eval.compile_check [--presets 4bit,k3v4] [--head-dims 128,256] [--modes decode] [--levers on]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from contextlib import contextmanager

import torch

H200_SHARED_LIMIT = 232448  # bytes of shared memory one program may use on an H200 (sm_90a)
NO_SPECIALIZE = ("recent_from", "Lq", "num_splits", "prefix_len")  # the attention kernel's do_not_specialize
TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64",
         torch.float32: "fp32"}


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
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {"num_warps": kwargs.pop("num_warps", 4)}
    if kwargs.get("maxnreg"):
        options["maxnreg"] = kwargs.pop("maxnreg")
    if "num_stages" in kwargs:
        options["num_stages"] = kwargs.pop("num_stages")
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
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options=options)
    return kernel.metadata.shared


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.compile_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="4bit,k8v4,k3v4,3bit")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--modes", default="decode,prefill", help="decode (attention + store) and/or prefill")
    ap.add_argument("--levers", default="off,on", help="off: the plain format; on: centering, rotation, prefix, ring, window...")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200, sm_90a)")
    ap.add_argument("--limit", type=int, default=H200_SHARED_LIMIT, help="shared memory per program, bytes")
    args = ap.parse_args(argv)
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
