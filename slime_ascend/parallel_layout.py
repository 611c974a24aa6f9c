"""A parallel layout (``--tp 2 --ep 2``, ...) as the slime flags that ask for it.

``slime-ascend config PLUGIN... --flags --tp 2 --ep 2`` prints them after the plugins' flags: Megatron's sizes
(``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, ``--context-parallel-size``,
``--expert-model-parallel-size``, with it ``--expert-tensor-parallel-size 1`` as slime's MoE scripts pass it,
``--sequence-parallel``, ``--allgather-cp``) and the train ranks slime starts
(``--actor-num-nodes 1 --actor-num-gpus-per-node TP x PP x CP x DP``). Megatron's own rules on the sizes are
checked here, each refusal one line naming the flag; what a plugin refuses (the ``cpu`` plugin: context
parallelism with another layout) is its start-up check's line, run by :func:`slime_ascend.config.build`.
"""

from __future__ import annotations

import dataclasses
import math

from .command import UserError
from .cpu.ray_capacity import EXTERNAL_ENGINE, OUTSIDE_GROUP  # what Ray needs beside the train ranks


class LayoutError(UserError):
    """A layout Megatron (or slime) would refuse, in one line naming the flag."""


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int | None = None  # None: the smallest data parallelism EP allows (EP / CP, at least 1)
    sp: bool = False
    allgather_cp: bool = False

    @property
    def data_parallel(self) -> int:
        if self.dp is not None:
            return self.dp
        return max(1, self.ep // self.cp) if self.ep % self.cp == 0 else self.ep

    @property
    def world(self) -> int:
        """Train ranks: TP x PP x CP x DP (expert parallelism is carved out of the data x context ranks)."""
        return self.tp * self.pp * self.cp * self.data_parallel

    @property
    def is_default(self) -> bool:
        return self == Layout()

    def check(self) -> None:
        for flag, value in (("--tp", self.tp), ("--pp", self.pp), ("--cp", self.cp), ("--ep", self.ep),
                            ("--dp", self.dp)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise LayoutError(f"{flag} {value} is not a size. Fix: {flag} 1 or more")
        if self.sp and self.tp == 1:
            raise LayoutError("--sp with --tp 1: sequence parallelism splits the tensor-parallel group's sequence. "
                              "Fix: --tp 2 or more, or drop --sp")
        if self.allgather_cp and self.cp == 1:
            raise LayoutError("--allgather-cp with --cp 1: it is a context-parallel layout. Fix: --cp 2 or more, or "
                              "drop --allgather-cp")
        if self.ep > 1 and (self.data_parallel * self.cp) % self.ep:
            raise LayoutError(f"--ep {self.ep} does not divide --dp {self.data_parallel} x --cp {self.cp}: Megatron "
                              "carves the expert-parallel groups out of the data x context parallel ranks. Fix: "
                              f"--dp {math.lcm(self.ep, self.cp) // self.cp}, or an --ep that divides "
                              f"{self.data_parallel * self.cp}")
        if self.ep > 1 and self.tp > 1 and not self.sp:
            raise LayoutError(f"--ep {self.ep} with --tp {self.tp} needs --sp (Megatron: expert and tensor "
                              "parallelism together need sequence parallelism). Fix: add --sp")

    def flags(self) -> list[str]:
        """slime's flags for this layout (checked first)."""
        self.check()
        words = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
                 "--context-parallel-size", str(self.cp), "--expert-model-parallel-size", str(self.ep)]
        if self.ep > 1:
            # what every MoE script of slime passes; Megatron's default is the TP size, whose expert-TP token gather
            # (uneven pieces) gloo cannot do (the cpu plugin refuses it)
            words += ["--expert-tensor-parallel-size", "1"]
        if self.sp:
            words.append("--sequence-parallel")
        if self.allgather_cp:
            words.append("--allgather-cp")
        return words + ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(self.world)]

    def slime_args(self) -> dict:
        """What slime's parsed args hold for this layout (for the plugins' start-up checks)."""
        return {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
                "context_parallel_size": self.cp, "expert_model_parallel_size": self.ep,
                "expert_tensor_parallel_size": 1 if self.ep > 1 else None,
                "sequence_parallel": self.sp, "allgather_cp": self.allgather_cp,
                "actor_num_gpus_per_node": self.world}

    def ray_cpus(self, roles: int = 1, engines: int = 1) -> int:
        """Logical CPUs Ray needs for this layout: one per train rank of each of ``roles`` (the actor, and SAO's
        critic, which slime gives the actor's layout), slime's RolloutManager and its lock, and ``engines``
        external engine handles."""
        return math.ceil(self.world * roles + OUTSIDE_GROUP + EXTERNAL_ENGINE * engines)

    def ray_hint(self) -> str:
        """The cpu plugin's Ray note: logical CPUs for the train ranks, the RolloutManager, its lock and one
        external engine (a 2-core host advertises 2)."""
        cpus = self.ray_cpus()
        return (f"{self.world} train rank(s): on a host with fewer cores than {cpus}, export "
                f"RAY_OVERRIDE_RESOURCES='{{\"CPU\": {cpus}}}' (logical CPUs for the train ranks, slime's "
                "RolloutManager and its lock, one external engine; add one per rollout device without "
                "--rollout-external-engine-addrs)")


def add_arguments(parser, title: str = "parallel layout") -> None:
    """``--tp --pp --cp --ep --dp --sp --allgather-cp`` on ``parser``, in a help group titled ``title`` (what the
    command does with the layout; it may name only the command's own options)."""
    group = parser.add_argument_group(title)
    for flag, what in (("--tp", "tensor"), ("--pp", "pipeline"), ("--cp", "context"), ("--ep", "expert")):
        group.add_argument(flag, type=int, default=1, metavar="N", help=f"{what}-parallel size (default 1)")
    group.add_argument("--dp", type=int, default=None, metavar="N",
                       help="data-parallel size (default: the smallest --ep allows, EP / CP or 1)")
    group.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp 2 or more)")
    group.add_argument("--allgather-cp", action="store_true", help="slime's allgather context-parallel layout")


def from_namespace(ns) -> Layout:
    return Layout(tp=ns.tp, pp=ns.pp, cp=ns.cp, ep=ns.ep, dp=ns.dp, sp=ns.sp, allgather_cp=ns.allgather_cp)
