"""``slime-ascend config PLUGIN... --flags --tp N --pp N --cp N --ep N --dp N [--sp] [--allgather-cp]``: the slime
flags of a parallel layout (Megatron's sizes and the train ranks slime starts), after the plugins' flags; a layout
Megatron or a plugin refuses is one line naming the flag."""

import shlex
import subprocess
import sys

import pytest

from slime_ascend import config
from slime_ascend.parallel_layout import Layout, LayoutError


def _value(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


@pytest.mark.parametrize("layout, world", [
    (Layout(), 1), (Layout(tp=2), 2), (Layout(tp=2, sp=True), 2), (Layout(pp=2), 2), (Layout(dp=2), 2),
    (Layout(cp=2), 2), (Layout(cp=2, allgather_cp=True), 2), (Layout(ep=2), 2), (Layout(tp=2, ep=2, sp=True), 4),
    (Layout(tp=2, pp=2), 4), (Layout(ep=4, dp=2, cp=2), 4), (Layout(ep=2, dp=4), 4),
])
def test_flags_name_every_size_and_the_train_ranks(layout, world):
    words = layout.flags()
    assert [_value(words, f) for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                       "--context-parallel-size", "--expert-model-parallel-size")] == \
        [str(layout.tp), str(layout.pp), str(layout.cp), str(layout.ep)]
    assert _value(words, "--actor-num-nodes") == "1" and _value(words, "--actor-num-gpus-per-node") == str(world)
    assert ("--sequence-parallel" in words) == layout.sp and ("--allgather-cp" in words) == layout.allgather_cp
    assert layout.world == world


@pytest.mark.parametrize("layout, flag, fix", [
    (Layout(tp=0), "--tp 0", "Fix: --tp 1 or more"),
    (Layout(dp=0), "--dp 0", "Fix: --dp 1 or more"),
    (Layout(sp=True), "--sp with --tp 1", "Fix: --tp 2 or more, or drop --sp"),
    (Layout(allgather_cp=True), "--allgather-cp with --cp 1", "Fix: --cp 2 or more"),
    (Layout(ep=2, dp=1), "--ep 2 does not divide --dp 1 x --cp 1", "Fix: --dp 2"),
    (Layout(ep=4, cp=2, dp=1), "--ep 4 does not divide --dp 1 x --cp 2", "Fix: --dp 2"),
    (Layout(tp=2, ep=2), "--ep 2 with --tp 2 needs --sp", "Fix: add --sp"),
])
def test_a_layout_megatron_refuses_is_one_line_naming_the_flag(layout, flag, fix):
    with pytest.raises(LayoutError) as info:
        layout.flags()
    message = str(info.value)
    assert message.startswith(flag) and fix in message and "\n" not in message, message


def test_the_layout_flags_follow_the_plugins_and_win_over_slimes_defaults():
    generated = config.build(["dis"], layout=Layout(tp=2, ep=2, sp=True))
    plain = config.build(["dis"])
    assert generated.flags[:len(plain.flags)] == plain.flags  # the plugins' flags first, the layout last
    assert generated.flags[len(plain.flags):] == Layout(tp=2, ep=2, sp=True).flags()
    assert config.build(["dis"], layout=None).flags == plain.flags


def test_the_cpu_plugins_refusal_is_its_own_line_and_its_ray_hint_a_note():
    pytest.importorskip("torch")
    with pytest.raises(LayoutError) as info:  # context parallelism with another layout: the cpu plugin's line
        config.build(["cpu"], layout=Layout(cp=2, tp=2))
    message = str(info.value)
    assert message.startswith("cpu: --tensor-model-parallel-size 2 with --context-parallel-size 2 is not supported") \
        and "Fix:" in message and "\n" not in message, message
    generated = config.build(["cpu"], layout=Layout(tp=2, ep=2, sp=True))
    assert _value(generated.flags, "--actor-num-gpus-per-node") == "4"
    hints = [n for n in generated.notes if "RAY_OVERRIDE_RESOURCES" in n]
    assert len(hints) == 1 and "'{\"CPU\": 7}'" in hints[0], generated.notes  # 4 ranks + 2 + one engine's 0.2
    assert not [n for n in config.build(["cpu"], layout=Layout()).notes if "RAY_OVERRIDE_RESOURCES" in n]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *argv], capture_output=True, text=True,
                          timeout=300)


def test_cli_prints_the_layouts_flags_on_one_line():
    proc = _cli("dis", "--flags", "--tp", "2", "--ep", "2", "--sp")
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    assert words[-12:] == Layout(tp=2, ep=2, sp=True).flags()[-12:] and proc.stdout.count("\n") == 1


@pytest.mark.parametrize("argv, expected", [
    (("dis", "--flags", "--tp", "2", "--ep", "2"), "error: --ep 2 with --tp 2 needs --sp"),
    (("dis", "--flags", "--cp", "1", "--allgather-cp"), "error: --allgather-cp with --cp 1"),
    (("dis", "-o", "-", "--tp", "2"), "error: a layout (--tp/--pp/--cp/--ep/--dp/--sp/--allgather-cp) is printed "
                                      "as slime flags only. Fix: add --flags"),
    (("dis", "--flags", "--tp", "two"), "error: slime-ascend config: argument --tp: invalid int value"),
])
def test_cli_refuses_a_bad_layout_in_one_line(argv, expected):
    proc = _cli(*argv)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(expected) and "Fix:" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
