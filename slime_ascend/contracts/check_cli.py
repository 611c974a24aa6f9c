"""``slime-ascend check``: the numerical-contract report on this device."""

from __future__ import annotations

import argparse

from ..command import ArgumentParser


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="slime-ascend check",
        description="Compare log-probs of the same token IDs along two numeric paths, report mismatch and "
        "DIS/IcePop masked fractions, check top-k determinism and the DSA indexer top-k's index-set agreement "
        "(key-sharded merge vs unsharded, bf16 vs fp32 scores). Exit status 1 when a contract is broken.",
    )
    p.add_argument("--model", default=None, help="local HF checkpoint dir (safetensors); default: built-in tiny model")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, npu (default cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="out_json", default="slime-ascend-check.json", help="JSON report path ('' for none)")
    p.add_argument("--plot", default=None, help="PNG histogram of the log-ratio")
    p.add_argument("--verifiers", metavar="CONFIG", default=None,
                   help="instead: run the verifier gate (oracle rewarded, no-action and unfinished runs given nothing) "
                        "over the verifiers of the job this YAML (the one given to slime's --custom-config-path) describes")
    return p


def _verifier_gate(config: str) -> int:
    from ..verifiers.gate import refusal
    from ..verifiers.job import check_config

    checked = check_config(config)
    if not checked:
        print("no verifier to check: the YAML names no compaction environment, reward function or rm_type")
        return 1
    broken = 0
    for verifier, results in checked:
        bad = [r for r in results if not r.passed]
        broken += bool(bad)
        print(f"{'FAIL' if bad else 'ok  '}  {verifier.kind} {verifier.name}: {len(results)} cases")
        for r in bad:
            print(f"      {refusal(r)}")
    print("every verifier passes the gate" if not broken else f"{broken} verifier(s) fail the gate")
    return 1 if broken else 0


def main(argv: list[str] | None = None) -> int:
    """Run by ``slime-ascend check`` inside the CLI's one error handler (a ValueError: one line, exit 2)."""
    ns = build_parser().parse_args(argv)
    if ns.verifiers is not None:
        return _verifier_gate(ns.verifiers)
    if ns.device.startswith("npu"):
        from ..accelerator.npu import load_torch_npu

        if load_torch_npu() is None:
            raise ValueError("--device npu needs torch_npu. Fix: pip install 'slime-ascend[npu]' on an Ascend host")
    import torch

    try:
        torch.device(ns.device)
    except RuntimeError:
        raise ValueError(f"--device {ns.device!r} is not a torch device. Fix: use cpu, cuda, cuda:N or npu") from None
    from .check import format_table, run_check

    report = run_check(model_dir=ns.model, device=ns.device, seed=ns.seed, out_json=ns.out_json or None, plot=ns.plot)
    print(format_table(report))
    if ns.out_json:
        print(f"JSON report: {ns.out_json}")
    if ns.plot:
        print(f"log-ratio histogram: {ns.plot}")
    print("all contracts hold" if report.passed else "CONTRACT BROKEN: see the FAIL rows above")
    return 0 if report.passed else 1
