"""Teacher/student compatibility at start (``slime_ascend.opd.compat``): tiny tokenizers made on the fly.

A teacher is refused, naming it and the field, when its vocab size, special token ids, tokenizer (merges)
or chat template differ from the student's; ``warn`` logs and starts, ``off`` reads nothing. Then the same
through the plugin's real validation (``runtime.settings`` -> ``opd`` validate) and the teacher pool. Teachers
known only by their URL: test_opd_compat_remote.py.
"""

from __future__ import annotations

import json
import logging
import shutil
import types
from pathlib import Path

import pytest

from slime_ascend.opd import compat
from slime_ascend.opd.plugin import PLUGIN
from slime_ascend.opd.compat import check_teacher_compatible
from slime_ascend.opd.teachers import TeacherMismatchError, parse_teachers
from slime_ascend.plugins.settings import SettingsError

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

VOCAB = 300


TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def make_checkpoint(path: Path, *, vocab_size: int = VOCAB, eos: str = "</s>", template: str | None = TEMPLATE,
                    merges: tuple = (), template_file: bool = False, extra_config: dict | None = None) -> Path:
    """config.json + a byte-level BPE tokenizer (ids 0-3 specials, then the 256 bytes, then 'ab')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<|end|>"])}
    for sym in sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord):
        vocab[sym] = len(vocab)
    vocab["ab"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token=eos)
    tok.save_pretrained(str(path))
    if template is not None:
        if template_file:
            (path / "chat_template.jinja").write_text(template)
        else:
            cfg = json.loads((path / "tokenizer_config.json").read_text())
            cfg["chat_template"] = template
            cfg.update(extra_config or {})
            (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size, "model_type": "qwen3"}))
    return path


@pytest.fixture(autouse=True)
def _clean():
    compat.clear_cache()
    yield
    compat.clear_cache()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "student": make_checkpoint(root / "student"),
        "same": make_checkpoint(root / "same"),
        "vocab": make_checkpoint(root / "vocab", vocab_size=VOCAB + 64),
        "eos": make_checkpoint(root / "eos", eos="<|end|>"),
        "template": make_checkpoint(root / "template", template=TEMPLATE.replace(": ", "\n")),
        "merges": make_checkpoint(root / "merges", merges=(("a", "b"),)),
        # stored elsewhere / saved with other unrelated keys: the same tokenizer and template
        "jinja": make_checkpoint(root / "jinja", template_file=True),
        "noise": make_checkpoint(root / "noise", extra_config={"model_max_length": 4096}),
    }


def teacher(name: str, ckpt, **extra):
    return parse_teachers([{"name": name, "checkpoint_dir": str(ckpt), "domains": [name], **extra}])[0]


# ---------------------------------------------------------------------------------------------- fingerprint
def test_fingerprint_fields(ckpts):
    fp = compat.fingerprint_dir(ckpts["student"])
    assert fp.vocab_size == VOCAB and fp.tokenizer_len == 261
    assert (fp.bos_token, fp.eos_token, fp.pad_token, fp.unk_token) == ((1, "<s>"), (2, "</s>"), (0, "<pad>"), None)
    assert fp.special_tokens == ((0, "<pad>"), (1, "<s>"), (2, "</s>"))
    assert fp.tokenizer.startswith("enc:") and fp.chat_template.startswith("tpl:") and fp.chat_template != "tpl:none"
    # the tito revision (`slime-ascend tito-fingerprint`) is carried for declared tokenizer_revision values
    from slime_ascend.tito.fingerprint import tokenizer_fingerprint

    assert fp.revision == tokenizer_fingerprint(str(ckpts["student"]))["revision"]
    assert not fp.unknown


def test_same_tokenizer_passes(ckpts):
    for name in ("same", "jinja", "noise"):  # template file vs tokenizer_config, unrelated config keys
        reports = compat.check_teachers([teacher(name, ckpts[name])], ckpts["student"])
        assert reports[0].ok and not reports[0].unchecked, (name, reports[0])


@pytest.mark.parametrize(("name", "field", "needle"), [
    ("vocab", "vocab_size", f"vocab_size {VOCAB + 64} differs from the student's {VOCAB} (--hf-checkpoint"),
    ("eos", "eos_token", "eos_token 3 '<|end|>' differs from the student's 2 '</s>'"),
    ("template", "chat_template", "chat_template tpl:"),
    ("merges", "tokenizer", "tokenizer enc:"),
])
def test_mismatch_refused_naming_teacher_and_field(ckpts, name, field, needle):
    spec = teacher("code", ckpts[name])
    with pytest.raises(TeacherMismatchError) as e:
        compat.check_teachers([spec], ckpts["student"])
    msg = str(e.value)
    assert msg.startswith(f"opd teacher 'code': {field} "), msg
    assert needle in msg and "\n" not in msg
    assert "Fix:" in msg and "compat_check: warn" in msg and "ascend_opd_compat_check: warn" in msg
    report = compat.compare("code", compat.fingerprint_dir(ckpts["student"]), compat.fingerprint_dir(ckpts[name]))
    assert report.mismatches[0].field == field and report.mismatches[0].teacher == "code"
    if name in ("merges", "template", "vocab"):  # exactly that field
        assert [m.field for m in report.mismatches] == [field], report.mismatches


def test_declared_vocab_size_and_revision(ckpts):
    absent = {"checkpoint_dir": "/nonexistent/t"}
    with pytest.raises(TeacherMismatchError, match=r"opd teacher 't': vocab_size 151936 differs from the student's 300"):
        compat.check_teachers([teacher("t", absent["checkpoint_dir"], vocab_size=151936)], ckpts["student"])
    with pytest.raises(TeacherMismatchError, match="opd teacher 't': tokenizer_revision v1 differs"):
        compat.check_teachers([teacher("t", absent["checkpoint_dir"], tokenizer_revision="v1")], ckpts["student"])
    rev = compat.fingerprint_dir(ckpts["student"]).revision
    (report,) = compat.check_teachers([teacher("t", absent["checkpoint_dir"], tokenizer_revision=rev,
                                               vocab_size=VOCAB)], ckpts["student"])
    assert report.ok and "tokenizer" in report.unchecked and "vocab_size" not in report.unchecked


def test_warn_logs_and_passes_off_skips(ckpts, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="slime_ascend.opd")
    (report,) = compat.check_teachers([teacher("code", ckpts["eos"])], ckpts["student"], mode="warn")
    assert [m.field for m in report.mismatches][:1] == ["eos_token"]
    assert any("opd teacher 'code': eos_token" in r.message and "starting anyway" in r.message for r in caplog.records)
    # the teacher's own compat_check overrides the global mode, both ways
    compat.check_teachers([teacher("code", ckpts["eos"], compat_check="warn")], ckpts["student"], mode="strict")
    with pytest.raises(TeacherMismatchError, match="opd teacher 'code'"):
        compat.check_teachers([teacher("code", ckpts["eos"], compat_check="strict")], ckpts["student"], mode="warn")
    # off reads nothing at all
    caplog.clear()
    monkeypatch.setattr(compat, "fingerprint_dir", lambda *a: pytest.fail("off must not read"))
    assert compat.check_teachers([teacher("code", ckpts["eos"])], ckpts["student"], mode="off") == []
    assert compat.check_teachers([teacher("code", ckpts["eos"], compat_check="off")], ckpts["student"]) == []
    assert not caplog.records
    with pytest.raises(Exception, match="compat_check"):
        teacher("code", ckpts["eos"], compat_check="loose")


def test_several_teachers_one_line(ckpts):
    specs = [teacher("math", ckpts["same"]), teacher("code", ckpts["vocab"]), teacher("chat", ckpts["template"])]
    with pytest.raises(TeacherMismatchError) as e:
        compat.check_teachers(specs, ckpts["student"])
    msg = str(e.value)
    assert "\n" not in msg and "'math'" not in msg.split("Fix:")[0]
    assert "opd teacher 'code': vocab_size" in msg and "opd teacher 'chat': chat_template" in msg
    assert "('code', 'chat')" in msg or "'code', 'chat'" in msg


def test_unloadable_tokenizer_compared_by_files(tmp_path, ckpts, caplog):
    """A tokenizer transformers cannot load: its files are compared (tito's hash), the rest is 'not checked'."""
    caplog.set_level(logging.WARNING, logger="slime_ascend.opd")
    student = tmp_path / "s"
    student.mkdir()
    (student / "config.json").write_text(json.dumps({"vocab_size": 100}))
    (student / "tokenizer.json").write_text("tok-A")
    same = shutil.copytree(student, tmp_path / "t")
    (report,) = compat.check_teachers([teacher("t", same)], student)
    assert report.ok and report.unchecked.keys() >= {"tokenizer_len", "eos_token", "special_tokens"}
    assert any("opd teacher 't': not checked against the student: tokenizer_len" in r.message for r in caplog.records)
    (same / "tokenizer.json").write_text("tok-B")
    compat.clear_cache()
    with pytest.raises(TeacherMismatchError, match="opd teacher 't': tokenizer files:"):
        compat.check_teachers([teacher("t", same)], student)


def test_student_unknown_checks_nothing(ckpts, caplog):
    caplog.set_level(logging.WARNING, logger="slime_ascend.opd")
    assert compat.check_teachers([teacher("code", ckpts["vocab"])], None) == []
    assert any("compatibility not checked" in r.message and "--hf-checkpoint is not set" in r.message
               for r in caplog.records)


def test_check_teacher_compatible_and_pool_follow_the_mode(ckpts):
    spec = teacher("code", ckpts["vocab"])
    with pytest.raises(TeacherMismatchError, match="vocab_size"):
        check_teacher_compatible(spec, student_dir=ckpts["student"])
    check_teacher_compatible(spec, student_dir=ckpts["student"], mode="warn")
    check_teacher_compatible(spec, student_dir=ckpts["student"], mode="off")


# ---------------------------------------------------------------------------------------------- plugin
def make_args(**overrides):
    values = {s.key: s.default for s in PLUGIN.settings}
    values.update(dict(PLUGIN.slime_args))
    values.update(ascend_plugins=["opd"], opd_teacher_load=None, rollout_temperature=1.0,
                  use_rollout_logprobs=False, hf_checkpoint=None)
    values.update(overrides)
    return types.SimpleNamespace(**values)


def test_plugin_validation_refuses_a_mismatched_teacher(ckpts, opd_state, caplog):
    from slime_ascend.plugins import runtime

    teachers = [{"name": "math", "checkpoint_dir": str(ckpts["same"]), "domains": ["math"], "url": "http://127.0.0.1:1"},
                {"name": "code", "checkpoint_dir": str(ckpts["vocab"]), "domains": ["code"], "url": "http://127.0.0.1:1"}]
    args = make_args(ascend_opd_teachers=teachers, hf_checkpoint=str(ckpts["student"]))
    with pytest.raises(SettingsError) as e:
        runtime.settings(args, "opd")
    assert str(e.value).startswith(
        f"opd teacher 'code': vocab_size {VOCAB + 64} differs from the student's {VOCAB} (--hf-checkpoint")
    # warn: starts, with the mismatch in the log
    caplog.set_level(logging.WARNING, logger="slime_ascend.opd")
    args = make_args(ascend_opd_teachers=teachers, hf_checkpoint=str(ckpts["student"]), ascend_opd_compat_check="warn")
    assert runtime.settings(args, "opd")["ascend_opd_compat_check"] == "warn"
    assert any("opd teacher 'code': vocab_size" in r.message for r in caplog.records)
    # per teacher
    teachers[1]["compat_check"] = "off"
    runtime.settings(make_args(ascend_opd_teachers=teachers, hf_checkpoint=str(ckpts["student"])), "opd")


def test_train_actors_do_not_check(ckpts, opd_state, monkeypatch):
    """Train actors never ask a teacher: the check runs in the driver and the rollout manager only."""
    from slime_ascend.plugins import roles, runtime

    teachers = [{"name": "code", "checkpoint_dir": str(ckpts["vocab"]), "domains": ["code"], "url": "http://127.0.0.1:1"}]
    roles.set_train_role("actor")
    monkeypatch.setattr(compat, "check_teachers", lambda *a, **k: pytest.fail("checked in a train actor"))
    runtime.settings(make_args(ascend_opd_teachers=teachers, hf_checkpoint=str(ckpts["student"])), "opd")


def test_config_documents_the_setting():
    from slime_ascend import config

    text = config.build(["opd"]).yaml_text
    assert "ascend_opd_compat_check: strict" in text
    assert "'strict' (a mismatch refuses to start), 'warn' (log it and start), 'off' (skip)" in text
    assert "url?, compat_check?}" in text
