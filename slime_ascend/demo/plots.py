"""The demos' PNG (the miniature loop and slime's own loop): one quantity per panel, each with its unit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["PANELS", "plot_curves"]

# (history key(s), panel title, y-axis label, y range or None); each panel shows one quantity
PANELS: tuple[tuple[tuple[tuple[str, str], ...], str, str, tuple[float, float] | None], ...] = (
    ((("reward", "all episodes"), ("reward_short", "short episodes")), "Task reward",
     "reward (fraction answered right)", (-0.02, 1.02)),
    ((("kl", ""),), "Distance to the routed teacher", "KL(student || teacher), nats / token", None),
    ((("mismatch", ""),), "Train vs rollout log-probs (quantised sync)", "mean |log p_train - log p_rollout|, nats",
     None),
    ((("masked_frac", ""),), "Tokens masked by DIS", "fraction of response tokens", None),
)


def plot_curves(history: Sequence[dict[str, Any]], path: str, title: str | None = None) -> str:
    """A 2 x 2 figure of :data:`PANELS` against the training step; a quantity the run did not measure
    says so in its panel instead of drawing an empty axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.6), sharex=True)
    for ax, (series, name, ylabel, ylim) in zip(axes.flat, PANELS):
        drawn = 0
        for key, label in series:
            pts = [(h["step"] + 1, float(h[key])) for h in history if h.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, lw=1.2 if drawn == 0 else 1, ls="-" if drawn == 0 else "--",
                        label=label or None)
                drawn += 1
        ax.set_title(name, fontsize=10)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        if ylim:
            ax.set_ylim(*ylim)
        if not drawn:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes,
                    color="0.4")
        elif drawn > 1:
            ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("training step")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
