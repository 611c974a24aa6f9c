"""The torch engine's cross-request prefix cache: KV of earlier requests, owned by one weight version.

A bounded LRU of the KV caches that finished requests leave behind (the prompt and the generated tokens that were
fed back), keyed by their token ids. A new request whose ``input_ids`` start with the tokens of an entry (a later
turn of a multi-turn session on the engine that served its earlier turns; another sample of the same prompt) takes
a copy of that KV, cropped to the common prefix, and prefills only the rest; ``meta_info["cached_tokens"]`` says how
many prompt tokens it reused (SGLang's field; slime's ``prefix_cache_hit_rate`` reads it).

**The version contract** (issue 30: "the DP routing of a multi-turn session and its KV-cache owner move together or
are explicitly invalidated"). KV computed by weight version ``v`` is reused only while ``v`` serves:

* every entry is tagged with the cache's *generation* (a counter the engine bumps at every weight switch, under the
  engine's compute lock, whatever the transport: disk, tensor, distributed) and with the version label it served;
* :meth:`PrefixCache.switch` drops every entry at once (counted: ``invalidated_entries``, ``invalidated_tokens``),
  so after a switch the cache holds nothing of the old version;
* a request records the generation its prefill ran under; its KV is inserted only if that generation still serves
  (a request parked by an ``in_place`` pause across a switch continues on its old KV, as in SGLang, but its KV is
  never cached: counted ``stale_inserts_refused``);
* the lookup and the prefill forward run under the compute lock a switch takes, so no switch falls between them.

Each answer that reused a prefix says which version computed it (``meta_info["cached_weight_version"]``, the entry's
label, beside the answer's own ``weight_version``): a client can check, answer by answer, that no token came from a
prefix of another version (``cosched`` counts the answers where they differ, ``rollout/cosched_stale_prefix_answers``).

Tagging by a counter, not the version string: the label is the caller's (``weight_version`` may repeat, or stay
``"default"``), the counter cannot repeat. A session moved to another engine finds no entry there and recomputes
its prefix (``cached_tokens`` 0); its entry on the old engine ages out by LRU.

Reuse is bounded as SGLang's radix match is: at most ``len(input_ids) - 1`` tokens (the last prompt token is always
fed, for the first output's logits), and with ``logprob_start_len >= 0`` at most ``logprob_start_len`` (the scored
positions are computed). Outputs with reuse: the same token ids as without on the engine's tests (greedy); log-probs
differ by float rounding only, not bit for bit (a prefix's KV computed in other chunks: at most 4.8e-7 in float32 on
the tiny Qwen3 over four turns, the size of the KV-cache decode's own difference from a full forward, 2e-7).

**What SGLang must do for the same guarantee** (SGLang 0.5.15, ``sglang/srt``). SGLang's radix cache keeps no
version tag; the guarantee rests on flushing it at every switch:

* ``managers/scheduler_components/weight_updater.py`` ``flush_cache_after_weight_update`` (lines 101-106) flushes
  after ``update_weights_from_disk`` / ``_distributed`` / ``_tensor`` / ``_ipc`` when the request's ``flush_cache``
  is true (the default in ``managers/io_struct.py``) and asserts the flush succeeded;
* ``managers/scheduler.py`` ``Scheduler.flush_cache`` (line 3740) resets ``tree_cache`` only when the scheduler is
  fully idle, and otherwise returns False ("Cache not flushed because there are pending requests");
* slime sends ``flush_cache=False`` with its tensor and distributed buckets (``slime/backends/sglang_utils/
  sglang_engine.py``) and instead calls ``pause_generation`` (mode ``abort``: nothing left running) then
  ``flush_cache`` (retried until HTTP 200, else ``TimeoutError``) before the first bucket
  (``slime/backends/megatron_utils/update_weight/``: ``update_weight_from_tensor.py``,
  ``update_weight_from_distributed.py``, ``update_weight_from_disk_delta.py``); the disk transport
  (``slime/ray/actor_group.py``) pauses and flushes the same way, and its ``update_weights_from_disk`` leaves
  SGLang's default ``flush_cache=true``, so SGLang flushes again after the load.

So an SGLang deployment keeps the guarantee when (1) every version switch is preceded by a successful flush with the
engine paused in ``abort`` or ``retract`` mode (nothing can enter the radix tree between the flush and the new
weights), or sends its last bucket with ``flush_cache=true``; (2) a failed flush stops the update (slime raises
``TimeoutError``, SGLang's ``flush_cache_after_weight_update`` asserts); (3) an ``in_place`` pause is not combined
with an update that skips the flush: the flush fails while parked requests are in the running batch (the note on
``PauseGenerationReqInput`` in ``io_struct.py``), and skipped, the parked requests keep their old KV and, when they
finish, ``RadixCache.cache_finished_req`` (``mem_cache/radix_cache.py``) inserts it into the tree, where a request
of the new version would reuse it. SGLang's radix cache is per engine too: a session the router moves recomputes
its prefix on the new engine.

Pure torch and device-neutral: the KV stays where the model computed it; transformers' cache classes are checked by
type (``DynamicCache`` of full-attention ``DynamicLayer`` / ``DynamicIndexedLayer`` layers: crop is exact for them),
another cache is not kept (``uncacheable``). A model whose prefill after a cached prefix is not its full forward is
refused (:func:`unsupported`): transformers 5.12's ``GlmMoeDsaAttention`` (GLM-5's DSA) as transformers builds it,
given the boolean causal mask ``create_causal_mask`` builds for SDPA when a chunk follows a cache, fills the
unselected keys of the indexer's top-k with ``finfo.min`` into that boolean mask (``True``: may attend), so a chunk
attends densely (the tiny GLM-5: logits 0.31 to 0.70 away from the full forward; one-token decode steps get no mask
and are exact). The torch engine's GLM-5 (``glm5.align_glm_moe_dsa``) hands that forward the additive mask instead,
and its chunk after a cache is the full forward's within fp32 rounding (1.2e-7): served with the cache. Importing
this module imports neither torch nor transformers (``slime-ascend serve-torch --help`` reads the defaults below).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DEFAULT_MAX_ENTRIES", "DEFAULT_MAX_TOKENS", "PrefixCache", "PrefixHit", "unsupported"]

DEFAULT_MAX_TOKENS = 0  # off: serve-torch --prefix-cache-tokens N turns it on
DEFAULT_MAX_ENTRIES = 256


@dataclass
class _Entry:
    tokens: torch.Tensor  # int64 [n]: the ids whose KV ``kv`` holds
    kv: Any  # a transformers DynamicCache of exactly n positions (never mutated once stored)
    routes: torch.Tensor | None  # int32 [n, layers, top_k] (an MoE model), else None
    generation: int
    version: str


@dataclass
class PrefixHit:
    """A reused prefix: ``length`` tokens of ``kv`` (a private copy, safe to extend) and their ``routes``;
    ``version``: the label of the weight version that computed it (the entry's tag; the engine reports it as
    ``meta_info["cached_weight_version"]``, so a client can check it against the answer's ``weight_version``)."""

    length: int
    kv: Any
    routes: torch.Tensor | None
    version: str = "default"


def unsupported(model: Any) -> str | None:
    """Why ``model``'s prefill after a cached prefix would not be its full forward (module docstring), or None."""
    dsa = getattr(model.config, "index_topk", None) is not None or any(
        getattr(module, "indexer", None) is not None for module in model.modules())
    if not dsa:
        return None
    from .glm5 import attends_as_selected_after_a_cache

    if getattr(model.config, "model_type", None) == "glm_moe_dsa" and attends_as_selected_after_a_cache(model):
        return None
    return (f"{type(model).__name__} has DSA indexers: transformers' sparse attention drops the indexer's top-k "
            "on a prefill that follows a cache (a boolean causal mask), so a reused prefix would change the tokens")


def _cacheable_layers() -> tuple[type, ...]:
    from transformers import cache_utils

    return tuple(t for t in (getattr(cache_utils, "DynamicLayer", None), getattr(cache_utils, "DynamicIndexedLayer",
                                                                               None)) if t is not None)


def _kv_length(kv: Any) -> int | None:
    """The positions every layer of ``kv`` holds, or None when ``kv`` is not a cache this module may keep (or its
    layers disagree)."""
    from transformers.cache_utils import DynamicCache

    if not isinstance(kv, DynamicCache) or not kv.layers:
        return None
    allowed = _cacheable_layers()
    lengths = set()
    for layer in kv.layers:
        if type(layer) not in allowed or getattr(layer, "is_sliding", False) or not getattr(layer, "is_initialized",
                                                                                            False):
            return None
        lengths.add(int(layer.keys.shape[-2]))
        lengths.add(int(layer.values.shape[-2]))
        if getattr(layer, "is_indexer_initialized", False):
            lengths.add(int(layer.indexer_keys.shape[1]))
    return lengths.pop() if len(lengths) == 1 else None


def _fork(kv: Any, length: int) -> Any:
    """A new cache object holding the first ``length`` positions of ``kv``, sharing its tensors: transformers'
    dynamic layers grow by ``torch.cat`` and crop by slicing (new tensors, the stored ones untouched)."""
    new = copy.copy(kv)
    new.layers = [copy.copy(layer) for layer in kv.layers]
    new.crop(length)
    return new


def _nbytes(kv: Any) -> int:
    total = 0
    for layer in kv.layers:
        for name in ("keys", "values", "indexer_keys"):
            t = getattr(layer, name, None)
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


class PrefixCache:
    """Bounded LRU of KV prefixes of one engine, owned by its serving weight version (module docstring).

    Args:
        max_tokens: most cached positions, summed over entries; 0 turns the cache off (no lookup, no insert).
        max_entries: most entries.
        version: the label of the version serving now (reported only).
    """

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, max_entries: int = DEFAULT_MAX_ENTRIES,
                 version: str = "default") -> None:
        for name, value in (("max_tokens", max_tokens), ("max_entries", max_entries)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"prefix cache {name} must be an integer >= 0, got {value!r}")
        if max_tokens and not max_entries:
            raise ValueError("prefix cache max_entries must be >= 1 when max_tokens is above 0")
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self.version = str(version)
        self.generation = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_key = 0
        self._tokens = 0
        self._counts = dict.fromkeys(
            ("lookups", "hits", "prompt_tokens", "prefill_tokens_saved", "inserted_entries", "evicted_entries",
             "invalidated_entries", "invalidated_tokens", "switches", "flushed_entries", "stale_inserts_refused",
             "uncacheable", "oversize"), 0)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    # ------------------------------------------------------------------ lookup
    def match(self, input_ids: list[int], limit: int, need_routes: bool = False) -> PrefixHit | None:
        """The longest cached prefix of ``input_ids`` (at most ``limit`` tokens) under the serving generation, as a
        private copy; None when there is none (or the cache is off). Counts the lookup, the prompt's tokens and the
        tokens saved. ``need_routes``: only entries that hold their tokens' routes qualify."""
        if not self.enabled:
            return None
        import torch

        ids = torch.tensor(input_ids, dtype=torch.long)
        with self._lock:
            self._counts["lookups"] += 1
            self._counts["prompt_tokens"] += len(input_ids)
            best_key, best = None, 0
            for key, entry in self._entries.items():  # later (more recent) entries win ties
                if entry.generation != self.generation or (need_routes and entry.routes is None):
                    continue
                n = min(_common_prefix(entry.tokens, ids), limit)
                if n > 0 and n >= best:
                    best_key, best = key, n
            if best_key is None:
                return None
            entry = self._entries[best_key]
            self._entries.move_to_end(best_key)
            self._counts["hits"] += 1
            self._counts["prefill_tokens_saved"] += best
            return PrefixHit(best, _fork(entry.kv, best), None if entry.routes is None else entry.routes[:best],
                             entry.version)

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: list[int], kv: Any, routes: torch.Tensor | None, generation: int) -> bool:
        """Keep ``kv`` (the KV of exactly ``tokens``; the caller hands it over and does not extend it again) under
        ``generation``, the one its tokens were computed under. Refused (False) when that generation no longer
        serves, when ``kv`` is not a cache this module keeps or does not hold ``len(tokens)`` positions, or when it
        alone is above ``max_tokens``. Drops the entries it extends; evicts least recently used entries to fit."""
        if not self.enabled or not tokens:
            return False
        import torch

        length = _kv_length(kv)
        with self._lock:
            if generation != self.generation:
                self._counts["stale_inserts_refused"] += 1
                return False
            if length != len(tokens) or (routes is not None and int(routes.shape[0]) != len(tokens)):
                self._counts["uncacheable"] += 1
                return False
            if len(tokens) > self.max_tokens:
                self._counts["oversize"] += 1
                return False
            ids = torch.tensor(tokens, dtype=torch.long)
            for key, entry in list(self._entries.items()):
                common = _common_prefix(entry.tokens, ids)
                if common == entry.tokens.numel() and (entry.routes is None or routes is not None):
                    self._drop(key)  # the new entry extends it: every match it gave, the new one gives
                elif common == len(tokens) and (routes is None or entry.routes is not None):
                    self._entries.move_to_end(key)  # already covered by a longer entry
                    return False
            key, self._next_key = self._next_key, self._next_key + 1
            self._entries[key] = _Entry(ids, kv, routes, generation, self.version)
            self._tokens += len(tokens)
            self._counts["inserted_entries"] += 1
            while self._tokens > self.max_tokens or len(self._entries) > self.max_entries:
                self._drop(next(iter(self._entries)))
                self._counts["evicted_entries"] += 1
            return True

    def _drop(self, key: int) -> _Entry:
        entry = self._entries.pop(key)
        self._tokens -= entry.tokens.numel()
        return entry

    # ------------------------------------------------------------------ invalidation
    def switch(self, version: str) -> tuple[int, int]:
        """A weight switch: drop every entry (all are of the old weights), start the next generation and record
        ``version`` as serving. Returns (entries, tokens) dropped."""
        with self._lock:
            entries, tokens = len(self._entries), self._tokens
            self._entries.clear()
            self._tokens = 0
            self.generation += 1
            self.version = str(version)
            self._counts["switches"] += 1
            self._counts["invalidated_entries"] += entries
            self._counts["invalidated_tokens"] += tokens
            return entries, tokens

    def clear(self) -> int:
        """Drop every entry, weights unchanged (``/flush_cache``, a memory release); returns the entries dropped."""
        with self._lock:
            entries = len(self._entries)
            self._entries.clear()
            self._tokens = 0
            self._counts["flushed_entries"] += entries
            return entries

    # ------------------------------------------------------------------ report
    def versions(self) -> list[str]:
        """The version label of every entry held (tests: nothing of an old version after a switch)."""
        with self._lock:
            return [entry.version for entry in self._entries.values()]

    def stats(self) -> dict[str, Any]:
        """What ``/server_info`` reports as ``prefix_cache``: the bounds, what is held, and the counts since start
        (``prefill_tokens_saved`` of ``prompt_tokens`` looked up; ``invalidated_*`` at weight switches)."""
        with self._lock:
            return {"enabled": self.enabled, "max_tokens": self.max_tokens, "max_entries": self.max_entries,
                    "entries": len(self._entries), "tokens": self._tokens,
                    "bytes": sum(_nbytes(e.kv) for e in self._entries.values()),
                    "generation": self.generation, "weight_version": self.version, **self._counts}
