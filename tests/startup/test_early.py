"""Plugins are validated where each slime role first holds ``args`` (driver: parse_args; rollout
manager: init_http_client; train actor: TrainRayActor.init), not at the first hook call.

A stand-in ``slime`` package (only those three functions) runs in a fresh interpreter with the
bootstrap active, as the .pth starts it in every slime process."""

from __future__ import annotations

import argparse
import os
import textwrap

import pytest
import yaml
from conftest import run_python

from slime_ascend import config

FAKE_SLIME = {
    "slime/__init__.py": "",
    "slime/utils/__init__.py": "",
    "slime/utils/arguments.py": """
        import argparse, yaml
        def parse_args():
            p = argparse.ArgumentParser()
            p.add_argument("--custom-config-path")
            args, _ = p.parse_known_args()
            with open(args.custom_config_path) as f:
                for k, v in (yaml.safe_load(f) or {}).items():
                    setattr(args, k, v)
            return args
    """,
    "slime/utils/http_utils.py": """
        def init_http_client(args):
            return "client"
    """,
    "slime/ray/__init__.py": "",
    "slime/ray/train_actor.py": """
        class TrainRayActor:
            def init(self, args, role, with_ref=False):
                return "initialised " + role
    """,
}

DRIVER = (
    "import sys\n"
    "sys.argv = ['train.py', '--custom-config-path', sys.argv[1]]\n"
    "from slime.utils.arguments import parse_args\n"
    "args = parse_args()\n"
    "print('training with', args.ascend_plugins)\n"
)


@pytest.fixture
def fake_slime(tmp_path):
    root = tmp_path / "site"
    for rel, text in FAKE_SLIME.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tmp_path / "driver.py").write_text(DRIVER)
    return tmp_path


def _env(tmp, plugins):
    path = os.pathsep.join([str(tmp / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {"PYTHONPATH": path}
    if plugins is not None:
        env["SLIME_ASCEND_PLUGINS"] = plugins
    return env


def _yaml(tmp, names, edit=None, overrides=None):
    data = yaml.safe_load(config.build(names, overrides).yaml_text)
    data.update(edit or {})
    path = tmp / "ascend.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _drive(tmp, yaml_path, plugins):
    return run_python(f"import runpy, sys; sys.argv = ['driver', {str(yaml_path)!r}]; "
                      f"runpy.run_path({str(tmp / 'driver.py')!r}, run_name='__main__')", env=_env(tmp, plugins))


def _refused(proc):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "training with" not in proc.stdout
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("slime-ascend: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_driver_accepts_a_good_config(fake_slime):
    proc = _drive(fake_slime, _yaml(fake_slime, ["dis"]), "dis")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "training with ['dis']"


def test_driver_refuses_dis_with_icepop_at_parse_args(fake_slime):
    path = _yaml(fake_slime, ["dis", "icepop"], edit={"ascend_dis_weight": "ratio"},
                 overrides={"ascend_dis_weight": "mask"})
    line = _refused(_drive(fake_slime, path, "dis,icepop"))
    assert "icepop" in line and "ascend_dis_weight" in line


def test_driver_refuses_a_bad_setting_value_at_parse_args(fake_slime):
    line = _refused(_drive(fake_slime, _yaml(fake_slime, ["dis"], edit={"ascend_dis_weight": "sometimes"}), "dis"))
    assert "ascend_dis_weight='sometimes'" in line and "Fix:" in line


def test_driver_refuses_a_misspelled_key_naming_the_real_one(fake_slime):
    path = _yaml(fake_slime, ["sao"], edit={"ascend_sao_critic_iter": 4})
    line = _refused(_drive(fake_slime, path, "sao"))
    assert "'ascend_sao_critic_iter'" in line and "did you mean 'ascend_sao_critic_iters'" in line


def test_driver_refuses_environment_and_yaml_disagreeing(fake_slime):
    line = _refused(_drive(fake_slime, _yaml(fake_slime, ["dis"]), "icepop"))
    assert "SLIME_ASCEND_PLUGINS='icepop' disagrees" in line


def test_without_the_bootstrap_nothing_is_wrapped(fake_slime):
    path = _yaml(fake_slime, ["dis"], edit={"ascend_dis_weight": "sometimes"})
    proc = _drive(fake_slime, path, None)
    assert proc.returncode == 0, proc.stderr
    assert "training with" in proc.stdout


def test_rollout_manager_and_train_actor_validate_on_entry(fake_slime):
    good = argparse.Namespace(**yaml.safe_load(config.build(["dis"]).yaml_text))
    bad = argparse.Namespace(**{**vars(good), "ascend_dis_eps_lo": 0.1})
    code = (
        "import argparse, pickle, sys\n"
        f"good, bad = pickle.loads({__import__('pickle').dumps((good, bad))!r})\n"
        "from slime.utils.http_utils import init_http_client\n"
        "from slime.ray.train_actor import TrainRayActor\n"
        "print(init_http_client(good), TrainRayActor().init(good, 'actor'))\n"
        "from slime_ascend.plugins import runtime\n"
        "for call in (lambda: init_http_client(bad), lambda: TrainRayActor().init(args=bad, role='critic')):\n"
        "    runtime.reset()\n"
        "    try:\n"
        "        call(); print('not refused')\n"
        "    except Exception as e:\n"
        "        print(type(e).__name__, '|', e)\n"
    )
    proc = run_python(code, env=_env(fake_slime, "dis"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "client initialised actor"
    assert len(lines) == 3
    for line in lines[1:]:
        assert line.startswith("SettingsError | unknown setting 'ascend_dis_eps_lo'"), line
        assert "did you mean 'ascend_dis_eps_low'" in line


def test_inert_in_a_process_that_never_imports_slime(fake_slime):
    proc = run_python(
        "import sys; from slime_ascend import _import_hooks; from slime_ascend.startup import bootstrap\n"
        "print(bootstrap.activation_error(), 'slime' in sys.modules, sorted(_import_hooks.pending()))",
        env=_env(fake_slime, "dis"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(" ", 2)[:2] == ["None", "False"]
    assert "slime.utils.arguments" in proc.stdout and "slime.ray.train_actor" in proc.stdout


def test_train_actor_records_its_role_before_validating(fake_slime):
    good = argparse.Namespace(**yaml.safe_load(config.build(["dis"]).yaml_text))
    code = (
        "import pickle\n"
        f"good = pickle.loads({__import__('pickle').dumps(good)!r})\n"
        "from slime.ray.train_actor import TrainRayActor\n"
        "from slime_ascend.plugins import roles, runtime\n"
        "print(roles.train_role())\n"
        "TrainRayActor().init(good, 'critic'); print(roles.train_role())\n"
        "runtime.reset(); print(roles.train_role())\n"
        "TrainRayActor().init(args=good, role='actor'); print(roles.train_role())\n"
    )
    proc = run_python(code, env=_env(fake_slime, "dis"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None", "critic", "None", "actor"]


def test_the_wrappers_are_ledger_patches_that_refuse_a_changed_slime(fake_slime):
    (fake_slime / "site" / "slime" / "utils" / "http_utils.py").write_text("def init_http_client(config):\n    pass\n")
    code = (
        "from slime_ascend import patch\n"
        "import slime.utils.arguments, slime.ray.train_actor\n"
        "print(patch.get('driver.validate_at_parse_args').applied, patch.get('train.validate_at_actor_init').applied)\n"
        "try:\n"
        "    import slime.utils.http_utils\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, '|', e)\n"
    )
    proc = run_python(code, env=_env(fake_slime, "dis"))
    assert proc.returncode == 0, proc.stderr
    applied, refused = proc.stdout.strip().splitlines()
    assert applied == "True True"
    assert refused.startswith("PatchTargetError | runtime patch 'rollout.validate_at_http_client' was not applied")
    assert "takes ['config']" in refused
