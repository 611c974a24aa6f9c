"""The tito hooks (:mod:`slime_ascend.tito.hooks`) with slime-shaped samples (no slime needed)."""

from __future__ import annotations

import types

import pytest
from plugin_args import plugin_args
from tito_fixtures import tokenizer_dir

from slime_ascend import hooks
from slime_ascend.compat.sample import get_sample_class
from slime_ascend.plugins import runtime
from slime_ascend.tito import hooks as tito
from slime_ascend.tito.fingerprint import TitoError, compare_fingerprints, tokenizer_fingerprint
from slime_ascend.tito.plugin import TITO

Sample = get_sample_class()
PLUGINS = {"tito": TITO}


@pytest.fixture(autouse=True)
def _clean(fresh_runtime, monkeypatch):
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    tito.reset_state()
    yield
    tito.reset_state()


def make_args(plugins, **overrides):
    return plugin_args([PLUGINS[name] for name in plugins], **overrides)


def test_tito_passes_untouched_tokens_and_names_the_changed_sample(tmp_path, caplog):
    args = make_args(["tito"], hf_checkpoint=tokenizer_dir(tmp_path / "tok"))
    samples = [hooks.rollout_sample_hook(args, Sample(index=i, tokens=[5, 6, 7, 8 + i], response_length=2))
               for i in range(3)]
    assert samples[0].metadata["ascend_tito"]["tokenizer"].startswith("tok:")
    with caplog.at_level("INFO", logger="slime_ascend.tito"):
        hooks.reward_post_process(types.SimpleNamespace(**{**vars(args), "advantage_estimator": "ppo"}), samples)
    # the check's counts on slime's rollout metric line (no rollout id outside slime's RolloutManager)
    assert ("tito -: {'rollout/tito_checked_samples': 3.0, 'rollout/tito_unrecorded_samples': 0.0}"
            in caplog.messages)
    samples[1].tokens[-1] = 99  # e.g. a re-encode of the response text
    with pytest.raises(TitoError, match=r"sample index=1: token IDs changed after generation"):
        tito.check_samples(args, samples, [0.0] * 3, [0.0] * 3)
    samples[1].tokens[-1] = 9
    samples[2].loss_mask = [1, 1, 1]
    with pytest.raises(TitoError, match="loss_mask has 3 entries"):
        tito.check_samples(args, samples, [0.0] * 3, [0.0] * 3)


def test_tito_requires_the_record_unless_disabled():
    args = make_args(["tito"])
    s = Sample(index=4, tokens=[1, 2], response_length=1)
    with pytest.raises(TitoError, match="no tito record"):
        tito.check_samples(args, [s], [0.0], [0.0])
    runtime.reset()
    tito.check_samples(make_args(["tito"], ascend_tito_require_record=False), [s], [0.0], [0.0])
    runtime.reset()
    s.status = Sample.Status.ABORTED  # aborted samples skip slime's sample hooks
    tito.check_samples(args, [s], [0.0], [0.0])


def test_tito_tokenizer_revisions_compared_with_pin_and_other_side(tmp_path):
    rollout = tokenizer_fingerprint(tokenizer_dir(tmp_path / "r"))
    train = tokenizer_fingerprint(tokenizer_dir(tmp_path / "t", template="{{ changed }}"))
    compare_fingerprints("train", train, None, None)
    with pytest.raises(TitoError, match="chat_template") as e:
        compare_fingerprints("train", train, None, rollout)
    assert rollout["revision"] in str(e.value) and train["revision"] in str(e.value)
    with pytest.raises(TitoError, match="pinned"):
        compare_fingerprints("rollout", rollout, train["revision"], None)
    args = make_args(["tito"], hf_checkpoint=str(tmp_path / "t"), ascend_tito_tokenizer_revision=rollout["revision"])
    with pytest.raises(TitoError, match="train side"):
        hooks.megatron_init(args)
