"""The demo's train side: a tiny policy and critic trained the way slime's Megatron actors train them.

One :class:`Trainer` plays slime's actor and critic train groups (one DP rank, no model
parallelism). Per rollout it does what slime does, calling our dispatchers where slime calls its
hooks:

1. critic: ``forward_only`` values (pre-update), then, marked as a critic pass, the advantage
   chain (``hooks.advantage_function``) for the value targets and ``K`` value-loss passes through
   ``hooks.loss_function`` with ``loss_type = "value_loss"`` (what the sao patches do in slime);
   ``hooks.before_train_step`` before each optimizer step;
2. actor: values from the critic, ``kl`` zeros (``kl_coef = 0``), the advantage chain, one
   optimizer step through ``hooks.loss_function`` (custom loss);
3. weight sync: the policy's HF-named tensors go through ``quantize_params`` (the int8/fp8 sync
   plugin) into a safetensors directory with its ``quantization_config``, which the rollout engine
   loads with ``/update_weights_from_disk`` and a new ``weight_version``.

The models are Hugging Face Qwen3 modules; the critic replaces ``lm_head`` with a one-output value
head (slime's ``LinearForLastLayer``) and freezes the parameters its role config names.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from slime_ascend import hooks
from slime_ascend.demo import slime_train_api
from slime_ascend.demo.task import padded_batch
from slime_ascend.plugins import roles, runtime
from slime_ascend.startup import patch_plan

__all__ = ["Trainer", "build_rollout_data", "quantize_for_sync"]

logger = logging.getLogger("slime_ascend.demo")

CRITIC_ADVANTAGE = "train.critic_advantage_function"

# keys slime's RolloutManager._split_train_data_by_dp ships to a train rank (slime/ray/rollout.py)
PER_SAMPLE_KEYS = ("tokens", "response_lengths", "rewards", "truncated", "loss_masks", "round_number", "sample_indices",
                   "rollout_ids", "rollout_mask_sums", "rollout_log_probs", "source_names", "prompt",
                   "teacher_log_probs")


def build_rollout_data(train_data: dict[str, Any]) -> dict[str, Any]:
    """Trainer-side ``rollout_data`` of one DP rank (all samples), tensorised as slime's actor holds it."""
    rd: dict[str, Any] = {k: list(train_data[k]) for k in PER_SAMPLE_KEYS if k in train_data}
    rd["raw_reward"] = list(train_data["raw_reward"])
    rd["total_lengths"] = [len(t) for t in train_data["tokens"]]
    rd["tokens"] = [torch.as_tensor(t, dtype=torch.long) for t in rd["tokens"]]
    rd["loss_masks"] = [torch.as_tensor(m, dtype=torch.int) for m in rd["loss_masks"]]
    rd["rollout_mask_sums"] = torch.as_tensor(rd["rollout_mask_sums"], dtype=torch.float32)
    for key in ("rollout_log_probs", "teacher_log_probs"):
        if key in rd:
            rd[key] = [torch.as_tensor(x, dtype=torch.float32) for x in rd[key]]
    rd["rewards"] = [float(r) for r in rd["rewards"]]
    return rd


class _ValueModel(torch.nn.Module):
    """The policy architecture with ``lm_head`` replaced by a hidden -> 1 value head."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.model = lm.model
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1, bias=False)
        torch.nn.init.zeros_(self.value_head.weight)
        self.role = "critic"  # what sao's before_train_step reads

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.value_head(hidden)


def _packed(model_out: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[B, L, X] right-padded rows -> slime's packed [1, sum(lengths), X] (THD layout without padding)."""
    return torch.cat([model_out[i, :n] for i, n in enumerate(lengths)], dim=0).unsqueeze(0).float()


def quantize_for_sync(args: Any, named: list[tuple[str, torch.Tensor]],
                      quantization_config: dict | None) -> list[tuple[str, torch.Tensor]]:
    """The weight-sync funnel for one parameter: ``hooks.quantize_params`` when a sync plugin is enabled.

    slime calls ``quantize_params(args, megatron_name, converted_named_params, quantization_config,
    transform_ue8m0)`` per Megatron parameter with its HF-named tensors; ``None`` means "not ours"
    and slime's own quantizer runs. When the sync plugin cannot load here (``available_plugins`` says
    why at start), the same ``slime_ascend.quant`` function the plugin wraps is called directly.
    """
    if quantization_config is None:
        return named
    if "quantize_params" in runtime.active(args).selection.slots:
        out = hooks.quantize_params(args, named[0][0], named, quantization_config, True)
        if out is not None:
            return list(out)
    from slime_ascend.quant import quantize_named_params

    return quantize_named_params(named, quantization_config)


class Trainer:
    """Policy + critic with their optimizers, a weight version, and the sync export."""

    def __init__(self, args: argparse.Namespace, policy_dir: str, out_dir: str, *, lr: float, critic_lr: float,
                 seed: int, sync_format: str | None, lr_warmup_steps: int = 0) -> None:
        from slime_ascend.rollout.torch_engine.model import load_model
        from slime_ascend.sao.freeze import matching_names

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.slime_api = slime_train_api.install()
        self.args = args
        self.out_dir = Path(out_dir)
        self.policy = load_model(policy_dir).float().train()
        critic_lm = load_model(policy_dir).float()
        self.critic = _ValueModel(critic_lm).train()
        self.critic_args = self._critic_args(args)
        frozen = set(matching_names([n for n, _ in self.critic.named_parameters()],
                                    getattr(self.critic_args, "freeze_params_name_list", None) or []))
        for name, p in self.critic.named_parameters():
            p.requires_grad_(name not in frozen)
        self.policy.role = "actor"
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=lr)
        # Megatron's --lr-warmup-iters: linear warmup of the actor's learning rate over the first rollouts
        # (Adam's first updates are sign-like, whatever the gradient's size; warmup keeps them small)
        self.lr, self.lr_warmup_steps = lr, int(lr_warmup_steps)
        self.critic_opt = torch.optim.Adam([p for p in self.critic.parameters() if p.requires_grad], lr=critic_lr)
        self.version = 0
        self.quantization_config = self._quantization_config(sync_format)
        self._megatron_init()

    # ---------------------------------------------------------------- setup
    @staticmethod
    def _critic_args(args: argparse.Namespace) -> argparse.Namespace:
        """What slime's ``--megatron-config-path`` makes of the critic's args (arguments.py role overrides)."""
        critic = copy.deepcopy(args)
        critic.custom_advantage_function_path = None
        critic.kl_coef = 0.0
        critic.use_opd = False
        path = getattr(args, "megatron_config_path", None)
        if path:
            from slime_ascend.sao.role_config import critic_overrides

            for key, value in critic_overrides(path).items():
                setattr(critic, key, value)
        return critic

    def _megatron_init(self) -> None:
        """What slime's train actors do at start: the runtime installs the enabled plugins' train patches
        into slime's actor (``TrainRayActor.init``), then slime calls ``custom_megatron_init_path``. Without
        slime there is nothing to patch: the plan installs ``train.critic_advantage_function`` (checked, as
        everywhere) on the critic's args alone (this miniature stands in for slime's actor) and the trainer
        marks critic passes."""
        state = runtime.active(self.args)
        if "megatron_init" not in state.selection.slots:
            return
        if self.slime_api == "slime":
            previous = roles.train_role()
            try:
                for role, args in (("actor", self.args), ("critic", self.critic_args)):
                    roles.set_train_role(role)  # one process plays both of slime's train actors
                    patch_plan.install_for_role(args, "train", state.selection.plugins)
                    hooks.megatron_init(args)
                return
            except Exception as exc:  # noqa: BLE001 - slime's actor module may not import on this machine
                logger.warning("megatron_init on slime failed (%s: %s); the trainer emulates it",
                               type(exc).__name__, exc)
            finally:
                roles.set_train_role(previous)
        if not patch_plan.applied(CRITIC_ADVANTAGE):
            # no slime modules to patch: the plan checks and installs only the patch's change to the critic's args
            patch_plan.install_for_role(self.critic_args, "train", state.selection.plugins, only=(CRITIC_ADVANTAGE,),
                                        modules={})

    def _quantization_config(self, fmt: str | None) -> dict | None:
        if fmt is None:
            return None
        from slime_ascend.quant import ct_int8_quantization_config, fp8_block_quantization_config

        if fmt == "int8":
            return ct_int8_quantization_config()
        if fmt == "fp8":
            return fp8_block_quantization_config((128, 128), ("lm_head",))
        raise ValueError(f"sync_format must be 'int8', 'fp8' or None, got {fmt!r}")

    # ---------------------------------------------------------------- forward passes
    def _policy_logits(self, rd: dict[str, Any]) -> torch.Tensor:
        ids, attn = padded_batch(rd["tokens"])
        out = self.policy(input_ids=ids, attention_mask=attn, use_cache=False).logits
        return _packed(out, rd["total_lengths"])

    def _critic_logits(self, rd: dict[str, Any]) -> torch.Tensor:
        ids, attn = padded_batch(rd["tokens"])
        return _packed(self.critic(ids, attn), rd["total_lengths"])

    def _extract(self, fn_name: str, logits: torch.Tensor, rd: dict[str, Any], args: Any) -> list[torch.Tensor]:
        import importlib

        loss_mod = importlib.import_module("slime.backends.megatron_utils.loss")
        fn = getattr(loss_mod, fn_name)
        _, out = fn(logits, args=args, unconcat_tokens=rd["tokens"], total_lengths=rd["total_lengths"],
                    response_lengths=rd["response_lengths"])
        return out["values" if fn_name == "get_values" else "log_probs"]

    def _batch(self, rd: dict[str, Any]) -> dict[str, Any]:
        """slime's loss batch (model.py train_one_step keys); missing keys are None."""
        keys = ("tokens", "total_lengths", "response_lengths", "loss_masks", "log_probs", "ref_log_probs", "values",
                "advantages", "returns", "rollout_log_probs", "teacher_log_probs", "rollout_mask_sums")
        batch = {k: rd.get(k) for k in keys}
        batch["unconcat_tokens"] = rd["tokens"]
        return batch

    def _step(self, args: Any, rd: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer,
              logits_fn, step: int, sub: int) -> dict[str, float]:
        if "before_train_step" in runtime.active(args).selection.slots:
            hooks.before_train_step(args, step, sub, model, opt, None)
        logits = logits_fn(rd)
        per_token = bool(getattr(args, "calculate_per_token_loss", False))
        reducer = slime_train_api.sum_of_sample_mean(rd["response_lengths"], rd["loss_masks"],
                                                     rd["rollout_mask_sums"].tolist(), per_token)
        loss, metrics = hooks.loss_function(args, self._batch(rd), logits, reducer)
        # Megatron's divisor: trainable tokens (per-token loss) or rollouts in the step
        norm = (max(1.0, float(sum(int(m.sum()) for m in rd["loss_masks"]))) if per_token
                else float(max(1, len(set(rd["rollout_ids"])))))
        opt.zero_grad(set_to_none=True)
        (loss / norm).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        return {k: float(v) / norm for k, v in metrics.items()}

    # ---------------------------------------------------------------- one rollout
    def train(self, step: int, train_data: dict[str, Any]) -> dict[str, Any]:
        """Critic then actor on one rollout, then export the synced weights. Returns metrics and the export."""
        t0 = time.perf_counter()
        rd = build_rollout_data(train_data)
        with torch.no_grad():
            values = self._extract("get_values", self._critic_logits(rd), rd, self.critic_args)
            log_probs = self._extract("get_log_probs_and_entropy", self._policy_logits(rd), rd, self.args)
        # ---- critic (train_critic): value targets from the advantage chain, K value-loss passes
        critic_rd = dict(rd, values=[v.detach() for v in values], kl=[torch.zeros_like(v) for v in values])
        critic_rd["log_probs"] = [lp.detach() for lp in log_probs]
        critic_iters = int(runtime.settings(self.args, "sao").critic_iters) if "sao" in runtime.enabled_names(
            self.args) else 1
        cargs = argparse.Namespace(**vars(self.critic_args))
        cargs.loss_type = "value_loss"
        role = roles.train_role()  # one process trains both roles: the critic's hooks run as the critic's
        roles.set_train_role("critic")
        try:
            with roles.critic_pass():
                hooks.advantage_function(self.critic_args, critic_rd)
                for k in range(critic_iters):
                    m = self._step(cargs, critic_rd, self.critic, self.critic_opt, self._critic_logits, step, k)
        finally:
            roles.set_train_role(role)
        metrics: dict[str, Any] = {f"critic/{k}": v for k, v in m.items()}
        # ---- actor: GAE with the critic's pre-update values, then one optimizer step
        actor_rd = dict(rd, values=[v.detach() for v in values], log_probs=[lp.detach() for lp in log_probs],
                        kl=[torch.zeros_like(v) for v in values])
        hooks.advantage_function(self.args, actor_rd)
        adv = torch.cat([a.flatten() for a in actor_rd["advantages"]]) if actor_rd["advantages"] else torch.zeros(0)
        for group in self.opt.param_groups:
            group["lr"] = self.lr * min(1.0, (step + 1) / self.lr_warmup_steps) if self.lr_warmup_steps else self.lr
        m = self._step(self.args, actor_rd, self.policy, self.opt, self._policy_logits, step, 0)
        metrics.update({f"actor/{k}": v for k, v in m.items()})
        metrics["actor/advantage_mean"] = float(adv.mean()) if adv.numel() else 0.0
        if "opd_reverse_kl" in actor_rd:
            kls = actor_rd["opd_reverse_kl"]
            tok = torch.cat([torch.as_tensor(k).flatten() for k in kls]) if len(kls) else torch.zeros(0)
            masks = torch.cat([m.flatten() for m in rd["loss_masks"]]).float() if rd["loss_masks"] else tok
            metrics["actor/opd_reverse_kl"] = float((tok * masks).sum() / masks.sum().clamp_min(1))
        metrics["train_s"] = time.perf_counter() - t0
        # ---- weight sync export
        self.version += 1
        metrics.update(self.export(self.version))
        return metrics

    # ---------------------------------------------------------------- weight sync
    def export(self, version: int) -> dict[str, Any]:
        """Write the policy for the engine: quantised per parameter through the sync funnel."""
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        out = self.out_dir / "weights" / f"v{version:04d}"
        out.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in self.policy.state_dict().items():
                for qname, t in quantize_for_sync(self.args, [(name, p.detach())], self.quantization_config):
                    tensors[qname] = t.contiguous().clone()
        save_file(tensors, str(out / "model.safetensors"))
        config = self.policy.config.to_dict()
        if self.quantization_config is not None:
            config["quantization_config"] = self.quantization_config
        (out / "config.json").write_text(json.dumps(config, indent=1, default=str))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        full = sum(p.numel() * p.element_size() for p in self.policy.state_dict().values())
        return {"weights_dir": str(out), "version": version, "sync_bytes": nbytes, "sync_unquantised_bytes": full,
                "sync_export_s": time.perf_counter() - t0}

    def save_final(self, path: str) -> str:
        from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, save_model

        return str(save_model(self.policy, path, build_byte_tokenizer()))
