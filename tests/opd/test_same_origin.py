"""Same-origin KL check flags a teacher whose initial KL is far above the others'."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from slime_ascend.opd.same_origin import per_token_kl, report_from_kls


def _case(seed=0, n=4, L=20, V=12):
    g = torch.Generator().manual_seed(seed)
    student_logits = torch.randn(n, L, V, generator=g)
    seqs = torch.distributions.Categorical(logits=student_logits).sample()
    s_lp = torch.log_softmax(student_logits, -1).gather(-1, seqs[..., None])[..., 0]

    def scorer_for(noise):
        t_logits = student_logits + noise * torch.randn(student_logits.shape, generator=g)
        t_lp = torch.log_softmax(t_logits, -1).gather(-1, seqs[..., None])[..., 0]
        return lambda sequences: [t_lp[i] for i in range(len(sequences))]

    return [s.tolist() for s in seqs], list(s_lp), scorer_for


def same_origin_report(scorers, seqs, s_lp, masks=None, **kw):
    """Each teacher's masked mean k3 KL over the sequences (as the opd hooks measure it), then the report."""
    kls, tokens = {}, {}
    for name, scorer in scorers.items():
        t_lp = scorer(seqs)
        mask = torch.cat(masks) if masks is not None else torch.ones(sum(len(s) for s in seqs))
        kl = per_token_kl(torch.cat(s_lp), torch.cat(t_lp), "k3")
        tokens[name] = int(mask.sum())
        kls[name] = float((kl * mask).sum()) / max(tokens[name], 1)
    return report_from_kls(kls, tokens, **kw)


def test_per_token_kl_reference():
    s = torch.tensor([-1.0, -2.0, -0.5])
    t = torch.tensor([-1.5, -1.0, -0.5])
    k1 = per_token_kl(s, t, "k1")
    k3 = per_token_kl(s, t, "k3")
    for i in range(3):
        r = math.exp(float(t[i] - s[i]))
        assert float(k1[i]) == pytest.approx(float(s[i] - t[i]))
        assert float(k3[i]) == pytest.approx(r - 1 - math.log(r), abs=1e-6)
    with pytest.raises(ValueError, match="estimator"):
        per_token_kl(s, t, "k2")


def test_foreign_teacher_flagged(caplog):
    seqs, s_lp, scorer_for = _case()
    scorers = {"math": scorer_for(0.3), "code": scorer_for(0.35), "chat": scorer_for(0.3), "foreign": scorer_for(1.5)}
    with caplog.at_level(logging.WARNING):
        rep = same_origin_report(scorers, seqs, s_lp)
    assert rep.flagged == ["foreign"]
    assert rep.teachers["foreign"].ratio > 3 and rep.teachers["math"].ratio < 3
    assert "foreign" in caplog.text and rep.to_dict()["flagged"] == ["foreign"]


def test_two_teachers_and_threshold_and_masks():
    seqs, s_lp, scorer_for = _case(1)
    scorers = {"a": scorer_for(0.3), "b": scorer_for(1.5)}
    rep = same_origin_report(scorers, seqs, s_lp, warn=False)
    assert rep.flagged == ["b"]
    rep = same_origin_report(scorers, seqs, s_lp, threshold_ratio=1e6, warn=False)
    assert rep.flagged == []
    masks = [torch.zeros(len(s)) for s in seqs]
    rep = same_origin_report({"a": scorer_for(0.3)}, seqs, s_lp, masks, max_kl=0.1, warn=False)
    assert rep.teachers["a"].tokens == 0 and rep.teachers["a"].ratio is None and not rep.flagged
    rep = same_origin_report({"a": scorer_for(2.0)}, seqs, s_lp, max_kl=0.01, warn=False)
    assert rep.flagged == ["a"]
    with pytest.raises(ValueError, match="threshold_ratio must be > 1"):
        report_from_kls({"a": 0.1}, threshold_ratio=1.0)
