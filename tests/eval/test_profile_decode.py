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
    """kernel_times: each op's time and launches divided by the profiled calls, the longest first (on the host's ops:
    no GPU needed): a call of two matmuls and one add counts two aten::mm and one aten::add per call."""
    import torch

    from eval.profile_decode import kernel_times

    a = torch.randn(64, 64)
    calls = []

    def call():
        calls.append(1)
        torch.add(torch.mm(a, a), torch.mm(a, a))

    times = kernel_times(call, 5, device_kind="CPU")
    assert len(calls) == 3 + 5  # the warm-up and the profiled calls
    assert times["aten::mm"][1] == 2 and times["aten::add"][1] == 1  # launches per call
    assert times["aten::mm"][0] > 0 and times["aten::add"][0] > 0
    us = [t for t, _ in times.values()]
    assert us == sorted(us, reverse=True)
