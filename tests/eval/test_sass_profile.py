"""The SASS profile's parsing: which loop is the tile walk, and how its instructions are counted (CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.sass_profile import _tool, classify, decode_launch, main, markdown, outside_loops, parse_sass, programs_per_sm, tile_loop

ROOT = Path(__file__).resolve().parents[2]
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.U8 R2, desc[UR4][R4.64] ;
        /*0020*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0040*/                   LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0050*/                   PRMT R9, R8, 0x7610, R9 ;
        /*0060*/                   HMMA.16816.F32 R12, R8, R10, R12 ;
        /*0070*/              @!P1 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
"""


def test_the_tile_loop_is_the_backward_branch_with_tensor_core_work():
    instructions, labels = parse_sass(LISTING)
    assert labels == {".L_x_0": 0x10, ".L_x_1": 0x40} and len(instructions) == 9
    body = tile_loop(instructions, labels)
    assert [i.address for i in body] == [0x40, 0x50, 0x60, 0x70]  # not the longer-lived scalar loop at 0x10
    counts = classify(body)
    assert counts == {"LDG": 1, "PRMT": 1, "HMMA": 1, "other": 1}  # BRA falls in "other"


def test_the_fixed_cost_is_what_lies_outside_every_loop():
    """Before the first loop's start (the MOV) and after the last loop's branch (the EXIT); a forward branch is no
    loop."""
    instructions, labels = parse_sass(LISTING)
    assert outside_loops(instructions, labels) == (1, 1)
    forward = LISTING.replace("@P0 BRA `(.L_x_0)", "@P0 BRA `(.L_x_1)")
    assert outside_loops(*parse_sass(forward)) == (4, 1)  # only the loop at 0x40 is left


@pytest.mark.parametrize("registers,warps,shared,resident", [
    (128, 4, 14336, 4),   # registers: 4 x 16K of the 64K
    (156, 4, 22528, 3),   # 156 -> 160 per thread (256 per warp): 20,480 per program
    (168, 4, 26624, 3),
    (255, 4, 61440, 2),   # 256 per thread: 32K per program
    (255, 4, 114688, 2),  # shared: 2 x (112 KB + 1 KB) fit in 228 KB
    (64, 4, 120000, 1),   # shared: one program of 118 KB
    (32, 8, 0, 8),        # warps: 64 per SM
    (16, 1, 0, 32),       # blocks: 32 per SM
])
def test_programs_per_sm_follow_the_tightest_resource(registers, warps, shared, resident):
    """sm_90's limits as CUDA's occupancy calculator applies them."""
    assert programs_per_sm(registers, warps, shared) == resident


def test_table_has_a_row_per_shape_and_preset():
    row = {"preset": "4bit", "shape": "32/8/128", "kernel": "_attn_kernel", "block_n": 128, "heads_per_program": 2,
           "warps": 4, "registers": 239, "shared_bytes": 75776, "programs": 512, "programs_per_sm": 3,
           "waves": 512 / 396, "loop_instructions": 1404, "before_loops": 1466, "after_loops": 671, "tile_bytes": 34304,
           "thread_instructions_per_byte": 5.24, "classes": {"HMMA": 128, "PRMT": 224}}
    md = markdown({"command": "python -m eval.sass_profile", "triton": "3.6.0", "arch": 90, "batch": 16,
                   "length": 32768, "rows": [row]})
    assert "| 32/8/128 | 4bit | default | _attn_kernel | 128 x 2 | 4 | 239 | 75776 | 512 (3, 1.29) | 1404 | 1466 / 671 | 34304 | 5.2 |" in md
    assert "| 128 | 224 |" in md.replace(" 0 |", "")


def test_named_launch_overrides_plan_the_profiled_launch():
    """A --launch variant's LaunchConfig fields and split count reach the plan (planned on CPU tensors as on an
    H200: 8 KV heads x (48 splits + the exact program)); a malformed one is refused by name."""
    _, _, kwargs, _, plan = decode_launch("3bit+defaults", 1, 32768, (32, 8, 128),
                                          {"maxnreg": 168, "num_splits": 48, "value_boundary": False})
    assert plan.grid == (49, 8, 1) and kwargs["maxnreg"] == 168 and not kwargs["VALUE_BOUNDARY"]
    _, _, kwargs, _, default = decode_launch("3bit+defaults", 1, 32768, (32, 8, 128))
    assert default.grid != plan.grid and kwargs["VALUE_BOUNDARY"] and "maxnreg" not in kwargs
    with pytest.raises(SystemExit):
        main(["--launch", "{'vb': True}"])


@pytest.mark.slow
def test_a_real_decode_launch_profiles(tmp_path):
    """The command on one launch, outside the interpreter (a subprocess, as tests/test_compile_check.py runs)."""
    if not os.path.exists(_tool("nvdisasm")):
        pytest.skip("no nvdisasm in this Triton wheel")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "eval.sass_profile", "--presets", "k8v4", "4bit+defaults", "--shapes",
                          "32/8/128", "--store", "--launch", "{'two splits': {'num_splits': 2}}",
                          "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "results.json").read_text())
    # the decode store: the codebook keys' rotation and quantization take more than FP8 keys' scaling
    store = {(r["preset"], r["variant"]): r for r in report["store"]}
    assert store["4bit+defaults", "default"]["instructions"] > store["k8v4", "default"]["instructions"] > 0
    assert store["4bit+defaults", "default"]["hmma"] > 0 and store["k8v4", "default"]["barriers"] > 0
    # the rotations' entries read (the default) instead of built: fewer instructions for the codebook keys' store
    assert store["4bit+defaults", "default"]["instructions"] < store["4bit+defaults", "built_rotations"]["instructions"]
    assert ("| 32/8/128 | 4bit+defaults | default | " + str(store["4bit+defaults", "default"]["instructions"])
            in (tmp_path / "table.md").read_text())
    rows = [r for r in report["rows"] if r["variant"] == "default"]
    assert [(r["preset"], r["ring"]) for r in rows] == [("k8v4", None), ("4bit+defaults", "int8 records")]
    # the named variant: 16 rows x 8 KV heads x 2 splits (FP8 keys, one head per program), the same loop
    two = next(r for r in report["rows"] if r["variant"] == "two splits" and r["preset"] == "k8v4")
    assert two["programs"] == 16 * 8 * 2 and two["loop_instructions"] == rows[0]["loop_instructions"]
    for row in report["rows"]:
        assert sum(row["opcodes"].values()) == row["loop_instructions"] == sum(row["classes"].values())
    for row in rows:
        assert row["classes"]["HMMA"] > 0 and row["tile_bytes"] > 0
        assert 0 < row["thread_instructions_per_byte"] < 100
        # 16 x 8 (or 4 pairs of) KV heads x the splits; the registers and shared memory of the compiled kernel
        assert row["programs"] % 64 == 0 and 1 <= row["programs_per_sm"] <= 4
        assert row["waves"] == row["programs"] / (row["programs_per_sm"] * 132)
