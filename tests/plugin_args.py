"""slime-shaped ``args`` for plugin tests without slime: every setting the plugins declare at its default,
their slime args, and the slime fields our hook dispatchers (``slime_ascend.hooks``) read."""

from __future__ import annotations

import types

SLIME_FIELDS = dict(use_rollout_logprobs=False, get_mismatch_metrics=False,
                    custom_tis_function_path="slime_ascend.hooks.tis_function", loss_type="policy_loss",
                    hf_checkpoint=None, reward_key=None, advantage_estimator="grpo", rewards_normalization=True,
                    grpo_std_normalization=True, n_samples_per_prompt=4)


def plugin_args(plugins, **overrides) -> types.SimpleNamespace:
    """``args`` with ``plugins`` (Plugin declarations) enabled; ``overrides`` last."""
    values = {}
    for plugin in plugins:
        values.update({s.key: s.default for s in plugin.settings})
        values.update(dict(plugin.slime_args))
    values.update(ascend_plugins=[p.name for p in plugins], **SLIME_FIELDS)
    values.update(overrides)
    return types.SimpleNamespace(**values)
