"""Mutation for session 18 call 8: put the value sums back on the MMA's accumulator chain (HEAD's arithmetic) in
this tree's kernels, so test_long_walk_accuracy_gpu can be seen to fail without attention._rescaled_dot.

    python eval/results/gpu_checks/session18/chained_sums.py   # rewrites tq_hf/kernels in place (device copy)
"""
from pathlib import Path

K = Path(__file__).resolve().parents[4] / "tq_hf" / "kernels"


def rewrite(path: Path, pairs) -> None:
    s = path.read_text()
    for old, new in pairs:
        assert old in s, old
        s = s.replace(old, new)
    path.write_text(s)


rewrite(K / "attention.py", [("    return tl.fma(acc, alpha, tl.dot(a, b))", "    return tl.dot(a, b, acc * alpha)")]
        + [(f"        t{i} = tl.zeros(acc{i}.shape, tl.float32)", f"        t{i} = acc{i} * alpha[:, None]") for i in range(4)]
        + [(f"        acc{i} = tl.fma(acc{i}, alpha[:, None], t{i})", f"        acc{i} = t{i}") for i in range(4)])
rewrite(K / "decode_warps.py", [(f"    t{i} = tl.zeros(a{i}.shape, tl.float32)", f"    t{i} = a{i} * alpha[None, :]") for i in range(4)]
        + [(f"    a{i} = tl.fma(a{i}, alpha[None, :], t{i})", f"    a{i} = t{i}") for i in range(4)])
print("value sums chained through the MMA accumulator again")
