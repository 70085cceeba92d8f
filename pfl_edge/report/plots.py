"""The report's PNG plots, drawn from the summary (``summarise``) with matplotlib's Agg backend (no display)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["MAX_DEVICE_LINES", "write_plots"]

#: more devices than this: only the spread band and the mean are drawn, not a line per device
MAX_DEVICE_LINES = 100


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(text: str) -> str:
    """A name from the input as plain text: matplotlib would read ``$...$`` as math (and fail on a lone ``$``)."""
    return text.replace("$", r"\$")


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes, color="gray")


def _accuracy(s: Mapping[str, Any], ax: Any) -> None:
    rows = [r for r in s["rounds"] if r["reporting"]]
    if not rows:
        _empty(ax, "accuracy")
        return
    if len(s["devices"]) <= MAX_DEVICE_LINES:
        for d in s["devices"]:
            if d["accuracy"]:
                ax.plot([p[0] for p in d["accuracy"]], [p[1] for p in d["accuracy"]], lw=0.8, alpha=0.35)
    xs = [r["round"] for r in rows]
    acc = [r["accuracy"] for r in rows]
    ax.fill_between(xs, [a["min"] for a in acc], [a["max"] for a in acc], color="tab:blue", alpha=0.15,
                    linewidth=0, label="min to max")
    ax.plot(xs, [a["median"] for a in acc], color="tab:blue", ls="--", lw=1.2, label="median")
    ax.plot(xs, [a["mean"] for a in acc], color="black", lw=2, marker="o", ms=3, label="mean")
    ax.set_ylim(0, 1)
    ax.set_ylabel("device test accuracy")
    ax.legend(loc="lower right", fontsize=8)


def _bytes(s: Mapping[str, Any], ax: Any) -> None:
    rows = s["rounds"]
    if not any(r["bytes_up"] or r["bytes_down"] for r in rows):
        _empty(ax, "traffic")
        return
    xs = [r["round"] for r in rows]
    ax.bar([x - 0.2 for x in xs], [r["bytes_up"] / 1e6 for r in rows], width=0.4, label="up (devices to server)")
    ax.bar([x + 0.2 for x in xs], [r["bytes_down"] / 1e6 for r in rows], width=0.4, label="down")
    ax.set_ylabel("MB per round (all devices)")
    ax.legend(fontsize=8)


def _rounds(s: Mapping[str, Any], ax: Any) -> None:
    rows = s["rounds"]
    if not rows:
        _empty(ax, "round")
        return
    xs = [r["round"] for r in rows]
    colours = ["tab:red" if r["short_of_quorum"] else "tab:gray" for r in rows]
    ax.bar(xs, [r["wall_s"] or 0.0 for r in rows], color=colours, alpha=0.7)
    ax.set_ylabel("round wall time, s (red: short of quorum)")
    ax2 = ax.twinx()
    ms = 3 if len(rows) <= 50 else 0  # markers would merge into a bar of their own
    ax2.plot(xs, [r["updates"] for r in rows], "o-", color="tab:green", ms=ms, label="updates")
    ax2.plot(xs, [r["active"] for r in rows], "x:", color="tab:olive", ms=ms, label="devices given a task")
    ax2.set_ylabel("count")
    counts = [c for r in rows for c in (r["updates"], r["active"]) if c is not None]
    ax2.set_ylim(0, max(counts, default=1) * 1.35 or 1)  # headroom: the legend sits above the lines
    ax2.legend(loc="upper right", fontsize=8)


def _profiles(s: Mapping[str, Any], ax: Any) -> None:
    rows = [p for p in s["profiles"] if p["final_accuracy_mean"] is not None]
    if not rows:
        _empty(ax, "final accuracy")
        return
    names = [_label(f"{p['profile']} ({p['count']})") for p in rows]
    ax.barh(names, [p["final_accuracy_mean"] for p in rows], color="tab:purple", alpha=0.7)
    ax.set_xlim(0, 1)
    ax.set_xlabel("mean final device accuracy")
    ax.invert_yaxis()


_PLOTS = {"accuracy": (_accuracy, "accuracy per device over rounds"),
          "traffic": (_bytes, "bytes per round"),
          "rounds": (_rounds, "round wall time and updates"),
          "profiles": (_profiles, "final accuracy per device class")}


def write_plots(summary: Mapping[str, Any], out: Path) -> dict[str, Path]:
    """Every plot as ``out/<name>.png``; returns name -> path."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator
    paths = {}
    for name, (draw, title) in _PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        try:
            draw(summary, ax)
            ax.set_title(_label(f"{summary['name']}: {title}"), fontsize=9)
            if name != "profiles":
                ax.set_xlabel("round")
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            fig.tight_layout()
            paths[name] = out / f"{name}.png"
            fig.savefig(paths[name])
        finally:
            plt.close(fig)
    return paths
