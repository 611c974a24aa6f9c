"""One dispatcher per slime hook. slime loads these by dotted path (``slime_ascend.hooks.X``).

Each dispatcher validates the enabled plugins against the real ``args`` at first use in its
process, then runs the plugins' contributions for its slot in the declared order (see
:mod:`slime_ascend.plugins.slots`). A plugin never sets a slime hook path itself.
"""

from __future__ import annotations

import inspect
from typing import Any

from .plugins import runtime
from .plugins.registry import PluginError
from .plugins.slots import get_slot


def _entries(args: Any, slot: str) -> tuple[tuple[str, Any], ...]:
    runtime.raise_activation_error()
    return runtime.active(args).selection.slots.get(slot, ())


def _contributions(args: Any, slot: str) -> list[tuple[str, Any]]:
    return [(plugin, contribution.load()) for plugin, contribution in _entries(args, slot)]


def _exclusive(args: Any, slot: str) -> Any:
    entries = _contributions(args, slot)
    if not entries:
        raise PluginError(
            f"slime called slime_ascend.hooks for slot {slot!r}, but no enabled plugin provides it "
            f"(enabled: {', '.join(runtime.enabled_names(args)) or 'none'}). Fix: regenerate the YAML with "
            "`slime-ascend config` for the plugins you enable, or remove that hook path."
        )
    return entries[0][1]


def _merge_metrics(into: dict[str, Any], new: dict[str, Any], plugin: str, slot: str) -> None:
    for key, value in (new or {}).items():
        if key in into:
            raise PluginError(f"plugin {plugin!r} reports metric {key!r} in slot {slot!r}, which another plugin set")
        into[key] = value


# ---- train actor ----------------------------------------------------------------------------------
def loss_function(args, batch, logits, sum_of_sample_mean):
    """The loss slot's function (exclusive) or, when no plugin provides one but a plugin adds a loss term,
    slime's own loss for ``args.loss_type`` (``policy_loss_function``; ``value_loss_function`` in a critic
    pass); then each ``loss_term`` contribution's term (None: nothing to add) is added, its metrics
    merged and the reported ``loss`` updated."""
    terms = _contributions(args, "loss_term")
    if _entries(args, "loss") or not terms:
        base = _exclusive(args, "loss")
    else:
        from slime.backends.megatron_utils import loss as slime_loss

        base = slime_loss.value_loss_function if getattr(args, "loss_type", None) == "value_loss" else (
            slime_loss.policy_loss_function)
    loss, metrics = base(args, batch, logits, sum_of_sample_mean)
    added = False
    for plugin, fn in terms:
        out = fn(args, batch, logits, sum_of_sample_mean)
        if out is None:
            continue
        term, new = out
        loss = loss + term
        added = True
        metrics = dict(metrics)
        _merge_metrics(metrics, new, plugin, "loss_term")
    if added and "loss" in metrics:
        metrics["loss"] = loss.detach().clone()
    return loss, metrics


def advantage_function(args, rollout_data) -> None:
    """The advantage chain around one base. Contributions below the slot's ``base_order`` (200) prepare
    (compaction's segment layout) or compute a plugin's own base (sao's skip-observation GAE, compaction's
    per-segment GAE for ppo); at 200, when none of them set ``advantages``, slime's own estimator runs once
    (:func:`~slime_ascend.advantage_base.slime_estimator`); contributions from 200 on transform the
    advantages (compaction's decay, opd's teacher term)."""
    entries = _entries(args, "advantage")
    if not entries:
        _exclusive(args, "advantage")  # raises the explanatory error
    base_order = get_slot("advantage").base_order
    steps = [(contribution.order, contribution.load()) for _, contribution in entries]
    for fn in [fn for order, fn in steps if order < base_order]:
        fn(args, rollout_data)
    if rollout_data.get("advantages") is None:
        from .advantage_base import slime_estimator

        slime_estimator(args, rollout_data)
    for fn in [fn for order, fn in steps if order >= base_order]:
        fn(args, rollout_data)
    missing = [k for k in ("advantages", "returns") if rollout_data.get(k) is None]
    if missing:
        raise PluginError(f"advantage plugins {[p for p, _ in entries]} left rollout_data without {missing}")


def tis_function(
    args,
    *,
    pg_loss,
    train_log_probs,
    rollout_log_probs,
    loss_masks,
    total_lengths,
    response_lengths,
    **kwargs,
):
    metrics: dict[str, Any] = {}
    for plugin, fn in _contributions(args, "tis"):
        pg_loss, loss_masks, new = fn(
            args,
            pg_loss=pg_loss,
            train_log_probs=train_log_probs,
            rollout_log_probs=rollout_log_probs,
            loss_masks=loss_masks,
            total_lengths=total_lengths,
            response_lengths=response_lengths,
            **kwargs,
        )
        _merge_metrics(metrics, new, plugin, "tis")
    return pg_loss, loss_masks, metrics


def rollout_data_postprocess(args, rollout_id, rollout_data) -> None:
    for _, fn in _contributions(args, "rollout_data_postprocess"):
        fn(args, rollout_id, rollout_data)


def megatron_init(args) -> None:
    for _, fn in _contributions(args, "megatron_init"):
        fn(args)


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    for _, fn in _contributions(args, "before_train_step"):
        fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)


def before_log_prob(args, model, store_prefix) -> None:
    for _, fn in _contributions(args, "before_log_prob"):
        fn(args, model, store_prefix)


def quantize_params(args, megatron_name, converted_named_params, quantization_config, transform_ue8m0=True):
    """Our formats for the weight-sync funnel. Returns None when the config is not ours."""
    return _exclusive(args, "quantize_params")(
        args, megatron_name, converted_named_params, quantization_config, transform_ue8m0
    )


# ---- rollout manager ------------------------------------------------------------------------------
def _accepts(fn: Any, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


async def generate(args, sample, sampling_params, evaluation=False):
    fn = _exclusive(args, "generate")
    if _accepts(fn, "evaluation"):
        return await fn(args, sample, sampling_params, evaluation=evaluation)
    return await fn(args, sample, sampling_params)


async def reward_model(args, sample, **kwargs):
    return await _exclusive(args, "reward_model")(args, sample, **kwargs)


def convert_samples_to_train_data(args, samples):
    return _exclusive(args, "convert_samples")(args, samples)


def rollout_sample_hook(args, sample, *, rollout_id=None, evaluation=False):
    for _, fn in _contributions(args, "rollout_sample_hook"):
        sample = fn(args, sample, rollout_id=rollout_id, evaluation=evaluation)
        if sample is None:
            return None
    return sample


GROUP_NORMALISED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")


def _unscored(sample: Any) -> bool:
    """Removed from training because it FAILED (reward-mix's failed term, an environment failure): its reward
    is a placeholder, not a score."""
    status = getattr(sample, "status", None)
    return bool(getattr(sample, "remove_sample", False)) and str(getattr(status, "name", status)).upper() == "FAILED"


def reward_post_process(args, samples):
    """Plugins' reward steps in order, then per-group normalisation counting each rollout once.

    Replaces slime's default post-process (which it skips when this hook is set); with one sample
    per rollout and no unscored sample the normalisation is the same as slime's. An unscored sample
    (:func:`_unscored`) takes no part in its group's mean or std and its reward is 0 in every path (it
    trains nothing: slime zeroes its loss mask); a group it leaves with fewer than two scored rollouts has
    no baseline, so all its rewards are 0.
    """
    from .algorithms.reward_norm import group_normalise

    key = getattr(args, "reward_key", None)  # Sample.get_reward_value, also for args without it (contract stubs)
    raw_rewards = [sample.reward[key] if key else sample.reward for sample in samples]
    rewards = list(raw_rewards)
    for _, fn in _contributions(args, "reward_post_process"):
        raw_rewards, rewards = fn(args, samples, raw_rewards, rewards)
    scored = [i for i, s in enumerate(samples) if not _unscored(s)]
    if getattr(args, "advantage_estimator", None) in GROUP_NORMALISED and getattr(args, "rewards_normalization", False):
        groups = [getattr(s, "group_index", None) for s in samples]
        rollouts = [s.rollout_id if getattr(s, "rollout_id", None) is not None else s.index for s in samples]
        lost = {groups[i] for i in set(range(len(samples))) - set(scored)}
        baseline = {g: len({rollouts[i] for i in scored if groups[i] == g}) for g in lost}
        scored = [i for i in scored if baseline.get(groups[i], 2) >= 2]
        normalised = group_normalise(
            [rewards[i] for i in scored], [groups[i] for i in scored], [rollouts[i] for i in scored],
            divide_by_std=args.advantage_estimator in ("grpo", "gspo", "cispo")
            and bool(getattr(args, "grpo_std_normalization", False)),
        )
        rewards = [0.0] * len(samples)
        for i, value in zip(scored, normalised):
            rewards[i] = value
    elif len(scored) < len(samples):
        kept = set(scored)
        rewards = [r if i in kept else 0.0 for i, r in enumerate(rewards)]
    return raw_rewards, rewards
