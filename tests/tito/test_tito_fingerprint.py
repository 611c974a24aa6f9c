"""Token digests and tokenizer fingerprints (:mod:`slime_ascend.tito.fingerprint`)."""

from __future__ import annotations

import pytest
from tito_fixtures import tokenizer_dir

from slime_ascend.tito.fingerprint import TitoError, tokenizer_fingerprint


def test_tokenizer_fingerprint_separates_vocab_and_template(tmp_path):
    a = tokenizer_fingerprint(tokenizer_dir(tmp_path / "a"))
    b = tokenizer_fingerprint(tokenizer_dir(tmp_path / "b", template="{{ other }}"))
    c = tokenizer_fingerprint(tokenizer_dir(tmp_path / "c", vocab={"a": 0, "c": 1}))
    same = tokenizer_fingerprint(tokenizer_dir(tmp_path / "d"))
    assert a["revision"] == same["revision"]
    assert a["tokenizer"] == b["tokenizer"] and a["chat_template"] != b["chat_template"]
    assert a["tokenizer"] != c["tokenizer"] and a["chat_template"] == c["chat_template"]
    with pytest.raises(TitoError, match="no tokenizer files"):
        tokenizer_fingerprint(str(tmp_path))
