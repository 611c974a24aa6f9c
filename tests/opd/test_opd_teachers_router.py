"""Teacher config parsing/compatibility and domain routing."""

from __future__ import annotations

import json

import pytest

from slime_ascend.opd.compat import check_teacher_compatible
from slime_ascend.opd.router import DomainRouter, RoutingError
from slime_ascend.opd.teachers import TeacherConfigError, TeacherMismatchError, parse_teachers

RAW = [
    {"name": "math", "checkpoint_dir": "/ckpt/math", "domains": ["math"], "coef": 0.5},
    {"name": "code", "checkpoint_dir": "/ckpt/code", "domains": ["code", "sql"]},
]


def test_parse_roundtrip():
    specs = parse_teachers(RAW)
    assert [s.name for s in specs] == ["math", "code"]
    assert specs[1].domains == ("code", "sql") and specs[1].coef is None
    assert parse_teachers([s.to_dict() for s in specs]) == specs


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"checkpoint_dir": "/x", "domains": ["a"]}, r"teachers\[0\]: field 'name'"),
        ({"name": "t", "domains": ["a"]}, r"teacher 't': field 'checkpoint_dir'"),
        ({"name": "t", "checkpoint_dir": "/x", "domains": []}, r"teacher 't': field 'domains'"),
        ({"name": "t", "checkpoint_dir": "/x", "domains": ["a"], "coef": "big"}, r"teacher 't': field 'coef'"),
        ({"name": "t", "checkpoint_dir": "/x", "domains": ["a"], "coef": -1}, r"field 'coef'.*>= 0"),
        ({"name": "t", "checkpoint_dir": "/x", "domains": ["a"], "vocab_size": 0}, r"field 'vocab_size'"),
        ({"name": "t", "checkpoint_dir": "/x", "domains": ["a"], "ckpt": 1}, r"field 'ckpt': unknown"),
        ({"name": "t", "checkpoint_dir": "/x", "domains": ["a"], "url": "host:1"}, r"field 'url'"),
    ],
)
def test_parse_errors_name_teacher_and_field(entry, match):
    with pytest.raises(TeacherConfigError, match=match):
        parse_teachers([entry])


def test_parse_rejects_duplicates():
    with pytest.raises(TeacherConfigError, match="duplicate teacher name"):
        parse_teachers([RAW[0], RAW[0]])
    with pytest.raises(TeacherConfigError, match="already routed to teacher 'math'"):
        parse_teachers([RAW[0], {"name": "m2", "checkpoint_dir": "/y", "domains": ["math"]}])
    with pytest.raises(TeacherConfigError, match="empty"):
        parse_teachers([])


def _model_dir(path, vocab, tok="tok-A"):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    (path / "tokenizer.json").write_text(tok)
    return path


def test_compatibility_checks(tmp_path):
    student = _model_dir(tmp_path / "student", 100)
    ok = parse_teachers([{"name": "ok", "checkpoint_dir": str(_model_dir(tmp_path / "ok", 100)), "domains": ["a"]}])[0]
    check_teacher_compatible(ok, student_dir=student)
    bad_vocab = parse_teachers([{"name": "bv", "checkpoint_dir": str(_model_dir(tmp_path / "bv", 101)), "domains": ["a"]}])[0]
    with pytest.raises(TeacherMismatchError, match=r"opd teacher 'bv': vocab_size 101 differs from the student's 100"):
        check_teacher_compatible(bad_vocab, student_dir=student)
    bad_tok = parse_teachers(
        [{"name": "bt", "checkpoint_dir": str(_model_dir(tmp_path / "bt", 100, "tok-B")), "domains": ["a"]}]
    )[0]
    with pytest.raises(TeacherMismatchError, match="opd teacher 'bt': tokenizer files:"):
        check_teacher_compatible(bad_tok, student_dir=student)
    rev = parse_teachers([{"name": "r", "checkpoint_dir": "/none", "domains": ["a"], "tokenizer_revision": "v1"}])[0]
    with pytest.raises(TeacherMismatchError, match="tokenizer_revision"):
        check_teacher_compatible(rev, student_tokenizer_revision="v2")
    check_teacher_compatible(rev, student_vocab_size=5)  # nothing known to compare: accepted


def test_router_routes_counts_and_errors():
    specs = parse_teachers(RAW)
    r = DomainRouter(specs)
    assert r.route({"domain": "sql"}).name == "code"
    assert [r.route({"domain": d}).name for d in ("math", "code", "math")] == ["math", "code", "math"]
    assert r.stats() == {"counts": {"code": 2, "math": 2}, "defaulted": 0, "total": 4}
    with pytest.raises(RoutingError, match="domain 'bio' has no teacher"):
        r.route({"domain": "bio"})
    with pytest.raises(RoutingError, match="no 'domain' label"):
        r.route({})
    assert r.coef_for("math") == 0.5 and r.coef_for("code") == 1.0
    r2 = DomainRouter(specs, domain_key="task", default_teacher="code", default_coef=2.0)
    assert r2.route({"task": "bio"}).name == "code" and r2.defaulted_count == 1
    assert r2.route(None).name == "code"
    assert r2.coef_for("code") == 2.0
    with pytest.raises(ValueError, match="default_teacher"):
        DomainRouter(specs, default_teacher="nope")

