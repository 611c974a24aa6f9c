"""``slime-ascend tito-fingerprint`` (:mod:`slime_ascend.tito.cli`)."""

from __future__ import annotations

from tito_fixtures import tokenizer_dir

from slime_ascend.tito.fingerprint import tokenizer_fingerprint


def test_tito_fingerprint_command_prints_the_revision_to_pin(tmp_path, capsys):
    from slime_ascend import cli

    path = tokenizer_dir(tmp_path / "a")
    assert cli.main(["tito-fingerprint", path]) == 0
    assert capsys.readouterr().out.strip() == tokenizer_fingerprint(path)["revision"]
    assert cli.main(["tito-fingerprint", str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err
