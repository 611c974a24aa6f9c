"""``train.mtp_layer_name`` and ``train.mtp_training``: slime's MTP training on a stock Megatron-core 0.19 (the
wheel CI installs). Their targets look as the patches expect; the name walk gives slime's spelling; the forward
accepts slime's ``mtp_kwargs`` only when its labels are the input ids; the MTP loss counts the positions slime's
loss mask means (Megatron's own ``process_mtp_loss`` run on a sample); the tracker answers under slime's key. The
whole path runs in slime's loop in ``tests/e2e/test_slime_glm5_mtp_cpu.py``."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from conftest import need

need("megatron.core")

from slime_ascend.patch import get  # noqa: E402
from slime_ascend.patch.train import mtp_layer_name, mtp_training  # noqa: E402


def test_slime_spelling_renames_only_an_mtp_layers_decoder_layer():
    cases = {
        "module.module.mtp.layers.0.mtp_model_layer.self_attention.linear_proj.weight":
            "module.module.mtp.layers.0.transformer_layer.self_attention.linear_proj.weight",
        "mtp.layers.1.mtp_model_layer.mlp.experts.linear_fc1.weight3":
            "mtp.layers.1.transformer_layer.mlp.experts.linear_fc1.weight3",
        "module.module.mtp.layers.0.eh_proj.weight": "module.module.mtp.layers.0.eh_proj.weight",
        "module.module.decoder.layers.0.mtp_model_layer.weight": "module.module.decoder.layers.0.mtp_model_layer.weight",
    }
    for name, want in cases.items():
        assert mtp_layer_name.slime_spelling(name) == want


def test_the_wrapped_chunk_gives_slimes_names_and_the_chunks_own_attributes():
    chunk = torch.nn.Module()
    chunk.mtp = torch.nn.Module()
    chunk.mtp.layers = torch.nn.ModuleList([torch.nn.Module()])
    chunk.mtp.layers[0].mtp_model_layer = torch.nn.Linear(2, 2)
    chunk.mtp.layers[0].mtp_model_layer.register_buffer("expert_bias", torch.zeros(2))
    chunk.config = "the chunk's config"
    spelled = mtp_layer_name.SlimeSpelledModule(chunk)
    assert [n for n, _ in spelled.named_parameters()] == ["mtp.layers.0.transformer_layer.weight",
                                                          "mtp.layers.0.transformer_layer.bias"]
    assert [n for n, _ in spelled.named_buffers()] == ["mtp.layers.0.transformer_layer.expert_bias"]
    assert spelled.config == "the chunk's config"


def test_both_patches_find_their_targets_as_expected():
    for patch_id in ("train.mtp_layer_name", "train.mtp_training"):
        assert get(patch_id).verify() == [], patch_id
    assert mtp_layer_name.megatron_has_new_name()
    assert not mtp_training.forward_takes_mtp_kwargs()


def test_wanted_only_for_jobs_with_mtp():
    args = types.SimpleNamespace(mtp_num_layers=None, enable_mtp_training=False)
    assert not mtp_layer_name.wanted(args) and not mtp_training.wanted(args)
    args = types.SimpleNamespace(mtp_num_layers=1, enable_mtp_training=True)
    assert mtp_layer_name.wanted(args) and mtp_training.wanted(args)


def test_the_forward_takes_mtp_kwargs_whose_labels_are_the_input_ids():
    calls = []

    def forward(self, input_ids, position_ids, attention_mask, labels=None):
        calls.append((input_ids, labels))
        return "logits"

    wrapped = mtp_training.without_mtp_kwargs(forward)
    ids = torch.tensor([[3, 4, 5]])
    assert wrapped(None, ids, None, None, mtp_kwargs={"mtp_labels": ids.clone()}) == "logits"
    assert calls[-1][1] is None  # Megatron derives the MTP labels from input_ids itself
    assert wrapped(None, input_ids=ids, position_ids=None, attention_mask=None) == "logits"
    with pytest.raises(mtp_training.MTPLabelsError, match="not the model's input_ids"):
        wrapped(None, ids, None, None, mtp_kwargs={"mtp_labels": ids + 1})


def test_the_tracker_answers_under_slimes_key_and_cleans_with_slimes_name():
    patch = get("train.mtp_training")
    mtp = importlib.import_module(mtp_training.MTP)
    helper = mtp.MTPLossLoggingHelper
    args = types.SimpleNamespace(enable_mtp_training=True)
    gpt = importlib.import_module(mtp_training.GPT)
    patch.install(args)
    try:
        assert args.mtp_detach_heads is True
        assert gpt.process_mtp_loss is not mtp.process_mtp_loss  # the labels derived before Megatron's call
        helper.tracker.clear()
        for key in ("loss_values", "correct_values", "total_values"):  # made on the CUDA device otherwise
            helper.tracker[key] = torch.zeros(2)
        for layer in (0, 0, 1):
            helper.save_metrics_to_tracker(torch.tensor(2.0), torch.tensor(1.0), torch.tensor(4.0), layer, 2)
        assert helper.tracker["values"] is helper.tracker["loss_values"]
        assert helper.tracker["values"].tolist() == [4.0, 2.0]
        helper.clean_loss_in_tracker()
        assert helper.tracker["values"].tolist() == [0.0, 0.0]
    finally:
        patch.remove()
        helper.tracker.clear()
    assert not hasattr(helper, "clean_loss_in_tracker")  # removed whole
    assert gpt.process_mtp_loss is mtp.process_mtp_loss


def _counted_positions(process_mtp_loss, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> list[int]:
    """The positions whose MTP loss Megatron's ``process_mtp_loss`` (one MTP layer, called as ``GPTModel`` calls it in
    slime's RL forward: ``labels`` None) counts, read from the gradient each position's loss gets; and the labels it
    scored them against."""
    seq = input_ids.shape[-1]
    hidden = torch.zeros(2 * seq, 1, 1, requires_grad=True)  # [main | MTP layer] rows, as Megatron concatenates them
    per_token = torch.zeros(1, seq, requires_grad=True)
    seen = {}

    def compute_language_model_loss(labels, logits):
        seen["labels"] = labels.clone()
        return per_token

    config = types.SimpleNamespace(mtp_num_layers=1, mtp_detach_heads=False, mtp_loss_scaling_factor=1.0,
                                   calculate_per_token_loss=False)
    out = process_mtp_loss(hidden_states=hidden, labels=None, loss_mask=loss_mask, output_layer=lambda h, **_: (h, None),
                           output_weight=None, runtime_gather_output=None, is_training=False,
                           compute_language_model_loss=compute_language_model_loss, config=config,
                           input_ids=input_ids)
    out.sum().backward()
    return torch.nonzero(per_token.grad[0]).flatten().tolist(), seen["labels"]


def test_the_mtp_loss_counts_the_positions_whose_token_after_next_is_a_response_token():
    """slime's loss mask is aligned with the labels (one where token t + 1 is a response token:
    ``megatron_utils/data.py`` pads the prompt's length less one on the left, one on the right); Megatron's labels
    from input_ids roll it once too often: the MTP loss counts the position that predicts the prompt's last token and
    drops the one that predicts the response's last token. Through the patch: exactly the positions t whose token
    t + 2 is a response token, scored against token t + 2."""
    mtp = importlib.import_module(mtp_training.MTP)
    prompt, response = 4, 5
    tokens = torch.arange(10, 10 + prompt + response).unsqueeze(0)
    mask = torch.tensor([[0] * (prompt - 1) + [1] * response + [0]])  # slime's full_loss_masks of one sample
    want = [t for t in range(prompt + response - 2) if t + 2 >= prompt]  # token t + 2 in the response
    stock, _ = _counted_positions(mtp.process_mtp_loss, tokens, mask)
    assert stock == [t - 1 for t in want]  # one off: predicts token 3 (the prompt's), never token 8
    patched = mtp_training.with_labels_from_input_ids(mtp.process_mtp_loss, mtp.roll_tensor)
    counted, labels = _counted_positions(patched, tokens, mask)
    assert counted == want
    assert [int(labels[0, t]) for t in counted] == [int(tokens[0, t + 2]) for t in want]
