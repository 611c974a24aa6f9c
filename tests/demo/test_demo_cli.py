"""``slime-ascend demo``'s command line: ``--model`` (qwen3 by default, glm5 in slime's loop only), its default
plugins per model, and the one-line refusals, all without running a loop."""

from __future__ import annotations

import pytest

from slime_ascend.demo import cli, slime_loop
from slime_ascend.demo.loop import (
    DEFAULT_PLUGINS,
    MODELS,
    DemoConfig,
    default_plugins,
    run_demo,
)


def test_model_defaults_to_qwen3_and_accepts_glm5():
    ns = cli.build_parser().parse_args([])
    assert ns.model == "qwen3" and ns.plugins is None
    assert cli.build_parser().parse_args(["--model", "glm5"]).model == "glm5"
    assert MODELS == ("qwen3", "glm5") and DemoConfig().model == "qwen3"


def test_default_plugins_per_model():
    assert default_plugins("qwen3") == DEFAULT_PLUGINS == ("sao", "compaction", "opd", "staleness", "int8-sync")
    assert default_plugins("glm5") == (*DEFAULT_PLUGINS, "dsa-determinism")
    with pytest.raises(ValueError, match="--model 'llama' is not one of qwen3, glm5"):
        default_plugins("llama")


def _main(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own refusal
        rc = exc.code
    return rc, capsys.readouterr().err


def test_an_unknown_model_is_refused_in_one_line_naming_the_choices(capsys, tmp_path):
    rc, err = _main(capsys, "--model", "llama", "--out", str(tmp_path / "out"))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and "Fix: " in err and "Traceback" not in err
    assert "--model" in err and "'llama'" in err and "qwen3" in err and "glm5" in err
    assert not (tmp_path / "out").exists()


def test_glm5_is_refused_outside_slimes_loop(capsys, tmp_path, monkeypatch):
    out = tmp_path / "out"
    rc, err = _main(capsys, "--model", "glm5", "--loop", "mini", "--out", str(out))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: --model glm5 runs in slime's own")
    assert "Fix: drop --loop mini and pass --slime-src DIR" in err
    # auto with no slime: an error naming --slime-src, not the miniature loop on the tiny Qwen3
    monkeypatch.setattr(slime_loop, "resolve_slime", lambda explicit: (None, "no THUDM/slime source tree found"))
    rc, err = _main(capsys, "--model", "glm5", "--out", str(out))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "Fix: pass --slime-src DIR" in err and "--model glm5 runs in slime's loop only" in err
    assert "--loop mini" not in err
    assert not out.exists()
    with pytest.raises(ValueError, match="miniature loop trains the tiny Qwen3 only"):
        run_demo(DemoConfig(model="glm5", out=str(out)))
    assert not out.exists()


def test_plugins_default_follows_the_model(capsys, tmp_path, monkeypatch):
    """What main hands to slime's loop: the model and its default plugins, or the --plugins given."""
    seen = []
    monkeypatch.setattr(slime_loop, "resolve_slime", lambda explicit: (tmp_path, ""))
    monkeypatch.setattr(slime_loop, "run_slime_demo", lambda cfg, src: seen.append(cfg) or {
        "returncode": 0, "plugins_without_evidence": [], "model_evidence": {"spec_in_log": True}})
    assert _main(capsys, "--model", "glm5", "--out", str(tmp_path / "a"))[0] == 0
    assert _main(capsys, "--model", "glm5", "--plugins", "sao,dis", "--out", str(tmp_path / "b"))[0] == 0
    assert _main(capsys, "--out", str(tmp_path / "c"))[0] == 0
    assert [(c.model, c.plugins) for c in seen] == [("glm5", (*DEFAULT_PLUGINS, "dsa-determinism")),
                                                   ("glm5", ("sao", "dis")), ("qwen3", DEFAULT_PLUGINS)]
    # a run whose log does not show the model's spec is not a success
    monkeypatch.setattr(slime_loop, "run_slime_demo", lambda cfg, src: {
        "returncode": 0, "plugins_without_evidence": [], "model_evidence": {"spec_in_log": False}})
    assert _main(capsys, "--model", "glm5", "--out", str(tmp_path / "d"))[0] == 1


def test_a_layout_goes_to_slimes_loop_as_the_flags_config_prints(capsys, tmp_path, monkeypatch):
    """``--tp/--ep/--sp ...``: the layout reaches slime's loop as ``slime-ascend config ... --flags`` prints it, in
    place of the demo's one-rank sizes, with the logical CPUs Ray needs for the actor's and SAO's critic's ranks."""
    import json
    from pathlib import Path

    from slime_ascend.parallel_layout import Layout

    seen = []
    monkeypatch.setattr(slime_loop, "resolve_slime", lambda explicit: (tmp_path, ""))
    monkeypatch.setattr(slime_loop, "run_slime_demo", lambda cfg, src: seen.append(cfg) or {
        "returncode": 0, "plugins_without_evidence": [], "model_evidence": {"spec_in_log": True}})
    assert _main(capsys, "--model", "glm5", "--tp", "2", "--ep", "2", "--sp", "--out", str(tmp_path / "a"))[0] == 0
    assert _main(capsys, "--out", str(tmp_path / "b"))[0] == 0
    (four, one) = seen
    assert four.layout == Layout(tp=2, ep=2, sp=True) and one.layout is None
    flags = slime_loop.layout_flags(four)
    assert flags == {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "1",
                     "--context-parallel-size": "1", "--expert-model-parallel-size": "2",
                     "--expert-tensor-parallel-size": "1", "--sequence-parallel": None, "--actor-num-nodes": "1",
                     "--actor-num-gpus-per-node": "4"}
    assert slime_loop.layout_flags(one) == {} and slime_loop.ray_resources(one, DEFAULT_PLUGINS) == {}
    # 4 actor + 4 critic ranks, the RolloutManager and its lock, the engine handles: more than the default 8
    assert json.loads(slime_loop.ray_resources(four, DEFAULT_PLUGINS)["RAY_OVERRIDE_RESOURCES"]) == {"CPU": 11}
    assert slime_loop.ray_resources(four, ("compaction",)) == {}  # 4 ranks, no critic: the default suffices
    # the command: the layout's sizes in place of the demo's one-rank ones, each flag once
    own = {"--tensor-model-parallel-size": "1", "--actor-num-gpus-per-node": "1", "--lr": "1e-3", **flags}
    cmd = slime_loop.slime_command(Path("/slime"), "glm5", own, [], Path("a.yaml"))
    assert cmd.count("--tensor-model-parallel-size") == 1
    assert cmd[cmd.index("--tensor-model-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--actor-num-gpus-per-node") + 1] == "4" and "--sequence-parallel" in cmd


@pytest.mark.parametrize("argv, words", [
    (("--loop", "mini", "--tp", "2"), "runs in slime's own loop only"),
    (("--ep", "2"), "--ep 2 splits the experts of an MoE model; --model qwen3 is dense"),
    (("--sp",), "--sp with --tp 1"),
    (("--tp", "2", "--cp", "2"), "--context-parallel-size"),  # the cpu plugin: CP with another layout
])
def test_a_layout_slime_would_refuse_is_refused_in_one_line(capsys, tmp_path, monkeypatch, argv, words):
    monkeypatch.setattr(slime_loop, "resolve_slime", lambda explicit: (tmp_path, ""))
    monkeypatch.setattr(slime_loop, "run_slime_demo", lambda cfg, src: pytest.fail("the demo ran"))
    rc, err = _main(capsys, *argv, "--out", str(tmp_path / "out"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert words in err and "Fix:" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
