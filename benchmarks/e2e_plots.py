"""Plots of the compile-and-run harness: a per-rank timeline of one step for each policy (each rank's
measured busy time, coloured by its replica's scheme, then the time it waits for the busiest rank), the
throughput of each policy, and the loss curve of each policy (the same batches and exact gradients: the
curves coincide). Needs matplotlib (the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot_all", "plot_timeline", "plot_throughput", "plot_loss"]

COLORS = {"tp1": "#4C72B0", "tp2": "#DD8452", "tp4": "#55A868", "tp8": "#C44E52"}


def _scheme_key(scheme: str) -> str:
    return scheme.strip("()").split(",")[0]


def plot_timeline(result: dict, path: Path) -> Path:
    """One panel per policy: the first measured step (the same batch for every policy)."""
    records = result["records"]
    fig, axes = plt.subplots(len(records), 1, figsize=(10, 1.2 + 1.3 * len(records)), squeeze=False)
    longest = max(max(rec["steps"][0]["busy_ms"]) for rec in records.values())
    for ax, (name, rec) in zip(axes[:, 0], records.items()):
        step = rec["steps"][0]
        busy = step["busy_ms"]
        top = max(busy)
        for replica in step["replicas"]:
            key = _scheme_key(replica["scheme"])
            mbs = replica["micro_batch_tokens"]
            for rank in replica["ranks"]:
                ax.barh(rank, busy[rank], color=COLORS.get(key, "#8172B3"), edgecolor="black", linewidth=0.5)
                ax.barh(rank, top - busy[rank], left=busy[rank], color="#DDDDDD", hatch="//", edgecolor="#999999",
                        linewidth=0.5)
                ax.text(busy[rank] * 0.02, rank, f"{key}: {sum(mbs)} tok, {len(mbs)} mb", va="center", fontsize=7,
                        color="white")
        ax.set_yticks(range(len(busy)))
        ax.set_yticklabels([f"rank {r}" for r in range(len(busy))], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, longest * 1.02)
        ax.set_title(f"{name}: step {step['step']}, {step['strategy']}, busiest rank {top:.0f} ms "
                     f"(grey: waiting)", fontsize=8)
    axes[-1, 0].set_xlabel("per-rank busy time (CPU ms with communication threads, one core per rank)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(summary: dict, path: Path) -> Path:
    """Tokens per second: wall clock on this machine, and with one core per rank."""
    pols = summary["policies"]
    names = list(pols)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, title in ((axes[0], "tokens_per_s", "tokens/s (wall clock, shared cores)"),
                           (axes[1], "tokens_per_s_one_core_per_rank", "tokens/s (one core per rank)")):
        values = [pols[n][key] for n in names]
        bars = ax.bar(names, values, color=["#55A868" if n == "hydraulis" else "#8C8C8C" for n in names])
        for bar, v in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    cfg = summary["config"]
    fig.suptitle(f"{cfg['model']}, {cfg['ranks']} ranks, {cfg['dataset']} (context {cfg['context']}), "
                 f"cap {cfg['tokens_per_rank']} tok/rank, {cfg['steps']} steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(result: dict, path: Path) -> Path:
    """Training loss per measured step, one line per policy (markers shrink so coinciding lines stay visible)."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    styles = ["-o", "--s", ":^", "-.v"]
    for k, (name, rec) in enumerate(result["records"].items()):
        steps = [s["step"] for s in rec["steps"]]
        ax.plot(steps, [s["loss"] for s in rec["steps"]], styles[k % len(styles)], label=name,
                markersize=7 - 2 * k, linewidth=1.2, alpha=0.85)
    cfg = result["config"]
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (mean over the global batch)")
    ax.set_title(f"{cfg['model']} on {cfg['dataset']}, {cfg['global_tokens']} tokens per step: the same batches "
                 f"for every policy", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(result: dict, summary: dict, out: Path) -> list[Path]:
    """Every plot under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    return [plot_timeline(result, out / "e2e_timeline.png"), plot_throughput(summary, out / "e2e_throughput.png"),
            plot_loss(result, out / "e2e_loss.png")]
