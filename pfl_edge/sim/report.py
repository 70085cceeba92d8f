"""Results: the JSON file, a PNG of accuracy over rounds, and a per-client table for the terminal."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..table import format_table

__all__ = ["client_table", "format_table", "plot_masks", "plot_rounds", "write_result"]



def write_result(result: Mapping[str, Any], out: str | Path, *, plot: bool = True) -> Path:
    """Write the JSON (atomically) and, with ``plot``, ``<out>.png`` beside it."""
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(p)
    if plot:
        plot_rounds({result["config"]["algorithm"]: result}, p.with_suffix(".png"))
        if "mask_analysis" in result:
            plot_masks(result, p.with_name(p.stem + "-masks.png"))
    return p


def plot_masks(result: Mapping[str, Any], out: str | Path) -> Path:
    """DisPFL's mask study: pairwise mask Hamming distance against label-distribution cosine similarity
    (scatter), and both matrices side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ham = np.asarray(result["mask_analysis"]["hamming"])
    cos = np.asarray(result["mask_analysis"]["label_cosine"])
    iu = np.triu_indices(len(ham), k=1)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=100)
    axes[0].scatter(cos[iu], ham[iu], s=8, alpha=0.6)
    axes[0].set_xlabel("cosine similarity of label distributions")
    axes[0].set_ylabel("mask Hamming distance (fraction)")
    axes[0].grid(alpha=0.3)
    for ax, mat, title in ((axes[1], ham, "mask Hamming distance"), (axes[2], cos, "label cosine similarity")):
        im = ax.imshow(mat, cmap="viridis")
        ax.set_title(title)
        ax.set_xlabel("client")
        ax.set_ylabel("client")
        fig.colorbar(im, ax=ax, fraction=0.046)
    cfg = result["config"]
    fig.suptitle(f"DisPFL masks after {cfg['rounds']} rounds: {cfg['partition']}, {cfg['clients']} clients")
    fig.tight_layout()
    p = Path(out)
    fig.savefig(p)
    plt.close(fig)
    return p


def plot_rounds(results: Mapping[str, Mapping[str, Any]], out: str | Path, *, title: str | None = None) -> Path:
    """Mean accuracy over rounds (band: +-1 std across clients), one line per labelled result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for label, res in results.items():
        r = [x["round"] for x in res["rounds"]]
        m = [x["mean_acc"] for x in res["rounds"]]
        s = [x["std_acc"] for x in res["rounds"]]
        (line,) = ax.plot(r, m, label=f"{label} ({m[-1]:.3f})")
        ax.fill_between(r, [a - b for a, b in zip(m, s, strict=True)], [a + b for a, b in zip(m, s, strict=True)],
                        color=line.get_color(), alpha=0.15, linewidth=0)
    cfg = next(iter(results.values()))["config"]
    ax.set_title(title or f"{cfg['dataset']} {cfg['partition']}, {cfg['clients']} clients, {cfg['model']}")
    ax.set_xlabel("round")
    ax.set_ylabel("mean client test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    p = Path(out)
    fig.savefig(p)
    plt.close(fig)
    return p


def client_table(result: Mapping[str, Any]) -> str:
    """A per-client table of the final round: samples, accuracy, loss, bytes."""
    last = result["rounds"][-1]
    meta = result["meta"]
    rows: list[Sequence[str]] = [("client", "train n", "test n", "accuracy", "test loss", "MB up", "MB down")]
    for i, acc in enumerate(last["client_acc"]):
        rows.append((str(i), str(meta["client_train_samples"][i]), str(meta["client_test_samples"][i]),
                     f"{acc:.3f}", f"{last['client_loss'][i]:.3f}",
                     f"{sum(r['client_bytes_up'][i] for r in result['rounds']) / 1e6:.2f}",
                     f"{sum(r['client_bytes_down'][i] for r in result['rounds']) / 1e6:.2f}"))
    lines = [format_table(rows, right=True, rule=True)]
    cfg = result["config"]
    lines.append(f"{cfg['algorithm']}: mean accuracy {last['mean_acc']:.3f} (std {last['std_acc']:.3f}) after "
                 f"{last['round']} rounds; {result['meta']['total_s']:.1f} s")
    return "\n".join(lines)
