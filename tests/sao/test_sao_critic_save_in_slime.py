"""In slime's own driver: ``sao`` refuses at ``parse_args`` a critic that would save over the actor's checkpoint
(``--save`` with no critic ``save`` in ``--megatron-config-path``), before Ray starts, in one line naming the fix;
with the fix the same command line parses."""

from __future__ import annotations

from slime_parse_args import error_lines, parse_args

from slime_ascend.sao import critic


def test_slimes_parse_args_refuses_a_critic_saving_over_the_actor(tmp_path):
    role = tmp_path / "sao_megatron.yaml"
    assert critic.main(["-o", str(role)]) == 0  # the freeze list only, as before the fix
    argv = ("--advantage-estimator", "ppo", "--use-critic", "--save", str(tmp_path / "ckpt"), "--save-interval", "10",
            "--megatron-config-path", str(role))
    proc = parse_args(tmp_path, ["sao"], *argv)
    assert proc.returncode == 2 and "PARSED" not in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])
    lines = error_lines(proc)
    assert len(lines) == 1 and f"the critic would save into --save {tmp_path / 'ckpt'}" in lines[0], proc.stderr[-3000:]
    assert f"--merge {role} -o {role} --set save={tmp_path / 'ckpt'}_critic" in lines[0]
    assert "Traceback" not in proc.stderr

    # the fix the line names
    assert critic.main(["--merge", str(role), "-o", str(role), "--set", f"save={tmp_path / 'ckpt'}_critic"]) == 0
    proc = parse_args(tmp_path, ["sao"], *argv)
    assert proc.returncode == 0 and "PARSED" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])
