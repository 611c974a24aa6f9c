"""The ``slime-ascend`` command. Subcommands import their implementation lazily."""

from __future__ import annotations

import argparse
import json
import sys

from .command import TRACEBACK_ENV, ArgumentParser, run_command  # noqa: F401 (TRACEBACK_ENV: re-exported)
from .quant.names import FORMATS as QUANT_FORMATS  # the one list of the converter's formats (no torch)


def _cmd_plugins(ns: argparse.Namespace) -> int:
    from .plugins import registry
    from .plugins.slots import SLOTS

    known = registry.available()
    if ns.json:
        print(json.dumps({
            name: {
                "description": p.description,
                "requires": list(p.requires),
                "conflicts": list(p.conflicts),
                "contributions": [{"slot": c.slot, "order": c.order, "target": c.target} for c in p.contributions],
                "settings": {s.key: s.default for s in p.settings},
                "patches": [{"id": u.patch, "moment": u.moment, "when": u.when} for u in p.patches],
            }
            for name, p in sorted(known.items())
        }, indent=2))
        return 0
    for name, why in sorted(registry.broken().items()):
        print(f"{name}: BROKEN: {why}")
    for name, plugin in sorted(known.items()):
        print(f"{name}: {plugin.description}")
        if plugin.requires:
            print(f"    requires: {', '.join(plugin.requires)}")
        if plugin.conflicts:
            print(f"    conflicts: {', '.join(plugin.conflicts)}")
        for c in plugin.contributions:
            slot = SLOTS[c.slot]
            print(f"    hook {c.slot} ({slot.slime_arg or 'runtime patch'}, order {c.order}): {c.target}")
        for u in plugin.patches:
            print(f"    runtime patch: {u.patch} (at {u.moment}{', when ' + u.when if u.when else ''})")
        if plugin.settings:
            print(f"    settings: {', '.join(s.key for s in plugin.settings)}")
    return 0


def _cmd_config(ns: argparse.Namespace) -> int:
    from . import config

    from .parallel_layout import LayoutError, from_namespace

    layout = from_namespace(ns)
    if not layout.is_default and not ns.flags:
        raise LayoutError("a layout (--tp/--pp/--cp/--ep/--dp/--sp/--allgather-cp) is printed as slime flags only. "
                          "Fix: add --flags (the YAML does not depend on the layout)")
    generated = config.build(ns.plugins, config.parse_overrides(ns.set), None if layout.is_default else layout)
    for note in generated.notes:
        print(f"note: {note}", file=sys.stderr)
    if ns.flags:
        # stdout is exactly the pasteable flags, for `python train.py ... $(slime-ascend config ... --flags)`
        line = generated.flags_line()
        if line:
            print(line)
        for text, plugin, why in generated.manual:
            print(f"note: add yourself: {text}  # {plugin}: {why}", file=sys.stderr)
        return 0
    if ns.output == "-":
        sys.stdout.write(generated.yaml_text)
        print(generated.hint("<this file>"), file=sys.stderr)
        return 0
    from pathlib import Path

    path = Path(ns.output)
    if path.exists() and not ns.force:
        print(f"error: {path} exists. Fix: pass --force to overwrite it, or choose another -o path", file=sys.stderr)
        return 2
    # a directory of its own for this config (e.g. `-o sao-int8/ascend.yaml`): the companion files land there too,
    # apart from another config's (sao's sao_megatron.yaml); a new directory holds nothing in the way
    path.parent.mkdir(parents=True, exist_ok=True)
    generated.check_files(str(path.resolve().parent), force=ns.force)  # nothing written when one is in the way
    from .files import write_file

    write_file(path, generated.yaml_text)  # a full disk: one line naming the file
    written = generated.write_files(str(path.resolve().parent), force=ns.force)  # e.g. sao's critic role file
    print(generated.hint(str(path), written))
    return 0


def _cmd_doctor(ns: argparse.Namespace) -> int:
    from . import doctor

    lines = doctor.run(check_patches=not ns.no_patches, probe_ray=ns.ray)
    print(doctor.format_lines(lines))
    return doctor.exit_status(lines)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = ArgumentParser(prog="slime-ascend", description=__doc__)
    parser.add_argument("--version", action="version", version=f"slime-ascend {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list the plugins and what each contributes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("config", help="write the YAML for slime's --custom-config-path (or print the flags)")
    p.add_argument("plugins", nargs="+", help="plugin names (or 'all')")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("-o", "--output", help="YAML file to write ('-' for stdout); its directory is created if "
                      "missing, and the files the plugins need (sao's critic role file) are written beside it")
    what.add_argument("--flags", action="store_true",
                      help="print only the flags the plugins need on slime's command line, as one shell-quoted "
                      "line (nothing when none); writes no YAML")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="write this value for a plugin setting instead of its default (repeatable; value is YAML)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    from .parallel_layout import add_arguments as add_layout_arguments

    add_layout_arguments(p, "parallel layout (with --flags: slime's flags for it)")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("doctor", help="versions, activation, and whether our patches fit this slime")
    p.add_argument("--no-patches", action="store_true", help="skip importing slime to check patch targets")
    p.add_argument("--ray", action="store_true", help="ask a Ray worker what it sees (starts/joins a cluster)")
    p.set_defaults(func=_cmd_doctor)

    for name, (_, help_text) in PASSTHROUGH.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


# Subcommands whose module owns its own argument parser: ``slime-ascend NAME ARGS...`` calls
# ``function(ARGS)`` (imported only when used).
PASSTHROUGH: dict[str, tuple[str, str]] = {
    "serve-torch": ("slime_ascend.rollout.torch_engine.cli:serve_torch",
                    "serve the torch engine (transformers' models in plain torch) over SGLang's HTTP API "
                    "(loopback by default)"),
    "serve-reference": ("slime_ascend.rollout.torch_engine.cli:serve_torch",
                        "old name of serve-torch (the engine is not the RL reference model)"),
    "dsa-index-sets": ("slime_ascend.dsa.cli:main",
                       "compare the DSA key sets the train side selected with the rollout side's, per layer (GLM-5)"),
    "check": ("slime_ascend.contracts.check_cli:main",
              "numerical-contract report on this device (log-prob mismatch, DIS/IcePop, top-k determinism)"),
    "quantize": ("slime_ascend.quant.cli:main_quantize",
                 f"offline converter: HF_DIR OUT_DIR --format {'|'.join(QUANT_FORMATS)}"),
    "verify-quant": ("slime_ascend.quant.cli:main_verify",
                     "check online-synced tensors against the offline converter's file, bit for bit"),
    "tito-fingerprint": ("slime_ascend.tito.cli:main",
                         "print a checkpoint's tokenizer/chat-template revision (for ascend_tito_tokenizer_revision)"),
    "memory": ("slime_ascend.memory.cli:main",
               "peak memory per role (actor, critic, reference, rollout, teachers), object by object, for a config "
               "and layout"),
    "demo": ("slime_ascend.demo.cli:main",
             "the embedded closed loop on this machine (Ray, torch engine, tiny policy, every plugin)"),
    "dryrun": ("slime_ascend.dryrun:main",
               "-- <slime launch command>: what would fail on the Ascend cluster (flags, plugins, placement, "
               "offload, environment), one line each, before booking NPU time"),
}


def _arm_npu_emulation() -> int:
    """``SLIME_ASCEND_EMULATE_NPU=1``: this process is an emulated Ascend host (torch_npu importable, the ``npu``
    device on host memory) for whichever command runs, e.g. ``serve-torch --device npu``; 2 with one line where the
    emulation refuses (a real torch_npu, a value it does not know)."""
    from .npu_emulation import EmulationRefused, arm_from_environment

    try:
        arm_from_environment()
    except EmulationRefused as exc:
        print(f"slime-ascend: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    refused = _arm_npu_emulation()
    if refused:
        return refused
    if argv and argv[0] in PASSTHROUGH:
        from .plugins.base import resolve

        return run_command(lambda: resolve(PASSTHROUGH[argv[0]][0])(argv[1:]))
    parser = build_parser()
    ns = parser.parse_args(argv)
    return run_command(ns.func, ns)


if __name__ == "__main__":
    sys.exit(main())
