"""The plots of the eval commands (matplotlib, Agg backend: files only, no display)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def quality_bars(path: Path, names: list[str], delta_pct: list[float], kl: list[float], title: str) -> None:
    """Two panels: perplexity change vs the reference (%) and mean KL divergence, one bar per cache."""
    # (constrained layout, and axis labels on two lines, keep the title clear of the panels' labels)
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(names) + 4), 4), layout="constrained")
    colors = ["#888888" if d == 0 else "#1f77b4" for d in delta_pct]
    a.bar(names, delta_pct, color=colors)
    a.set_ylabel("perplexity change\nvs fp16 (%)")
    a.axhline(0, color="black", linewidth=0.8)
    b.bar(names, kl, color=colors)
    b.set_ylabel("mean KL(fp16 || cache)\n(nats/token)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(_wrap(title), fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def accuracy_heatmap(path: Path, grid: list[list[float]], lengths: list[int], depths: list[float], title: str) -> None:
    """Needle accuracy per (depth row, context-length column), 0..1, with the values written in."""
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.55 * len(depths) + 2))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy")
    ax.set_title(_wrap(title), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def lines_vs_context(path: Path, series: dict[str, list[tuple[int, float]]], ylabel: str, title: str,
                     xlabel: str = "context length (tokens)") -> None:
    """One line per series over context length, or another size such as the batch (log2 x axis); points are (x, y)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if len(series) > 10:  # past the default cycle's 10 colors, lines would share one
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for label, points in series.items():
        points = sorted(p for p in points if p[1] is not None)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(_wrap(title), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _wrap(title: str, width: int = 90) -> str:
    return "\n".join(textwrap.fill(line, width) for line in title.splitlines())
