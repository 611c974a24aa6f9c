"""Capacity dispatch of generation requests over engines (pure asyncio; no slime, no HTTP).

Every engine has a budget and every request a cost in one unit: **requests** (the default: ``capacity`` slots an
engine, each request costs one) or **KV tokens** (each engine's budget its KV capacity, ``budgets`` in
:meth:`CapacityDispatcher.set_engines`, as the engine reports it: SGLang's ``max_total_num_tokens``; each request
costs the KV it can fill, its prompt tokens plus its ``max_new_tokens``). :meth:`CapacityDispatcher.acquire` returns
an engine where the request fits at once, or waits in one FIFO queue until it fits somewhere; :meth:`release` frees
its cost and hands the room to the waiters in order. A request costing more than an engine's whole budget fits there
only while that engine runs nothing (it runs alone; counted as ``oversized``), so nothing waits for ever. Placement:

* a session (slime's ``Sample.session_id``, the turns of one multi-turn rollout) goes back to its owner engine while
  the request fits there (its cached prefix is there);
* otherwise (no session, or the owner is full) to the engine with the most free room (ties: the engine listed
  first), and a session whose owner was full is **moved**: the new engine becomes its owner and the move is counted;
* a waiter gets the first room that frees; if it has a session owned elsewhere, that is a move too.

A session's later turn (one whose session already has an owner) is therefore either an *owner turn* (placed on the
owner, where its prefix is cached) or a *move*: ``session_turns == owner_turns + moves`` in every window.
:meth:`end_session` forgets a finished session's owner (compaction calls it when its episode ends).

:meth:`record_answer` adds what an engine reported about one answer (its prompt tokens, the tokens it reused from
its prefix cache, whether that prefix was of another weight version than the answer's), per engine.

Counts since the last :meth:`take_stats`: per engine the requests dispatched, the fraction of the window it had at
least one request running (busy), the mean fraction of its budget in use, its budget, and the prompt and reused
tokens of its answers; queue waits; session turns, owner turns and moves; answers whose reused prefix was of an old
version; requests above their engine's whole budget.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

MAX_SESSIONS = 100_000  # owners remembered (oldest forgotten first): bounded whatever the rollout sends


@dataclass
class _Engine:
    url: str
    budget: int = 1  # the slots (requests) or KV tokens it holds at once
    used: int = 0  # the cost of the requests running on it
    running: int = 0
    dispatched: int = 0
    busy_s: float = 0.0  # time with >= 1 running, in the window
    slot_s: float = 0.0  # integral of used over the window
    since: float = 0.0  # last time running changed (or the window began)
    listed: bool = True
    prompt_tokens: int = 0  # of the answers recorded (record_answer), in the window
    cached_tokens: int = 0  # reused from the engine's prefix cache, as it reported them


@dataclass
class _Waiter:
    session: str | None
    since: float
    future: asyncio.Future = field(repr=False)
    cost: int = 1


UNITS = ("requests", "kv_tokens")


class CapacityDispatcher:
    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic, unit: str = "requests") -> None:
        if int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1 request per engine, got {capacity!r}")
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
        self.capacity = int(capacity)  # the budget of an engine given none (requests)
        self.unit = unit
        self._clock = clock
        self._engines: dict[str, _Engine] = {}
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._waiters: deque[_Waiter] = deque()
        self._window_start = clock()
        self._waits: list[float] = []
        self._moves = 0
        self._session_turns = 0  # placements of a session that already had an owner
        self._owner_turns = 0  # ... of which on the owner
        self._answers = 0
        self._owner_cached = 0  # tokens reused by owner turns
        self._stale_prefix = 0  # answers that reused a prefix of another weight version
        self._unreported = 0  # answers that reused a prefix and did not say of which version
        self._oversized = 0  # requests costing more than their engine's whole budget (run alone)

    # -- engines -----------------------------------------------------------------------------------------------
    @property
    def engines(self) -> list[str]:
        return [url for url, e in self._engines.items() if e.listed]

    def set_engines(self, urls: Iterable[str], budgets: dict[str, int] | None = None) -> None:
        """The engines to dispatch to (slime's router's worker list), with each one's budget in ``budgets`` (KV
        tokens; absent: ``capacity``). An engine no longer listed gets no new request; its running requests still
        release into it."""
        urls = list(dict.fromkeys(urls))
        now = self._clock()
        for url in urls:
            budget = int((budgets or {}).get(url, self.capacity))
            if budget < 1:
                raise ValueError(f"the budget of engine {url} must be >= 1, got {budget}")
            if url not in self._engines:
                self._engines[url] = _Engine(url, budget=budget, since=now)
            self._engines[url].listed = True
            self._engines[url].budget = budget
        for url, engine in list(self._engines.items()):
            if url not in urls:
                engine.listed = False
                if engine.running == 0:
                    del self._engines[url]
        self._hand_out()

    # -- slots -------------------------------------------------------------------------------------------------
    def _free(self, engine: _Engine) -> int:
        return engine.budget - engine.used if engine.listed else 0

    def _fits(self, engine: _Engine, cost: int) -> bool:
        """``cost`` fits in what ``engine`` has free, or the engine is idle (a request above its whole budget runs
        alone rather than never)."""
        return engine.listed and (cost <= self._free(engine) or engine.running == 0)

    def _pick(self, session: str | None, cost: int = 1) -> _Engine | None:
        owner = self._engines.get(self._owners.get(session)) if session is not None else None
        if owner is not None and self._fits(owner, cost):
            return owner
        best = None
        for engine in self._engines.values():
            if self._fits(engine, cost) and (best is None or self._free(engine) > self._free(best)):
                best = engine
        return best

    def _account(self, engine: _Engine, now: float) -> None:
        dt = max(0.0, now - engine.since)
        engine.busy_s += dt if engine.running > 0 else 0.0
        engine.slot_s += dt * min(engine.used, engine.budget)
        engine.since = now

    def _take(self, engine: _Engine, session: str | None, cost: int = 1) -> str:
        now = self._clock()
        self._account(engine, now)
        if cost > engine.budget:
            self._oversized += 1
        engine.running += 1
        engine.used += cost
        engine.dispatched += 1
        if session is not None:
            previous = self._owners.get(session)
            if previous is not None:
                self._session_turns += 1
                if previous == engine.url:
                    self._owner_turns += 1
                else:
                    self._moves += 1
            self._owners[session] = engine.url
            self._owners.move_to_end(session)
            while len(self._owners) > MAX_SESSIONS:
                self._owners.popitem(last=False)
        return engine.url

    async def acquire(self, session: str | None = None, cost: int = 1) -> str:
        """An engine URL with ``cost`` of its budget taken for this request (release it with :meth:`release` and
        the same cost): one slot in the requests unit, its prompt plus ``max_new_tokens`` in KV tokens."""
        cost = int(cost)
        if cost < 1:
            raise ValueError(f"a request costs at least 1, got {cost}")
        if not any(e.listed for e in self._engines.values()):
            raise RuntimeError("no engine to dispatch to (the router lists no worker)")
        engine = self._pick(session, cost) if not self._waiters else None  # FIFO: no overtaking the queue
        if engine is not None:
            self._waits.append(0.0)
            return self._take(engine, session, cost)
        waiter = _Waiter(session, self._clock(), asyncio.get_running_loop().create_future(), cost)
        self._waiters.append(waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result(), cost)  # room was handed to a request that is gone
            raise

    def release(self, url: str, cost: int = 1) -> None:
        engine = self._engines.get(url)
        if engine is None or engine.running == 0 or engine.used < int(cost):
            raise ValueError(f"release of {cost} on {url!r}, which holds no such request")
        self._account(engine, self._clock())
        engine.running -= 1
        engine.used -= int(cost)
        if not engine.listed and engine.running == 0:
            del self._engines[url]
        self._hand_out()

    def _hand_out(self) -> None:
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():  # cancelled while queued
                self._waiters.popleft()
                continue
            engine = self._pick(waiter.session, waiter.cost)
            if engine is None:
                return
            self._waiters.popleft()
            self._waits.append(self._clock() - waiter.since)
            waiter.future.set_result(self._take(engine, waiter.session, waiter.cost))

    # -- sessions and answers ------------------------------------------------------------------------------------
    def owner(self, session: str | None) -> str | None:
        """The engine that served the session's last turn (where its prefix is cached), or None."""
        return self._owners.get(session) if session is not None else None

    def end_session(self, session: str | None) -> None:
        """Forget a finished session's owner (its next request, if any, is placed as a new session's)."""
        if session is not None:
            self._owners.pop(session, None)

    def record_answer(self, url: str, prompt_tokens: int, cached_tokens: int, *, owner_turn: bool = False,
                      stale_prefix: bool | None = False) -> None:
        """What ``url`` reported of one answer: its prompt tokens and the tokens it reused from its prefix cache
        (SGLang's ``meta_info["cached_tokens"]``); ``owner_turn``: placed on the session's owner;
        ``stale_prefix``: the reused prefix was computed by another weight version than the one that answered
        (None: the engine did not say)."""
        engine = self._engines.get(url)
        if engine is not None:
            engine.prompt_tokens += int(prompt_tokens)
            engine.cached_tokens += int(cached_tokens)
        self._answers += 1
        if owner_turn:
            self._owner_cached += int(cached_tokens)
        if stale_prefix is None:
            self._unreported += 1
        elif stale_prefix:
            self._stale_prefix += 1

    # -- counts ------------------------------------------------------------------------------------------------
    def take_stats(self) -> dict[str, float]:
        """Counts since the previous call (``rollout/cosched_*`` keys), and a new window."""
        now = self._clock()
        window = max(now - self._window_start, 1e-9)
        out: dict[str, float] = {}
        busy = []
        for i, engine in enumerate(self._engines.values()):
            self._account(engine, now)
            out[f"rollout/cosched_engine{i}_dispatched"] = float(engine.dispatched)
            out[f"rollout/cosched_engine{i}_busy_fraction"] = engine.busy_s / window
            out[f"rollout/cosched_engine{i}_slot_use"] = engine.slot_s / (window * engine.budget)
            out[f"rollout/cosched_engine{i}_budget"] = float(engine.budget)
            out[f"rollout/cosched_engine{i}_prompt_tokens"] = float(engine.prompt_tokens)
            out[f"rollout/cosched_engine{i}_cached_tokens"] = float(engine.cached_tokens)
            busy.append(engine.busy_s / window)
            engine.dispatched, engine.busy_s, engine.slot_s = 0, 0.0, 0.0
            engine.prompt_tokens = engine.cached_tokens = 0
        waits = self._waits
        out["rollout/cosched_requests"] = float(len(waits))
        out["rollout/cosched_queue_wait_mean_s"] = sum(waits) / len(waits) if waits else 0.0
        out["rollout/cosched_queue_wait_max_s"] = max(waits) if waits else 0.0
        out["rollout/cosched_moves"] = float(self._moves)
        out["rollout/cosched_session_turns"] = float(self._session_turns)
        out["rollout/cosched_owner_turns"] = float(self._owner_turns)
        out["rollout/cosched_busy_fraction_min"] = min(busy) if busy else 0.0
        out["rollout/cosched_answers"] = float(self._answers)
        out["rollout/cosched_owner_cached_tokens"] = float(self._owner_cached)
        out["rollout/cosched_stale_prefix_answers"] = float(self._stale_prefix)
        out["rollout/cosched_prefix_version_unreported"] = float(self._unreported)
        out["rollout/cosched_oversized"] = float(self._oversized)
        self._waits, self._moves, self._window_start = [], 0, now
        self._session_turns = self._owner_turns = self._answers = self._owner_cached = 0
        self._stale_prefix = self._unreported = self._oversized = 0
        return out
