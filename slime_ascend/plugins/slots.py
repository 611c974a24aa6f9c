"""slime's hook slots: which slime argument points at which of our dispatchers, and how
several plugins' contributions to one slot compose.

Composition modes:

- ``exclusive``: exactly one plugin may contribute (a second one is a start-up error that names
  both). Used where slime expects one answer (the loss, the generate function).
- ``chain``: contributions run in ascending ``order``; each sees what the previous one produced.
  Two contributions with the same ``order`` in one chain slot are a start-up error: the order of
  non-commuting steps must be declared, never left to plugin load order. A chain may declare a
  ``base_order`` (the advantage chain: 200): contributions below it prepare or compute a plugin's own
  base; at it the dispatcher runs slime's own estimator once when none of them did; contributions
  from it on transform the result.
- ``all``: independent actions (e.g. process init); run in ``(order, plugin name)`` order.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HookSlot:
    name: str
    slime_arg: str | None  # the key on slime's args that holds a dotted path; None: no slime flag
    dispatcher: str  # dotted path (package.module.attr) that slime's load_function can load
    mode: str  # "exclusive" | "chain" | "all"
    process: str  # where slime calls it: driver, rollout (RolloutManager), train (Megatron actor)
    signature: str  # how slime calls the dispatcher (and how a contribution is called)
    repeatable: bool = False  # the slime argument takes a list of paths
    base_order: int | None = None  # chain only: where the dispatcher runs slime's base when no plugin did


_H = "slime_ascend.hooks."

SLOTS: dict[str, HookSlot] = {
    s.name: s
    for s in (
        HookSlot("loss", "custom_loss_function_path", _H + "loss_function", "exclusive", "train",
                 "fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)"),
        HookSlot("loss_term", None, _H + "loss_function", "chain", "train",
                 "fn(args, batch, logits, sum_of_sample_mean) -> (term, metrics) | None; added to the loss "
                 "(the loss slot's, else slime's policy_loss_function) through slime's custom_loss_function_path"),
        HookSlot("advantage", "custom_advantage_function_path", _H + "advantage_function", "chain", "train",
                 "fn(args, rollout_data) -> None; below order 200 may set rollout_data['advantages'] and "
                 "['returns'] (a base); from 200 on they are set (slime's estimator when no base did)",
                 base_order=200),
        HookSlot("tis", "custom_tis_function_path", _H + "tis_function", "chain", "train",
                 "fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, "
                 "response_lengths, **kw) -> (pg_loss, loss_masks, metrics)"),
        HookSlot("generate", "custom_generate_function_path", _H + "generate", "exclusive", "rollout",
                 "async fn(args, sample, sampling_params, evaluation=False) -> Sample | list[Sample]"),
        HookSlot("reward_model", "custom_rm_path", _H + "reward_model", "exclusive", "rollout",
                 "async fn(args, sample, **kwargs) -> float | dict"),
        HookSlot("reward_post_process", "custom_reward_post_process_path", _H + "reward_post_process", "chain",
                 "rollout",
                 "fn(args, samples, raw_rewards, rewards) -> (raw_rewards, rewards); the dispatcher then "
                 "normalises per prompt group counting each rollout once"),
        HookSlot("convert_samples", "custom_convert_samples_to_train_data_path", _H + "convert_samples_to_train_data",
                 "exclusive", "rollout", "fn(args, samples) -> train_data dict (with rollout_ids)"),
        HookSlot("rollout_sample_hook", "rollout_sample_hook_path", _H + "rollout_sample_hook", "chain", "rollout",
                 "fn(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None", repeatable=True),
        HookSlot("rollout_data_postprocess", "rollout_data_postprocess_path", _H + "rollout_data_postprocess",
                 "chain", "train", "fn(args, rollout_id, rollout_data) -> None"),
        HookSlot("megatron_init", "custom_megatron_init_path", _H + "megatron_init", "all", "train",
                 "fn(args) -> None (after mpu init, before model and optimizer)"),
        HookSlot("before_train_step", "custom_megatron_before_train_step_hook_path", _H + "before_train_step", "all",
                 "train", "fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None"),
        HookSlot("before_log_prob", "custom_megatron_before_log_prob_hook_path", _H + "before_log_prob", "all",
                 "train", "fn(args, model, store_prefix) -> None before each forward-only pass (store_prefix '', "
                 "'ref_' or 'teacher_')"),
        HookSlot("quantize_params", None, _H + "quantize_params", "exclusive", "train",
                 "fn(args, megatron_name, converted_named_params, quantization_config, transform_ue8m0=True) "
                 "-> list[(name, tensor)] | None (None: not ours, fall through to slime)"),
    )
}


def get_slot(name: str) -> HookSlot:
    try:
        return SLOTS[name]
    except KeyError:
        raise KeyError(f"unknown hook slot {name!r}; known slots: {', '.join(sorted(SLOTS))}") from None
