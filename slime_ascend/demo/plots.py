"""The demo's PNG: reward per step, and the train/rollout mismatch the quantised sync causes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["plot_curves"]


def plot_curves(history: Sequence[dict[str, Any]], path: str) -> str:
    """Two panels: reward (fresh rollouts) and mismatch (|logp_train - logp_rollout|, DIS-masked fraction)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] + 1 for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(steps, [h["reward"] for h in history], marker="o", ms=3, label="reward (all)")
    short = [(s, h["reward_short"]) for s, h in zip(steps, history) if h.get("reward_short") is not None]
    if short:
        ax1.plot(*zip(*short), ls="--", lw=1, label="reward (short episodes)")
    ax1.set_xlabel("step")
    ax1.set_ylabel("reward")
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_title("task reward")
    ax1.legend(fontsize=8)
    for key, label in (("mismatch", "|logp_train - logp_rollout|"), ("masked_frac", "DIS masked fraction")):
        pts = [(s, h[key]) for s, h in zip(steps, history) if h.get(key) is not None]
        if pts:
            ax2.plot(*zip(*pts), marker="o", ms=3, label=label)
    ax2.set_xlabel("step")
    ax2.set_title("train / rollout mismatch (quantised sync)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
