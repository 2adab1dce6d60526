"""Triton 3.6's launch-path Python (binder + cache key) for the captured decode launch, on CPU tensors."""
import os, sys, time, math
sys.path.insert(0, os.getcwd())
import torch, triton
from triton.runtime.jit import create_function_from_signature, compute_cache_key
from triton.backends.nvidia.compiler import CUDABackend
from triton.backends.compiler import GPUTarget
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout
from tq_hf.kernels import attention as A
seen = {}
A._tuned_for_gpu = lambda d: True; A._runs_ptx = lambda d: True; A._num_sms = lambda d: 132
A.reduce_splits = lambda *a, **k: None
A._launch = lambda grid, args, constants, bn, stages: seen.update(args=args, constants=constants, bn=bn, stages=stages)
cfg = TurboQuantConfig.from_preset("4bit", block_size=16, key_centering=False, value_rotation=False, exact_prefix_tokens=0, recent_window=0)
layout = BlockLayout(cfg, 8, 128)
b = 1; nblk = 32768 // 16
table = torch.arange(b * nblk, dtype=torch.int32).reshape(b, nblk)
pool = torch.zeros(b * nblk, 8, layout.plane_bytes, dtype=torch.uint8)
q = torch.randn(b, 32, 1, 128, dtype=torch.float16)
seq = torch.full((b,), 32768)
call = lambda: A.unified_attention(q, pool, layout, table, seq, 0.088, max_seq_len=32768)
for _ in range(20): call()
n = 2000
t0 = time.perf_counter()
for _ in range(n): call()
print(f"unified_attention glue (launch stubbed, CPU tensors): {(time.perf_counter() - t0) / n * 1e6:.1f} us/call")
fn = A._attn_kernel
backend = CUDABackend(GPUTarget("cuda", 90, 32))
binder = create_function_from_signature(fn.signature, fn.params, backend)
kw = dict(seen["constants"], BLOCK_N=seen["bn"], num_stages=seen["stages"])
args = seen["args"]
cache = {}
for _ in range(20):
    bound, spec, opts = binder(*args, **kw); compute_cache_key(cache, spec, opts)
t0 = time.perf_counter()
for _ in range(n):
    bound, spec, opts = binder(*args, **kw)
    key = compute_cache_key(cache, spec, opts)
print(f"triton 3.6 binder + cache key: {(time.perf_counter() - t0) / n * 1e6:.1f} us/launch ({len(args)} args, {len(kw)} keywords)")
