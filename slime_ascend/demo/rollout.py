"""The demo's rollout side: engines, generation and rewards the way slime's RolloutManager runs them.

:class:`RolloutWorker` hosts two torch engines over SGLang's HTTP API on loopback: the policy's
(rollout) engine and the teacher engine that the opd plugin's TeacherPool switches between the two
teachers with ``/update_weights_from_disk``. Per rollout step it mirrors slime's
``generate_and_rm``: ``hooks.generate`` (the compaction plugin's segmenting generate) or, without a
generate plugin, slime's default single ``/generate`` call; then ``hooks.rollout_sample_hook``;
then ``hooks.reward_model`` (the opd plugin: routing + the task reward) for samples without
a reward; then slime's sample -> train-data conversion, whose reward post-process is
``hooks.reward_post_process`` (staleness, opd, compaction): there the opd plugin scores the batch at
the switched teachers, grouped by teacher (at most one switch per teacher a step needs). Where slime is importable its own
``Sample`` and ``RolloutManager._convert_samples_to_train_data`` are used.

Late long episodes: a fully asynchronous rollout delivers long episodes after later weight updates.
To show that deterministically, a rollout with ``s`` segments is handed to training ``s - 1`` steps
after it was generated (``late_long_episodes``); the staleness plugin then sees its older version.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from typing import Any

from slime_ascend import hooks
from slime_ascend.compat.sample import get_sample_class
from slime_ascend.demo.task import prompt_text, question_text, task_reward
from slime_ascend.plugins import runtime

__all__ = ["RolloutWorker", "convert_samples_to_train_data", "default_generate"]


async def default_generate(args: Any, sample: Any, sampling_params: dict[str, Any], client: Any) -> Any:
    """slime's default generate (``slime.rollout.sglang_rollout.generate``) for one single-turn sample."""
    result = await client.generate(sample.tokens, sampling_params)
    sample.tokens = list(sample.tokens) + list(result.token_ids)
    sample.response_length = len(result.token_ids)
    sample.rollout_log_probs = list(result.log_probs)
    sample.loss_mask = [1] * len(result.token_ids)
    sample.response = result.text
    if result.weight_version is not None:
        sample.weight_versions.append(result.weight_version)
    status = type(sample).Status
    sample.status = {"stop": status.COMPLETED, "length": status.TRUNCATED, "abort": status.ABORTED}[result.finish_reason]
    return sample


def convert_samples_to_train_data(args: Any, samples: list[Any]) -> dict[str, Any]:
    """slime's ``RolloutManager._convert_samples_to_train_data`` (reward post-process included).

    Uses slime's own method when slime is importable; otherwise this mirror of it (same keys, same
    ``remove_sample`` -> zero loss mask, same per-rollout ``rollout_mask_sums``).
    """
    try:
        from slime.ray.rollout import RolloutManager
    except ImportError:
        RolloutManager = None
    if RolloutManager is not None:
        RolloutManager = getattr(RolloutManager, "__ray_actor_class__", RolloutManager)  # the @ray.remote class
        manager = object.__new__(RolloutManager)  # slime's method needs only these attributes
        manager.args = args
        manager.custom_convert_samples_to_train_data_func = None
        manager.custom_reward_post_process_func = hooks.reward_post_process
        return RolloutManager._convert_samples_to_train_data(manager, samples)

    raw_rewards, rewards = hooks.reward_post_process(args, samples)
    status = type(samples[0]).Status
    loss_masks = []
    for s in samples:
        if s.loss_mask is None:
            s.loss_mask = [1] * s.response_length
        if len(s.loss_mask) != s.response_length:
            raise ValueError(f"sample {s.index}: loss mask length {len(s.loss_mask)} != response {s.response_length}")
        if s.remove_sample:
            s.loss_mask = [0] * s.response_length
        loss_masks.append(s.loss_mask)
    rollout_ids = [s.rollout_id if s.rollout_id is not None else s.index for s in samples]
    totals: Counter = Counter()
    for rid, m in zip(rollout_ids, loss_masks, strict=True):
        totals[rid] += sum(m)
    data: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": list(rewards),
        "raw_reward": list(raw_rewards),
        "truncated": [1 if s.status == status.TRUNCATED else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "rollout_ids": rollout_ids,
        "loss_masks": loss_masks,
        "rollout_mask_sums": [totals[r] for r in rollout_ids],
    }
    if samples[0].metadata and "round_number" in samples[0].metadata:
        data["round_number"] = [s.metadata["round_number"] for s in samples]
    if samples[0].rollout_log_probs is not None:
        data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
    if samples[0].train_metadata is not None:
        data["metadata"] = [s.train_metadata for s in samples]
    if samples[0].teacher_log_probs is not None:
        data["teacher_log_probs"] = [s.teacher_log_probs for s in samples]
    return data


class RolloutWorker:
    """Engines + rollout generation (one Ray actor: slime's RolloutManager with its engines)."""

    def __init__(self, policy_dir: str, teacher_dir: str, seed: int) -> None:
        import torch

        from slime_ascend.rollout.torch_engine.engine import TorchEngine

        torch.set_num_threads(1)
        self.seed = seed
        self._stack = contextlib.ExitStack()
        self.engine = TorchEngine(policy_dir, seed=seed)
        self.teacher_engine = TorchEngine(teacher_dir, seed=seed + 1)
        self.engine_url = self._stack.enter_context(self.engine.start_in_thread())
        self.teacher_url = self._stack.enter_context(self.teacher_engine.start_in_thread())
        # generation runs on one persistent event loop in its own thread (Ray may run actor methods
        # inside a loop of its own; one loop keeps the opd switch gate and HTTP sessions alive)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True).start()
        self.args: Any = None
        self.late: list[tuple[int, list[Any]]] = []  # (due step, samples of one rollout)
        self.next_index = 0

    def urls(self) -> dict[str, str]:
        return {"engine": self.engine_url, "teacher": self.teacher_url}

    def set_args(self, args: Any, sampling: dict[str, Any], concurrency: int, late_long_episodes: bool) -> None:
        from slime_ascend.rollout.engine_client import EngineClient

        self.args = args
        self.sampling = dict(sampling)
        self.concurrency = concurrency
        self.late_long_episodes = late_long_episodes
        self.client = EngineClient(self.engine_url + "/generate")
        runtime.active(args)  # validate the plugins against the args in this process, as slime's hooks do

    # ------------------------------------------------------------------ one rollout
    def _new_sample(self, episode: dict[str, Any], step: int) -> Any:
        cls = get_sample_class()
        index = self.next_index
        self.next_index += 1
        sample = cls()
        sample.index = index
        sample.group_index = index
        sample.rollout_id = index
        sample.prompt = question_text(episode["domain"], episode["digit"])
        sample.metadata = {"domain": episode["domain"], "task": dict(episode), "seed": self.seed * 1_000_003 + index,
                           "rollout_step": step}
        sample.status = cls.Status.PENDING
        if not runtime.active(self.args).selection.slots.get("generate"):
            tok = self.engine.tokenizer
            sample.tokens = list(tok.encode(prompt_text(episode["domain"], episode["digit"]), add_special_tokens=False))
        return sample

    async def _generate_and_rm(self, sample: Any, sem: asyncio.Semaphore) -> list[Any]:
        slots = runtime.active(self.args).selection.slots
        params = dict(self.sampling, sampling_seed=int(sample.metadata["seed"]) % (2**31))
        async with sem:
            if slots.get("generate"):
                out = await hooks.generate(self.args, sample, params)
            else:
                out = await default_generate(self.args, sample, params, self.client)
        samples = out if isinstance(out, list) else [out]
        if slots.get("rollout_sample_hook"):
            samples = [s for s in (hooks.rollout_sample_hook(self.args, s, rollout_id=None) for s in samples) if s]
        pending = [s for s in samples if s.reward is None]
        if pending:
            if slots.get("reward_model"):
                rewards = await asyncio.gather(*(hooks.reward_model(self.args, s) for s in pending))
            else:
                rewards = [task_reward(self.args, s) for s in pending]
            for s, r in zip(pending, rewards, strict=True):
                s.reward = r
        return samples

    def generate(self, step: int, episodes: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Generate one rollout batch (plus late episodes now due) -> (slime train data, rollout metrics)."""
        t0 = time.perf_counter()
        samples = [self._new_sample(ep, step) for ep in episodes]

        async def run() -> list[list[Any]]:
            sem = asyncio.Semaphore(self.concurrency)
            return list(await asyncio.gather(*(self._generate_and_rm(s, sem) for s in samples)))

        rollouts = asyncio.run_coroutine_threadsafe(run(), self.loop).result()
        fresh_rewards = [float(r[-1].get_reward_value(self.args)) for r in rollouts]
        segments = [len(r) for r in rollouts]
        batch: list[Any] = []
        held = 0
        for r in rollouts:
            delay = len(r) - 1 if self.late_long_episodes else 0
            if delay > 0:
                self.late.append((step + delay, r))
                held += 1
            else:
                batch.extend(r)
        due = [r for d, r in self.late if d <= step]
        self.late = [(d, r) for d, r in self.late if d > step]
        for r in due:
            batch.extend(r)
        gen_s = time.perf_counter() - t0
        train_data = convert_samples_to_train_data(self.args, batch)
        dropped_rollouts = len({s.rollout_id for s in batch if s.remove_sample})
        short = [x for x, n in zip(fresh_rewards, segments, strict=True) if n == 1]
        metrics: dict[str, Any] = {
            "reward": sum(fresh_rewards) / max(1, len(fresh_rewards)),
            "reward_short": sum(short) / len(short) if short else None,
            "rollouts": len(rollouts),
            "samples_trained": len(batch),
            "late_held": held,
            "late_released": len(due),
            "segments_max": max(segments) if segments else 0,
            "compactions": sum(n - 1 for n in segments),
            "staleness_drops": dropped_rollouts,
            "weight_versions": sorted({v for s in batch for v in (s.weight_versions or [])}),
            "generate_s": gen_s,
        }
        metrics.update(self._plugin_stats())
        return train_data, metrics

    def _plugin_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "opd" in runtime.enabled_names(self.args):
            from slime_ascend.opd.hooks import opd_stats

            st = opd_stats(self.args)
            out["teacher_switches"] = int(st.get("switches", 0))
            out["teacher_routing"] = dict((st.get("last_step") or {}).get("counts", {}))
            kls = (st.get("last_step") or {}).get("kl_k3", {})
            out["opd_kl"] = sum(kls.values()) / len(kls) if kls else None
            pool = st.get("pool") or {}
            out["teacher_prefetch_hits"] = pool.get("prefetch_hits", pool.get("switch_prefetched"))
        if "staleness" in runtime.enabled_names(self.args):
            from slime_ascend.offpolicy.staleness import last_staleness_report

            rep = last_staleness_report() or {}
            out["staleness_report"] = {k: v for k, v in rep.items() if isinstance(v, (int, float, str))}
        return out

    # ------------------------------------------------------------------ weight sync
    def update_weights(self, model_path: str, version: int) -> dict[str, Any]:
        """slime's disk weight update: ``/update_weights_from_disk`` with the new ``weight_version``."""
        from slime_ascend.json_client import request_json

        t0 = time.perf_counter()
        reply = request_json(self.engine_url + "/update_weights_from_disk",
                             {"model_path": model_path, "weight_version": str(version)}, timeout_s=120)
        if not reply.get("success", False):
            raise RuntimeError(f"engine refused the weight update: {reply}")
        return {"engine_load_s": time.perf_counter() - t0, "engine_version": self.engine.weight_version}