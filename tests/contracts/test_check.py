"""`slime-ascend check` engine: contracts reported, JSON/PNG written, injected faults detected."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import need

need("transformers")

from slime_ascend.contracts.check import (  # noqa: E402
    DEFAULT_THRESHOLDS,
    DSA_SHAPE,
    DSA_TOPK_THRESHOLDS,
    INJECTIONS,
    dsa_bf16_agreement,
    fake_quant_int8_per_channel,
    format_table,
    run_check,
)

SMALL_TOPK = (4, 2048, 128)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = tmp_path_factory.mktemp("check")
    rng_before = torch.get_rng_state()
    report = run_check(out_json=str(d / "r.json"), plot=str(d / "r.png"), topk_shape=SMALL_TOPK)
    assert torch.equal(rng_before, torch.get_rng_state())  # caller's RNG untouched
    return report, d


def test_clean_run_passes_with_named_contracts(clean) -> None:
    report, _ = clean
    names = {c.name for c in report.contracts}
    for path, bounds in DEFAULT_THRESHOLDS.items():
        for stat in bounds:
            assert f"{path}_vs_fp32.{stat}" in names
    for name in ("logprobs.finite", "topk.repeat_identical", "topk.threads_identical",
                 "topk.matches_stable_sort", "topk.replay_roundtrip", "topk.device_matches_cpu",
                 "dsa_topk.sharded_merge_identical", "dsa_topk.bf16_vs_fp32.rows_identical_frac",
                 "dsa_topk.bf16_vs_fp32.jaccard_mean", "dsa_topk.device_matches_cpu"):
        assert name in names
    assert report.passed, format_table(report)
    assert report.contract("topk.device_matches_cpu").status == "SKIP"
    assert report.contract("dsa_topk.device_matches_cpu").status == "SKIP"
    assert {"bf16", "int8"} <= report.stats.keys()
    assert report.stats["bf16"]["tokens"] == 4 * 63
    assert 0 < report.stats["bf16"]["logratio_abs_mean"] < 0.03
    assert report.contract("dsa_topk.sharded_merge_identical").value == 1.0
    dsa = report.stats["dsa_topk_bf16"]
    # seed 0 of the calibration (benchmarks/calibrate_dsa_agreement.py): bf16 does move some keys
    assert dsa["rows"] == 512 and DSA_TOPK_THRESHOLDS["rows_identical_frac"] <= dsa["rows_identical_frac"] < 0.95
    assert 0.9 < dsa["jaccard_min"] <= dsa["jaccard_mean"] < 0.999
    assert dsa["jaccard_mean"] >= DSA_TOPK_THRESHOLDS["jaccard_mean"]


def test_json_and_plot_written(clean) -> None:
    report, d = clean
    data = json.loads((d / "r.json").read_text())
    assert data["passed"] is True
    assert [c["name"] for c in data["contracts"]] == [c.name for c in report.contracts]
    assert {c["status"] for c in data["contracts"]} <= {"PASS", "FAIL", "SKIP"}
    assert (d / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_format_table(clean) -> None:
    report, _ = clean
    text = format_table(report)
    assert "bf16_vs_fp32.logratio_abs_mean" in text and "<= 0.03" in text
    assert text.splitlines()[-1].startswith("ALL PASS")


def test_same_seed_same_numbers(clean) -> None:
    report, _ = clean
    again = run_check(topk_shape=SMALL_TOPK)
    assert again.stats == report.stats


@pytest.mark.parametrize(
    "inject, must_fail",
    [
        ("logprob_noise", "bf16_vs_fp32.logratio_abs_mean"),
        ("logprob_nan", "logprobs.finite"),
        ("topk_unstable", "topk.repeat_identical"),
        ("dsa_merge_unstable", "dsa_topk.sharded_merge_identical"),
        ("dsa_bf16_noise", "dsa_topk.bf16_vs_fp32.jaccard_mean"),
    ],
)
def test_injected_fault_is_reported(inject: str, must_fail: str) -> None:
    assert inject in INJECTIONS
    report = run_check(inject=inject, topk_shape=SMALL_TOPK)
    assert not report.passed
    assert report.contract(must_fail).status == "FAIL"
    assert "FAIL" in format_table(report).splitlines()[-1]


def test_dsa_injected_fault_fails_both_statistics() -> None:
    """The perturbed-score fault (``dsa_bf16_noise``: N(0, (0.005 std)^2), smaller than one bf16 step) fails both
    bf16-vs-fp32 bounds, not only one of them."""
    report = run_check(inject="dsa_bf16_noise", topk_shape=SMALL_TOPK)
    for stat in ("rows_identical_frac", "jaccard_mean"):
        c = report.contract(f"dsa_topk.bf16_vs_fp32.{stat}")
        assert c.status == "FAIL" and c.value < DSA_TOPK_THRESHOLDS[stat], c
    assert report.contract("dsa_topk.sharded_merge_identical").status == "PASS"  # the fault is only in the bf16 path


@pytest.mark.parametrize("seed", [3, 57, 123])
def test_dsa_bounds_separate_bf16_rounding_from_a_perturbed_score(seed: int) -> None:
    """On seeds the calibration covered: bf16 rounding alone stays above both bounds, and the same scores with a
    perturbation smaller than one bf16 step (0.005 std) fall below both (a bound set to pass anything would not
    see it: the former 0.6 / 0.98 passed it). Plain bf16 on CPU, the check's shape."""
    clean = dsa_bf16_agreement(seed, DSA_SHAPE)
    faulty = dsa_bf16_agreement(seed, DSA_SHAPE, score_noise=0.005)
    for stat, bound in DSA_TOPK_THRESHOLDS.items():
        assert clean[stat] >= bound > faulty[stat], (stat, clean[stat], bound, faulty[stat])
    assert faulty["jaccard_mean"] > 0.98 and faulty["rows_identical_frac"] > 0.6  # what the former bounds allowed


def test_tight_threshold_fails() -> None:
    report = run_check(thresholds={"int8": {"logratio_abs_mean": 1e-9}}, topk_shape=SMALL_TOPK)
    assert report.contract("int8_vs_fp32.logratio_abs_mean").status == "FAIL"
    assert report.contract("bf16_vs_fp32.logratio_abs_mean").status == "PASS"


def test_model_dir_safetensors_only(tmp_path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.05)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    report = run_check(model_dir=str(tmp_path / "m"), topk_shape=SMALL_TOPK, seq_len=16)
    assert report.meta["vocab_size"] == 256 and report.passed
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="safetensors"):
        run_check(model_dir=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not a directory"):
        run_check(model_dir=str(tmp_path / "missing"))


def test_dsa_device_comparison_runs_on_the_cpu_too() -> None:
    """The device-vs-CPU DSA comparison (SKIPped on a CPU-only run) itself, with the CPU as the device."""
    from slime_ascend.contracts.check import _dsa_device_matches_cpu, _indexer_logits

    g = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(64, 2, 8, generator=g), torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)
    scores = _indexer_logits(q, k, w)
    grid = torch.round(scores * 2) / 2
    assert (grid[1::2] == 0).any() and torch.isneginf(scores).any()  # zeros (negated: -0.0) and -inf present
    assert _dsa_device_matches_cpu(torch.device("cpu"), scores, 16, [10, 0, 54])


def test_dsa_threshold_override() -> None:
    report = run_check(dsa_thresholds={"rows_identical_frac": 0.999}, topk_shape=SMALL_TOPK, dsa_shape=(128, 4, 16, 16))
    assert report.contract("dsa_topk.bf16_vs_fp32.rows_identical_frac").status == "FAIL"
    assert report.contract("dsa_topk.bf16_vs_fp32.rows_identical_frac").threshold == ">= 0.999"
    assert report.contract("dsa_topk.sharded_merge_identical").status == "PASS"
    with pytest.raises(ValueError, match="unknown statistic"):
        run_check(dsa_thresholds={"jaccard_max": 1.0})


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="inject"):
        run_check(inject="bogus")
    with pytest.raises(ValueError, match="unknown path"):
        run_check(thresholds={"fp8": {}})


def test_fake_quant_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 9, generator=g)
    w[1] = 0.0
    w[2, 3] = -w[2].abs().max() * 2  # the row's amax maps to exactly -127
    w[3] = torch.tensor([1.0, 0.5 / 127 * 1, 1.5 / 127, 2.5 / 127, 0, 0, 0, 0, 0])  # half-way cases
    got = fake_quant_int8_per_channel(w)
    for i in range(w.shape[0]):
        amax = float(w[i].abs().max())
        scale = torch.tensor(amax, dtype=torch.float32) / 127.0
        for j in range(w.shape[1]):
            if amax == 0:
                expect = 0.0
            else:
                q = round(float(torch.tensor(float(w[i, j])) / scale))  # Python round: half to even
                expect = float(max(-127, min(127, q)) * scale)
            assert float(got[i, j]) == expect
    assert float(got[2, 3]) == float(w[2, 3])
    with pytest.raises(ValueError):
        fake_quant_int8_per_channel(torch.zeros(3))
