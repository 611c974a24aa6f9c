"""In slime's own driver: ``sao`` refuses at ``parse_args`` a critic that would save over the actor's checkpoint
(``--save`` with no critic ``save`` in ``--megatron-config-path``), before Ray starts, in one line naming the fix;
with the fix the same command line parses."""

from __future__ import annotations

import shlex
import shutil

from slime_parse_args import error_lines, parse_args_each

from slime_ascend.sao import critic


def test_slimes_parse_args_refuses_a_critic_saving_over_the_actor(tmp_path):
    role, fixed = tmp_path / "sao_megatron.yaml", tmp_path / "sao_megatron_fixed.yaml"
    assert critic.main(["-o", str(role)]) == 0  # the freeze list only, as before the fix
    # the fix the refusal names, made beforehand on a copy: both command lines run at once
    shutil.copy(role, fixed)
    assert critic.main(["--merge", str(fixed), "-o", str(fixed), "--set", f"save={tmp_path / 'ckpt'}_critic"]) == 0
    argv = ("--advantage-estimator", "ppo", "--use-critic", "--save", str(tmp_path / "ckpt"), "--save-interval", "10",
            "--megatron-config-path")
    proc, proc_fixed = parse_args_each(tmp_path, ["sao"], [(*argv, str(role)), (*argv, str(fixed))])
    assert proc.returncode == 2 and "PARSED" not in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])
    lines = error_lines(proc)
    assert len(lines) == 1 and f"the critic would save into --save {tmp_path / 'ckpt'}" in lines[0], proc.stderr[-3000:]
    fix = f"--merge {role} -o {role} --set save={tmp_path / 'ckpt'}_critic"
    assert fix in lines[0]
    assert "Traceback" not in proc.stderr

    # the fix the line names makes the file that parses
    assert critic.main(shlex.split(fix)) == 0 and role.read_text() == fixed.read_text()
    assert proc_fixed.returncode == 0 and "PARSED" in proc_fixed.stdout, (proc_fixed.stdout[-2000:],
                                                                           proc_fixed.stderr[-3000:])
