"""Pieces of unified_attention's host cost on the GPU host (B=1, S=32k, 4bit plain): our glue (launches stubbed),
Triton's JIT run of the captured launch, its binder + cache key, the cached CompiledKernel's run called directly,
the split reduction's launch, empty_like; plus GPU time (CUDA graph) of the attention kernel with/without reduction."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch, triton
from triton.runtime.jit import compute_cache_key
from triton import knobs
from eval.bench_decode_variants import _lever_call, LEVERS
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout
from tq_hf.kernels import attention as A

def host(fn, n=300):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6

q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
overrides, prefix, ring = LEVERS["plain (no levers)"]
cfg = TurboQuantConfig.from_preset("4bit", block_size=16, exact_prefix_tokens=prefix, recent_window=ring,
                                   **{"key_centering": False, "value_rotation": False, **overrides})
layout = BlockLayout(cfg, 8, 128)
call, out = _lever_call(q, layout, 1, 32768, prefix, ring)
rows = []
rows.append(("unified_attention (full)", *host(call)))
seen = {}
real_launch, real_reduce = A._launch, A.reduce_splits
def spy(grid, args, constants, bn, stages):
    seen.update(grid=grid, args=args, constants=constants, bn=bn, stages=stages); real_launch(grid, args, constants, bn, stages)
def spy_r(*a):
    seen["red"] = a; real_reduce(*a)
A._launch, A.reduce_splits = spy, spy_r
call()
A._launch = lambda *a: None; A.reduce_splits = lambda *a: None
rows.append(("glue only (both launches stubbed)", *host(call)))
A._launch, A.reduce_splits = real_launch, real_reduce
fn = A._attn_kernel
grid, args = seen["grid"], seen["args"]
bn, stages, rn = A._FITTED[(tuple(seen["constants"].items()), seen["bn"], seen["stages"])]
kw = dict(seen["constants"], BLOCK_N=bn, num_stages=stages)
rows.append(("_attn_kernel[grid](...) JIT run", *host(lambda: fn[grid](*args, **kw))))
device = torch.cuda.current_device()
kernel_cache, key_cache, target, backend, binder = fn.device_caches[device]
def bind():
    bound, spec, opts = binder(*args, **kw); compute_cache_key(key_cache, spec, opts)
rows.append(("binder + cache key only", *host(bind)))
bound, spec, opts = binder(*args, **kw)
kernel = fn[grid](*args, **kw)
vals = tuple(bound.values())
stream = torch.cuda.current_stream().cuda_stream
def direct():
    kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None,
               knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *vals)
rows.append(("CompiledKernel.run direct", *host(direct)))
def direct_cur():
    kernel.run(grid[0], grid[1], grid[2], torch.cuda.current_stream().cuda_stream, kernel.function, kernel.packed_metadata, None,
               knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *vals)
rows.append(("CompiledKernel.run + torch current_stream", *host(direct_cur)))
rows.append(("get_current_device+stream", *host(lambda: triton.runtime.driver.active.get_current_stream(triton.runtime.driver.active.get_current_device()))))
red = seen["red"]
rows.append(("reduce_splits launch", *host(lambda: A.reduce_splits(*red))))
rows.append(("torch.empty_like(q)", *host(lambda: torch.empty_like(q))))
rows.append(("seq_lens.fill_(n)", *host(lambda: out.new_zeros(1).fill_(3))))
print(f"{'piece':42s} {'host us':>8s} {'wall us':>8s}")
for name, h, w in rows:
    print(f"{name:42s} {h:8.1f} {w:8.1f}")
# GPU time: graph of attention + reduce vs attention alone
from eval.bench_kernels import time_ms, _flush_buffer
flush = _flush_buffer()
t_all = time_ms(call, 50, True, flush)
t_attn = time_ms(direct_cur, 50, True, flush)
t_red = time_ms(lambda: A.reduce_splits(*red), 50, True, flush)
print(f"GPU (graph, L2 flushed): attention+reduce {t_all*1e3:.1f} us, attention kernel alone {t_attn*1e3:.1f} us, reduce alone {t_red*1e3:.1f} us")
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cpu", os.cpu_count())
