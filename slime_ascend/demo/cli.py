"""``slime-ascend demo``: the closed loop end to end on this machine (no NPU, no slime needed)."""

from __future__ import annotations

import argparse
import sys

from .loop import MODELS, DemoConfig, default_plugins, run_demo


def build_parser() -> argparse.ArgumentParser:
    from ..command import ArgumentParser

    p = ArgumentParser(
        prog="slime-ascend demo",
        description="Run slime's RL loop on this machine: in slime's own train_async.py when slime is available "
                    "(--slime-src), else in miniature on a local Ray cluster: rollout on the torch engine, "
                    "rewards from a digits task, a tiny policy and critic trained through the enabled plugins' "
                    "hooks, and an online-quantised weight sync after every update.",
    )
    p.add_argument("--steps", type=int, default=DemoConfig.steps, help="rollout/train steps (default %(default)s)")
    p.add_argument("--model", choices=MODELS, default="qwen3",
                   help="qwen3 (default): the tiny Qwen3, dense; glm5: the tiny GLM-5 (MoE, MLA, DSA with IndexShare) "
                        "on slime's own glm5 spec, in slime's loop only (--slime-src)")
    p.add_argument("--plugins", default=None,
                   help=f"comma-separated plugins (default: {','.join(default_plugins('qwen3'))} for qwen3, "
                        f"{','.join(default_plugins('glm5'))} for glm5; sao is required: it provides the loss)")
    p.add_argument("--seed", type=int, default=DemoConfig.seed, help="seed of everything (default %(default)s)")
    p.add_argument("--out", default=DemoConfig.out, help="output directory (default ./%(default)s)")
    p.add_argument("--batch", type=int, default=DemoConfig.batch, help="rollouts per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=DemoConfig.lr, help="policy learning rate (default %(default)s)")
    p.add_argument("--slime-src", metavar="DIR", default=None,
                   help="run the plugins in slime's own train_async.py from this THUDM/slime source tree (cpu "
                        "plugin; slime's dependencies must be installed: docs/cpu.md)")
    p.add_argument("--loop", choices=("auto", "slime", "mini"), default="auto",
                   help="slime: slime's own loop (--slime-src, $SLIME_SRC or an importable slime); mini: the "
                        "embedded miniature loop; auto (default): slime's loop when slime and its dependencies "
                        "are importable or --slime-src is given, else the miniature")
    p.add_argument("--no-check", action="store_true", help="skip the contract report at the end")
    p.add_argument("--no-progress", action="store_true", help="plain per-step lines, no progress bar")
    from ..parallel_layout import add_arguments

    add_arguments(p, "parallel layout (of the actor, and of SAO's critic; in slime's loop only)")
    return p


def _layout(ns: argparse.Namespace, plugins: tuple[str, ...]):
    """The layout the flags ask for (None: one rank), checked as ``slime-ascend config ... --flags`` checks it
    (Megatron's rules, the cpu plugin's refusals); raises UserError (one line naming the flag)."""
    from ..command import UserError
    from ..parallel_layout import from_namespace

    layout = from_namespace(ns)
    if layout.is_default:
        return None
    if ns.loop == "mini":
        raise UserError("a layout (--tp/--pp/--cp/--ep/--dp/--sp/--allgather-cp) runs in slime's own loop only; "
                        "--loop mini asks for the miniature. Fix: drop --loop mini and pass --slime-src DIR")
    if layout.ep > 1 and ns.model == "qwen3":
        raise UserError(f"--ep {layout.ep} splits the experts of an MoE model; --model qwen3 is dense. Fix: --model "
                        "glm5, or drop --ep")
    from .. import config

    config.build(["cpu", *plugins], layout=layout)  # the same checks as `slime-ascend config ... --flags`
    return layout


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if ns.steps < 1:
        print(f"error: --steps {ns.steps} is not a positive number of rollouts. Fix: pass --steps 1 or more",
              file=sys.stderr)
        return 2
    from ..compat import transformers_stack

    stack = transformers_stack.problem()  # a transformers outside the range, or a leftover `kernels`: one line
    if stack is not None:
        print(f"error: {stack}", file=sys.stderr)
        return 2
    plugins = (default_plugins(ns.model) if ns.plugins is None
               else tuple(p.strip() for p in ns.plugins.split(",") if p.strip()))
    from ..command import UserError

    try:
        layout = _layout(ns, plugins)
    except (UserError, ValueError) as exc:  # a layout Megatron or a plugin's start-up check refuses
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = DemoConfig(steps=ns.steps, plugins=plugins, model=ns.model, seed=ns.seed, out=ns.out, batch=ns.batch,
                     lr=ns.lr, contract_check=not ns.no_check, progress=not ns.no_progress, layout=layout)
    if ns.slime_src is not None and ns.loop == "mini":
        print("error: --slime-src runs slime's own loop but --loop mini asks for the miniature. Fix: drop --loop mini "
              "(or --slime-src)", file=sys.stderr)
        return 2
    if ns.model != "qwen3" and ns.loop == "mini":
        print(f"error: --model {ns.model} runs in slime's own loop only (the miniature trains the tiny Qwen3). Fix: "
              "drop --loop mini and pass --slime-src DIR", file=sys.stderr)
        return 2
    src = None
    if ns.loop != "mini":
        from .slime_loop import resolve_slime, run_slime_demo

        src, why = resolve_slime(ns.slime_src)
        if src is None and (ns.loop == "slime" or ns.slime_src is not None or ns.model != "qwen3"):
            mini = ", or --loop mini" if ns.model == "qwen3" else f" (--model {ns.model} runs in slime's loop only)"
            print(f"error: {why}" if "Fix:" in why else f"error: {why.rstrip('.')}. Fix: pass --slime-src DIR (a clone "
                  f"of github.com/THUDM/slime){mini}", file=sys.stderr)
            return 2
        if src is None and layout is not None:
            print(f"error: {why.rstrip('.')}; a layout runs in slime's own loop only. Fix: pass --slime-src DIR (a "
                  "clone of github.com/THUDM/slime), or drop the layout flags", file=sys.stderr)
            return 2
        if src is None:
            print(f"note: running the miniature loop ({why})", file=sys.stderr)
    try:
        summary = run_slime_demo(cfg, src) if src is not None else run_demo(cfg)
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        print("interrupted", file=sys.stderr)
        return 130
    if summary.get("interrupted"):
        return 130
    if src is not None:
        return 0 if (summary.get("returncode") == 0 and not summary["plugins_without_evidence"]
                     and summary["model_evidence"]["spec_in_log"]) else 1
    return 0 if summary.get("contracts_passed", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
