"""slime's MTP training (``--enable-mtp-training``) on a stock Megatron-core 0.19.

Two things slime's training loop takes from its own Megatron patch (``docker/patch/latest/megatron.patch``) and the
Megatron it was written against, which a stock Megatron-core 0.19 (the wheel; MindSpeed's Megatron on Ascend)
lacks: the ``mtp_kwargs`` keyword of ``GPTModel.forward``, and the MTP loss tracker's older names.

**The keyword.**
slime's forward step passes ``mtp_kwargs={"mtp_labels": batch["tokens"]}`` to the model
(``megatron_utils/model.py``), a keyword its own Megatron patch adds to ``GPTModel.forward``
(``docker/patch/latest/megatron.patch``): that patch computes the MTP loss from those labels rolled one to the left,
without slime's ``labels`` (slime computes its policy loss from the logits), and detaches what the MTP layers read
from the main model (its hidden states, the next token's embedding, the output layer's weight), so that the MTP
loss trains the MTP layers only. A stock Megatron-core (the wheel; MindSpeed's Megatron on Ascend) stops at the
keyword: ``TypeError: GPTModel.forward() got an unexpected keyword argument 'mtp_kwargs'``.

Megatron-core 0.19 does the rest itself: with ``labels`` None it derives the MTP labels from ``input_ids`` rolled
one to the left (``process_mtp_loss``: "e.g. RL training"), which are slime's ``mtp_labels`` (the batch's tokens are
the model's ``input_ids``), and ``TransformerConfig.mtp_detach_heads`` detaches the same three inputs. So this
patch only accepts the keyword: ``GPTModel.forward`` takes ``mtp_kwargs`` and, after checking that its labels are
the ``input_ids`` (anything else is refused: Megatron would compute the loss of other labels), calls Megatron's
forward without it; and it sets ``mtp_detach_heads`` on the train actor's args before the actor builds its model
(Megatron's ``core_transformer_config_from_args`` copies it into the ``TransformerConfig``). One difference stays: Megatron also clips the MTP layers' gradients as a group of their own
(``grad_norm_group = 'mtp'``), which slime's patch does not.

**The loss mask.** slime's ``loss_mask`` (``batch["full_loss_masks"]``, ``megatron_utils/data.py``) is aligned with
the labels, not the tokens: it is one at position ``t`` where token ``t + 1`` is a response token (the prompt's
length less one zeros on the left, one on the right). Megatron's derivation of the labels from ``input_ids`` (and
slime's own Megatron patch alike) rolls the loss mask one to the left "in lockstep" with that derivation, as for a
mask aligned with the tokens, then once more per MTP layer: the first MTP layer's loss then counts the position
that predicts the prompt's last token and drops the one that predicts the response's last token (one position off
in every sample; measured on the tiny GLM-5: slime's logged MTP loss 1.3136, the twice-rolled positions' mean
cross-entropy recomputed from the same samples 1.3138, the intended positions' 0.373). The patch derives the labels
itself, with Megatron's own ``roll_tensor`` (packed sequences and context parallelism as Megatron rolls them), so
that Megatron takes them as given (its SFT convention, to which slime's mask is aligned) and rolls the mask once per
MTP layer only: the loss counts exactly the positions whose token after next is a response token.

**The tracker.** slime's ``train`` reads the MTP losses of a step from ``MTPLossLoggingHelper.tracker["values"]``
and clears them with ``MTPLossLoggingHelper.clean_loss_in_tracker()``; Megatron-core 0.19 keeps them in
``tracker["loss_values"]`` (beside the MTP head's correct / total next-token counts) and clears them with
``clean_metrics_in_tracker()``, so slime's step stops with ``UnboundLocalError: ... 'mtp_losses'``. The patch makes
``tracker["values"]`` the very tensor ``loss_values`` is (what slime reduces and scales, in place, is Megatron's
own accumulation) and gives the helper ``clean_loss_in_tracker`` as Megatron's clean-up.

Upstream: patches/megatron/megatron-mtp-training.md (Megatron's ``GPTModel.forward`` to accept slime's ``mtp_kwargs``,
or slime to pass nothing where Megatron derives the labels itself).
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source

GPT = "megatron.core.models.gpt.gpt_model"
MTP = "megatron.core.transformer.multi_token_prediction"


def forward_takes_mtp_kwargs(modules: dict[str, ModuleType] | None = None) -> bool:
    gpt = (modules or {}).get(GPT)
    if gpt is None:
        import importlib

        gpt = importlib.import_module(GPT)
    return "mtp_kwargs" in inspect.signature(gpt.GPTModel.forward).parameters


def wanted(args: Any) -> bool:
    """slime trains MTP layers and Megatron's ``GPTModel.forward`` has no ``mtp_kwargs`` (no slime Megatron patch)."""
    return bool(getattr(args, "enable_mtp_training", False)) and not forward_takes_mtp_kwargs()


class MTPLabelsError(ValueError):
    pass


def without_mtp_kwargs(original):
    """``GPTModel.forward`` that accepts slime's ``mtp_kwargs`` (labels equal to ``input_ids``) and drops it."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, mtp_kwargs=None, **kwargs):
        labels = (mtp_kwargs or {}).get("mtp_labels")
        if labels is not None:
            bound = signature.bind(self, *args, **kwargs)
            input_ids = bound.arguments.get("input_ids")
            import torch

            if input_ids is None or labels.shape != input_ids.shape or not torch.equal(labels, input_ids):
                raise MTPLabelsError(
                    "train.mtp_training: slime's mtp_labels are not the model's input_ids; a stock Megatron-core "
                    "derives the MTP labels from input_ids and cannot take others. Fix: apply slime's Megatron "
                    "patch (docker/patch/latest/megatron.patch)")
        return original(self, *args, **kwargs)

    return forward


def with_labels_from_input_ids(original, roll_tensor):
    """``process_mtp_loss`` that, called without ``labels`` (slime's RL forward), derives them from ``input_ids``
    itself (``label[i] = input_id[i + 1]``, rolled by Megatron's ``roll_tensor``) and passes them, so that Megatron
    does not roll slime's label-aligned loss mask an extra time (the module docstring)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def process_mtp_loss(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        if arguments.get("labels") is None and arguments.get("input_ids") is not None:
            arguments["labels"], _ = roll_tensor(arguments["input_ids"], shifts=-1, dims=-1,
                                                 cp_group=arguments.get("cp_group"),
                                                 packed_seq_params=arguments.get("packed_seq_params"))
        return original(*bound.args, **bound.kwargs)

    return process_mtp_loss


def with_slime_tracker_key(original, tracker: dict):
    """``MTPLossLoggingHelper.save_metrics_to_tracker`` that leaves ``tracker["values"]`` naming the tensor
    ``tracker["loss_values"]`` is (slime's key for the MTP losses); ``tracker`` is the helper's own dict (Megatron
    fills and clears it in place)."""

    @functools.wraps(original)
    def save_metrics_to_tracker(*args, **kwargs):
        result = original(*args, **kwargs)
        if "loss_values" in tracker:
            tracker["values"] = tracker["loss_values"]
        return result

    return staticmethod(save_metrics_to_tracker)


class MTPTraining(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        gpt, mtp = modules.get(GPT), modules.get(MTP)
        problems: list[str] = []
        if gpt is not None:
            problems += missing_attrs(gpt, ["GPTModel.forward", "process_mtp_loss"])
            if not problems and forward_takes_mtp_kwargs(modules):
                problems.append("GPTModel.forward already takes mtp_kwargs (slime's Megatron patch is applied): "
                                "drop this patch")
        if mtp is not None:
            found = missing_attrs(mtp, ["process_mtp_loss", "MTPLossLoggingHelper.save_metrics_to_tracker",
                                        "MTPLossLoggingHelper.clean_metrics_in_tracker"])
            problems += found
            if not found:  # what this patch leaves to Megatron: labels from input_ids, detached heads
                problems += missing_source(mtp.process_mtp_loss, ["if labels is None:", "input_ids",
                                                                  "config.mtp_detach_heads",
                                                                  "if derived_labels_from_input_ids:"],
                                           "process_mtp_loss")
                problems += missing_attrs(mtp, ["roll_tensor"])
                params = inspect.signature(mtp.process_mtp_loss).parameters
                problems += [f"process_mtp_loss has no parameter {name!r}" for name in
                             ("labels", "input_ids", "cp_group", "packed_seq_params") if name not in params]
                helper = mtp.MTPLossLoggingHelper
                problems += missing_source(helper.save_metrics_to_tracker, ['tracker["loss_values"]'],
                                           "MTPLossLoggingHelper.save_metrics_to_tracker")
                if hasattr(helper, "clean_loss_in_tracker"):
                    problems.append("MTPLossLoggingHelper already has clean_loss_in_tracker (the Megatron slime "
                                    "was written for): drop this patch's tracker part")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[GPT].GPTModel, "forward", without_mtp_kwargs)
        # GPTModel._postprocess calls the name gpt_model imported
        self.wrap(modules[GPT], "process_mtp_loss",
                  functools.partial(with_labels_from_input_ids, roll_tensor=modules[MTP].roll_tensor))
        helper = modules[MTP].MTPLossLoggingHelper
        self.replace(helper, "save_metrics_to_tracker",
                     with_slime_tracker_key(helper.__dict__["save_metrics_to_tracker"].__func__, helper.tracker))
        self.replace(helper, "clean_loss_in_tracker", helper.__dict__["clean_metrics_in_tracker"])
        # slime's patch detaches the MTP layers' inputs from the main model; Megatron's field of that meaning, read
        # from slime's args when the train actor builds its TransformerConfig (after this patch, at the train moment)
        if args is not None and not getattr(args, "mtp_detach_heads", False):
            args.mtp_detach_heads = True


PATCH = MTPTraining(
    id="train.mtp_training",
    targets=(f"{GPT}:GPTModel.forward", f"{GPT}:process_mtp_loss", f"{MTP}:process_mtp_loss",
             f"{MTP}:MTPLossLoggingHelper"),
    why="slime's forward step passes mtp_kwargs (its MTP labels) to GPTModel.forward, a keyword only slime's "
        "Megatron patch adds, and reads the MTP losses under the tracker's older names: --enable-mtp-training "
        "stops with a TypeError (then an UnboundLocalError) on a stock Megatron-core 0.19; and Megatron's labels "
        "from input_ids roll slime's label-aligned loss mask once too often (the MTP loss one position off).",
    how="Wrap GPTModel.forward: accept mtp_kwargs, check its labels are the input_ids (from which Megatron-core "
        "0.19 derives the MTP labels itself when labels is None) and drop it; process_mtp_loss gets those labels "
        "derived before the call (Megatron's roll_tensor), so that slime's label-aligned loss mask is not rolled an "
        "extra time (one position off per sample otherwise, as with slime's own Megatron patch); "
        "args.mtp_detach_heads set (slime's patch detaches the MTP layers' inputs); MTPLossLoggingHelper keeps tracker['values'] as its loss_values and "
        "gets clean_loss_in_tracker (its clean_metrics_in_tracker).",
    upstream="patches/megatron/megatron-mtp-training.md",
    checked_on=("0.3.1",),
)
