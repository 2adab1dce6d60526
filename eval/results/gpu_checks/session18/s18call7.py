"""Session 18 call 7: the tile's value sums from zero (attention._rescaled_dot): accuracy and cost, against HEAD.

A. Accuracy against reference.paged_attention (fp32) on one pool per point: the unified and the one-warp kernels
   as now and as at HEAD f074835 (proto/attention_head.py, proto/dw_head.py), 32/8/128 4bit plain at B=16/4/1
   S=128k and B=16 S=32k, the 4bit preset with its levers (TurboQuantCache's defaults) and k8v4 at B=16 S=128k,
   a 64-query chunk (prefill tiles) at S=128k.
B. Time (CUDA-graph replays, L2 flushed, medians, two alternated rounds) of the same kernels, fp16 SDPA alongside.

    PYTHONPATH=. python eval/results/gpu_checks/session18/s18call7.py
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from eval.bench_kernels import _fill_pool, _flush_buffer, exact_buffers, make_config, time_ms
from tq_hf import reference
from tq_hf.kernels import attention, decode_warps, unified_attention
from tq_hf.layout import BlockLayout

HERE = Path(__file__).parent
KDIR = Path(decode_warps.__file__).parent
HQ, HK, D = 32, 8, 128


def load_heads():
    shutil.copy(HERE / "proto" / "dw_head.py", KDIR / "_s18_head.py")
    shutil.copy(HERE / "proto" / "attention_head.py", KDIR / "_s18_head_attn.py")
    return (importlib.import_module("tq_hf.kernels._s18_head")._warp_kernel,
            importlib.import_module("tq_hf.kernels._s18_head_attn")._attn_kernel)


class Case:
    """One pool and query; call(variant) runs a kernel variant into self.out."""

    def __init__(self, preset: str, b: int, s: int, lq: int = 1):
        self.cfg = make_config(preset)
        self.layout = BlockLayout(self.cfg, HK, D)
        self.b, self.s = b, s
        self.mu = torch.randn(HK, D, device="cuda") if self.cfg.key_centering else None
        self.pool, self.table = _fill_pool(self.layout, b, s, key_offset=self.mu)
        self.seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
        self.q = torch.randn(b, HQ, lq, D, device="cuda", dtype=torch.float16)
        self.extra = exact_buffers(self.layout, b, self.cfg.exact_prefix_tokens, self.cfg.recent_window)
        self.out = torch.full_like(self.q, float("nan"))
        self.scale = 1 / math.sqrt(D)

    def reference(self) -> torch.Tensor:
        ex = self.extra
        rows = []
        for i in range(self.b):
            sl = slice(i, i + 1)
            kw = {k: (v[sl] if isinstance(v, torch.Tensor) else v) for k, v in ex.items()}
            rows.append(reference.paged_attention(self.q[sl].float(), self.pool, self.layout, self.table[sl],
                                                  self.seq[sl], self.scale, key_offset=self.mu, **kw).float())
        return torch.cat(rows)

    def runner(self, tuning):
        def call():
            return unified_attention(self.q, self.pool, self.layout, self.table, self.seq, self.scale,
                                     max_seq_len=self.s, out=self.out, key_offset=self.mu, tuning=tuning, **self.extra)
        return call


def variants(case: Case, heads, one_warp: bool) -> dict:
    """name -> call; the HEAD variants run HEAD's kernels through plans of their own (a probe key, unused)."""
    warp_head, attn_head = heads
    out = {}
    for name, tuning, kernel in (("unified", {"warp_split": False}, None),
                                 ("unified HEAD", {"warp_split": False, "probe": "HEAD"}, attn_head),
                                 ("one-warp", {"warp_split": True}, None),
                                 ("one-warp HEAD", {"warp_split": True, "probe": "HEAD"}, warp_head)):
        if name.startswith("one-warp") and not one_warp:
            continue
        call = case.runner(tuning)
        if kernel is not None:
            call()
            plan = next(p for p in reversed(list(attention._PLANS.values()))
                        if p.kernel in (attention._attn_kernel, decode_warps._warp_kernel, None) and p.layout is case.layout)
            plan.kernel, plan.attention = kernel, None
            if kernel is warp_head:
                plan.constants = {k: v for k, v in plan.constants.items() if k != "HADAMARD"}
        out[name] = call
    return out


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/s18c7"))
    out_dir.mkdir(parents=True, exist_ok=True)
    heads = load_heads()
    flush = _flush_buffer()
    acc_rows, time_rows = [], []
    for preset, b, s, lq in (("4bit", 16, 131072, 1), ("4bit", 4, 131072, 1), ("4bit", 1, 131072, 1),
                             ("4bit", 16, 32768, 1), ("4bit+defaults", 16, 131072, 1), ("k8v4", 16, 131072, 1),
                             ("4bit", 1, 131072, 64)):
        torch.manual_seed(b + s + lq)
        case = Case(preset, b, s, lq)
        want = case.reference()
        tol = 1e-3 + float((want.half().float() - want).norm() / want.norm())
        plain4 = preset == "4bit" and lq == 1
        for name, call in variants(case, heads, plain4).items():
            case.out.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            got = case.out.float()
            err = float((got - want).norm() / want.norm())
            acc_rows.append(dict(preset=preset, B=b, S=s, Lq=lq, variant=name, rel_error=err, tol=tol,
                                 finite=bool(got.isfinite().all())))
            print(f"ACC {preset} B={b} S={s} Lq={lq} {name:14s} rel err {err:.2e} (tol {tol:.2e})", flush=True)
        del case, want
        torch.cuda.empty_cache()
    for preset, b, s in (("4bit", 1, 4096), ("4bit", 1, 32768), ("4bit", 2, 32768), ("4bit", 4, 32768),
                         ("4bit", 16, 32768), ("4bit", 1, 131072), ("4bit+defaults", 16, 32768),
                         ("4bit+defaults", 1, 32768), ("k8v4", 16, 32768)):
        case = Case(preset, b, s)
        k = torch.randn(b, HK, s, D, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        sdpa = time_ms(lambda: F.scaled_dot_product_attention(case.q, k, v, enable_gqa=True), 300, True, flush)
        del k, v
        calls = variants(case, heads, preset == "4bit")
        for rnd in range(2):
            for name, call in calls.items():
                ms = time_ms(call, 300, True, flush)
                time_rows.append(dict(preset=preset, B=b, S=s, variant=name, round=rnd, ms=ms, sdpa=sdpa,
                                      ratio=ms / sdpa))
                print(f"TIME {preset} B={b} S={s} r{rnd} {name:14s} {ms:.4f} ms x{ms / sdpa:.3f} fp16 ({sdpa:.4f})",
                      flush=True)
        del case
        torch.cuda.empty_cache()
    (out_dir / "s18call7.json").write_text(json.dumps({"accuracy": acc_rows, "time": time_rows}, indent=1))
    print("\n| preset | B | S | Lq | variant | rel error vs fp32 reference | tolerance |\n|---|---|---|---|---|---|---|")
    for r in acc_rows:
        print(f"| {r['preset']} | {r['B']} | {r['S']} | {r['Lq']} | {r['variant']} | {r['rel_error']:.2e} | {r['tol']:.2e} |")
    print("\n| preset | B | S | fp16 SDPA ms | variant | ms r0 | ms r1 | x fp16 |\n|---|---|---|---|---|---|---|---|")
    for key in dict.fromkeys((r["preset"], r["B"], r["S"], r["variant"]) for r in time_rows):
        rr = [r for r in time_rows if (r["preset"], r["B"], r["S"], r["variant"]) == key]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {rr[0]['sdpa']:.4f} | {key[3]} | "
              + " | ".join(f"{r['ms']:.4f}" for r in rr) + f" | {statistics.mean(r['ratio'] for r in rr):.3f} |")


if __name__ == "__main__":
    sys.exit(main())
