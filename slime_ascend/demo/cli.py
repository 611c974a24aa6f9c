"""``slime-ascend demo``: the closed loop end to end on this machine (no NPU, no slime needed)."""

from __future__ import annotations

import argparse
import sys

from .loop import DEFAULT_PLUGINS, DemoConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slime-ascend demo",
        description="Run slime's RL loop in miniature on a local Ray cluster: rollout on the reference engine, "
                    "rewards from a digits task, a tiny policy and critic trained through the enabled plugins' "
                    "hooks, and an online-quantised weight sync after every update.",
    )
    p.add_argument("--steps", type=int, default=DemoConfig.steps, help="rollout/train steps (default %(default)s)")
    p.add_argument("--plugins", default=",".join(DEFAULT_PLUGINS),
                   help="comma-separated plugins (default %(default)s; sao is required: it provides the loss)")
    p.add_argument("--seed", type=int, default=DemoConfig.seed, help="seed of everything (default %(default)s)")
    p.add_argument("--out", default=DemoConfig.out, help="output directory (default ./%(default)s)")
    p.add_argument("--batch", type=int, default=DemoConfig.batch, help="rollouts per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=DemoConfig.lr, help="policy learning rate (default %(default)s)")
    p.add_argument("--no-check", action="store_true", help="skip the contract report at the end")
    p.add_argument("--no-progress", action="store_true", help="plain per-step lines, no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if ns.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    plugins = tuple(p.strip() for p in ns.plugins.split(",") if p.strip())
    cfg = DemoConfig(steps=ns.steps, plugins=plugins, seed=ns.seed, out=ns.out, batch=ns.batch, lr=ns.lr,
                     contract_check=not ns.no_check, progress=not ns.no_progress)
    from .loop import run_demo

    try:
        summary = run_demo(cfg)
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        print("interrupted", file=sys.stderr)
        return 130
    if summary.get("interrupted"):
        return 130
    return 0 if summary.get("contracts_passed", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
