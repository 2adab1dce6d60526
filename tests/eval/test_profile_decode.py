"""eval.profile_decode --stalls: the summary of an Nsight Compute source-page export (no GPU needed)."""

import csv

from eval.profile_decode import stall_summary

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]


def test_stall_summary_shares(tmp_path, capsys):
    path = tmp_path / "r.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "_attn_kernel"])
        w.writerow(HEADER)
        w.writerow(["0x10", "      BAR.SYNC.DEFER_BLOCKING 0x0", "30", "10", "27", "3", "27"])
        w.writerow(["0x20", "      @!P0  LDS R1, [R2]", "10", "30", "0", "10", "0"])
        w.writerow(["0x30", "      LOP3.LUT R1, R2, 0xf, RZ, 0xc0, !PT", "0", "60", "0", "0", "0"])
    stall_summary(str(path))
    out = capsys.readouterr().out
    assert "40 stall samples" in out
    assert "stall_long_sb             67.5%" in out and "stall_wait                32.5%" in out
    assert "BAR       75.0% /  10.0%" in out  # predicated LDS counted as LDS
    assert "LDS       25.0% /  30.0%" in out and "LOP3       0.0% /  60.0%" in out
    assert "(27, 'long_sb')" in out


def test_kernel_times_per_call():
    """kernel_times: eval.decode_loop.kernel_profile per profiled call, after the warm-up (on the host's ops without
    a GPU): a call of two matmuls and one add counts two aten::mm and one aten::add per call."""
    import torch

    from eval.profile_decode import kernel_times

    a = torch.randn(64, 64)
    calls = []

    def call():
        calls.append(1)
        torch.add(torch.mm(a, a), torch.mm(a, a))

    report = kernel_times(call, 5)
    assert len(calls) == 3 + 5  # the warm-up and the profiled calls
    ops = {row["op"]: row for row in report["host_top"]}
    assert ops["aten::mm"]["per_step"] == 2 and ops["aten::add"]["per_step"] == 1
    assert ops["aten::mm"]["us_per_step"] > 0
