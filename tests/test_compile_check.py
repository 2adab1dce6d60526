"""The kernels compile for the H200 (sm_90a) and fit its shared memory, checked on CPU with the
installed Triton's ptxas (the interpreter runs no compiler): eval.compile_check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ptxas_available() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def _compile_check(*args: str) -> tuple[str, str]:
    """Run eval.compile_check (outside the interpreter); (stdout, stdout + stderr tail), asserting success."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "eval.compile_check", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    out = run.stdout + run.stderr[-2000:]
    assert run.returncode == 0, out
    return run.stdout, out


@pytest.mark.skipif(not _ptxas_available(), reason="this Triton has no bundled ptxas")
@pytest.mark.slow
def test_three_bit_keys_at_head_dim_256_fit_an_h200():
    """3-bit keys at Gemma's head_dim 256 with every lever: the store (which cannot step down) and
    the decode attention. Before the rotations were split into column halves the store needed
    262,144 B of the 232,448 an H200 program may use."""
    stdout, out = _compile_check("--presets", "3bit", "--head-dims", "256", "--modes", "decode", "--levers", "on")
    lines = [line for line in stdout.splitlines() if "shared" in line and "head_dim 256" in line]
    assert len(lines) == 2 and all(int(line.split("shared ")[1].split(" B")[0]) <= 232448 for line in lines), out


@pytest.mark.skipif(not _ptxas_available(), reason="this Triton has no bundled ptxas")
@pytest.mark.slow
def test_four_bit_key_lookup_decodes_in_the_mma_operand_layout():
    """4-bit decode with the prmt lookup compiles for sm_90a, and its shared memory shows that the
    key tiles are decoded in registers: the plain format's two KV heads per program take 83,968 B
    (Triton 3.6), at most the codes and values of two heads in 3 stages (3 x 2 x 128 tokens x 128 B),
    where a staged fp16 key tile adds 32,768 B per head and stage (the gather's took 102,400 B for one
    head, H200). Fails if the compiler stops moving the asm into the MMA's operand layout."""
    stdout, out = _compile_check("--presets", "4bit", "--head-dims", "128", "--modes", "decode", "--levers", "off")
    line = next(line for line in stdout.splitlines() if line.startswith("attention decode 4bit"))
    assert int(line.split("shared ")[1].split(" B")[0]) <= 3 * 2 * 128 * 128, out


@pytest.mark.skipif(not _ptxas_available(), reason="this Triton has no bundled ptxas")
@pytest.mark.slow
def test_three_bit_key_lookups_compile():
    """3-bit decode with its byte-permute asm compiles for sm_90a (ptxas reads the asm text the interpreter never
    runs): the bit stream's 4-codes-per-selector lookup at head_dim 64, the planes' spare-code asm at 128."""
    stdout, out = _compile_check("--presets", "k3v4,3bit", "--head-dims", "64,128", "--modes", "decode", "--levers",
                                 "on")
    for preset in ("k3v4", "3bit"):
        for head_dim in (64, 128):
            assert f"attention decode {preset} head_dim {head_dim} levers" in stdout, out


BROKEN_KERNEL_TEST = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _kernel(x_ptr, n):
    i = tl.arange(0, 3)  # not a power of two: the compiler refuses it
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


def test_launches_a_kernel_that_does_not_compile():
    x = torch.zeros(4)
    _kernel[(1,)](x, 4)
    assert x.sum() == 1  # a numeric check: fails as nothing ran, and is not what the report counts


def test_numbers_only():
    assert False
'''


@pytest.mark.skipif(not _ptxas_available(), reason="this Triton has no bundled ptxas")
@pytest.mark.slow
def test_compile_only_pass_over_tests(tmp_path):
    """--tests compiles every launch the store and held-launch tests make for sm_90a (numeric failures of
    launches that never ran are not reported), and reports a test whose launch does not compile."""
    stdout, out = _compile_check("--tests", "tests/kernels/test_kernel_store.py", "tests/kernels/test_held_launch.py")
    assert "every launch compiled" in stdout, out
    broken = tmp_path / "test_broken_kernel.py"
    broken.write_text(BROKEN_KERNEL_TEST)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "eval.compile_check", "--tests", str(broken)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr[-2000:]
    assert "FAILED TO COMPILE" in run.stdout and "test_launches_a_kernel_that_does_not_compile" in run.stdout
    assert not [line for line in run.stdout.splitlines() if "FAILED TO COMPILE" in line and "test_numbers_only" in line]
    assert "2 tests run compile-only for sm_90: 1 with launches that do not compile" in run.stdout


FUSION_PROBE = '''
import sys, warnings
import torch
sys.path[:0] = ["tests", "tests/kernels"]
from eval.compile_check import compile_only
from kernel_helpers import fill_cache, make_layout
from tq_hf.kernels import unified_attention

warnings.simplefilter("error", UserWarning)  # Triton 3.9 warns where a launch leaves FMA contraction to its default
layout = make_layout("4bit", 4, 128, key_centering=True, value_rotation=True)
pool, table = fill_cache(layout, [300, 263], "cpu")
with compile_only(90):
    unified_attention(torch.randn(2, 16, 1, 128, dtype=torch.float16), pool, layout, table,
                      torch.tensor([300, 263]), 128 ** -0.5, key_offset=torch.randn(4, 128))
print("compiled")
'''


@pytest.mark.skipif(not _ptxas_available(), reason="this Triton has no bundled ptxas")
@pytest.mark.slow
def test_launches_ask_for_fma_contraction():
    """Every launch passes enable_fp_fusion=True (fast_launch.LAUNCH_OPTIONS): the code the kernels were tuned and
    checked with, where Triton 3.10 turns contraction off by default (3.9 warns of it, an error here; a fresh
    process, as Triton warns once per process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    run = subprocess.run([sys.executable, "-c", FUSION_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stdout + run.stderr[-2000:]
