"""``slime-ascend dsa-index-sets TRAIN_DIR [ROLLOUT_DIR]``: the DSA key sets the train side selected compared with
the rollout side's, per layer (:mod:`slime_ascend.dsa.index_sets`). Exit status 0 when every compared query
position read the same keys on both sides, 1 when some did not (or nothing could be compared), 2 on bad input."""

from __future__ import annotations

from ..command import ArgumentParser

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="slime-ascend dsa-index-sets",
                            description="compare the DSA key sets of the train side (the dsa-determinism plugin's "
                            "ascend_dsa_index_dump_dir) with the rollout side's (serve-torch --dump-dsa-index-sets), "
                            "per layer and query position")
    parser.add_argument("train_dir", help="the train actors' records (train-*.pt)")
    parser.add_argument("rollout_dir", nargs="?", default=None,
                        help="the engine's records (rollout-*.pt); default: TRAIN_DIR")
    args = parser.parse_args(argv)  # before torch is imported: --help answers at once
    from .index_sets import compare_dirs

    comparison = compare_dirs(args.train_dir, args.rollout_dir or args.train_dir)
    for line in comparison.lines():
        print(line)
    print("the same key sets on both sides" if comparison.equal else "key sets differ (or nothing was compared)")
    return 0 if comparison.equal else 1
