"""Weight versions that are acknowledged, not assumed: an all-or-none switch of every rollout engine.

slime's disk weight update (``RayTrainGroup._reload_rollout_weights_from_disk``) pauses the engines,
asks each to load the new version, and resumes them; it reads the versions back only under
``--ci-test``, and an engine that fails leaves the others on the new version. Here the switch is
shard -> ... -> send -> **atomic switch -> acknowledge**:

1. pause every engine and flush its cache;
2. ask every engine to load ``version`` from ``model_path``;
3. read back the version each engine now serves (``/get_weight_version``): every engine must report
   ``version``;
4. on any failure (an engine raised, answered ``success: false``, or serves another version) every
   engine is sent back to the previous acknowledged version (its checkpoint is kept on disk until the
   next version is acknowledged) and the versions are read back again; the update then fails with
   one line naming each engine and what it said;
5. resume generation (in every case), and publish the acknowledged version
   (:mod:`slime_ascend.weight_sync.served_version`), which ``staleness`` takes as the trainer's version.

Every engine answer is waited for at most a deadline (``ascend_weight_update_deadline_s``,
:data:`WEIGHT_UPDATE_DEADLINE`): an engine that never answers (or cannot be paused) is left out of the
rest of the switch, the others are sent back and resumed, the version is not acknowledged, and the
error names the silent engine. Nothing waits for ever.

Engines are Ray actor handles of slime's ``SGLangEngine`` (``pause_generation``, ``flush_cache``,
``update_weights_from_disk``, ``get_weight_version``, ``continue_generation``); ``get`` is ``ray.get``.
No slime or Ray import here: the runtime patch ``driver.acknowledged_weight_update`` adapts slime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..plugins.settings import Setting

logger = logging.getLogger(__name__)

# how long the switch waits for each engine answer (pause, flush, load, read-back, resume); a load from disk of
# a large checkpoint takes minutes, so the default is generous
WEIGHT_UPDATE_DEADLINE = Setting(
    "ascend_weight_update_deadline_s", float, 600.0, minimum=1.0,
    help="seconds a disk weight update waits for each rollout engine's answer (pause, load, read-back, resume); "
         "an engine that misses it is left out, the others go back to the acknowledged version and resume, "
         "and the update fails naming it")


class WeightUpdateError(RuntimeError):
    """An engine did not switch to the new version; every engine is back on the previous one."""


@dataclasses.dataclass(frozen=True)
class Served:
    """A version every engine acknowledged, and where its weights are on disk (for a roll-back)."""

    version: str
    model_path: str


def _one_line(exc: BaseException) -> str:
    """The cause of an engine's failure in one line: a Ray task error's original exception, and for an
    HTTP error the engine's own ``error``/``message`` (not the traceback around it)."""
    seen = 0
    while getattr(exc, "cause", None) is not None and seen < 5:  # ray.exceptions.RayTaskError
        exc, seen = exc.cause, seen + 1
    response = getattr(exc, "response", None)
    text = ""
    if response is not None:
        try:
            body = response.json()
            text = f"HTTP {response.status_code}: {body.get('error') or body.get('message') or body}"
        except Exception:  # noqa: BLE001 - not JSON
            text = f"HTTP {getattr(response, 'status_code', '?')}: {getattr(response, 'text', '')}"
    text = " ".join((text or str(exc)).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# what an engine that does not answer within the deadline is said to have done (and is then left alone: its
# Ray actor is still inside the call, so anything else sent to it would only queue behind it)
_SILENT = "no answer to {call} within {deadline:g} s"


class _Calls:
    """Engine calls with a deadline: each call's answer is waited for at most ``deadline_s`` (None: for ever),
    and an engine that misses it is *silent* from then on (not called again, except a last ``continue``
    sent without waiting). ``get(ref)`` or ``get(ref, timeout=s)`` is ``ray.get``; a timeout is a
    ``TimeoutError`` (Ray's ``GetTimeoutError`` is one)."""

    def __init__(self, engines: Sequence[Any], get: Callable, deadline_s: float | None):
        self.engines, self.get, self.deadline_s = engines, get, deadline_s
        self.silent: dict[int, str] = {}

    def answering(self, which: Iterable[int]) -> list[int]:
        return [i for i in which if i not in self.silent]

    def call(self, which: Iterable[int], name: str, **kwargs: Any) -> tuple[dict[int, Any], dict[int, str]]:
        """``engine.name.remote(**kwargs)`` on the answering engines of ``which``, all sent before any is waited
        for; ``({index: answer}, {index: what went wrong})`` (a silent engine is in both the second dict and
        :attr:`silent`)."""
        refs = {i: getattr(self.engines[i], name).remote(**kwargs) for i in self.answering(which)}
        end = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        answers: dict[int, Any] = {}
        failed: dict[int, str] = {}
        for i, ref in refs.items():
            try:
                if end is None:
                    answers[i] = self.get(ref)
                else:
                    answers[i] = self.get(ref, timeout=max(0.0, end - time.monotonic()))
            except TimeoutError:
                failed[i] = self.silent[i] = _SILENT.format(call=name, deadline=self.deadline_s)
            except Exception as exc:  # noqa: BLE001 - an engine's failure is reported, with the others'
                failed[i] = f"{name}: {_one_line(exc)}" if name != "update_weights_from_disk" else _one_line(exc)
        return answers, failed

    def load(self, which: Iterable[int], model_path: str, version: str) -> dict[int, str]:
        """Ask engines ``which`` to load; ``{engine index: what went wrong}`` for those that did not."""
        answers, failed = self.call(which, "update_weights_from_disk", model_path=model_path, weight_version=version)
        for i, answer in answers.items():
            if isinstance(answer, dict) and answer.get("success") is False:
                failed[i] = _one_line(Exception(answer.get("message") or answer.get("error") or answer))
        return failed

    def not_serving(self, which: Iterable[int], version: str) -> dict[int, str]:
        answers, failed = self.call(which, "get_weight_version")
        out = {i: why if i in self.silent else f"no version read back ({why.removeprefix('get_weight_version: ')})"
               for i, why in failed.items()}
        out.update({i: f"serves version {served}" for i, served in answers.items() if str(served) != str(version)})
        return out

    def resume(self, which: Iterable[int]) -> dict[int, str]:
        """``continue_generation`` on ``which``: waited for on the answering engines; a silent one is sent it
        without waiting (it resumes if it ever finishes the call it is stuck in)."""
        which = list(which)
        for i in which:
            if i in self.silent:
                with contextlib.suppress(Exception):
                    self.engines[i].continue_generation.remote()
        return self.call(which, "continue_generation")[1]


def _engines(which: Iterable[int]) -> str:
    which = sorted(which)
    return ("engine " if len(which) == 1 else "engines ") + ", ".join(str(i) for i in which)


def require_serving(engines: Sequence[Any], get: Callable, version: str, deadline_s: float | None = None) -> None:
    """Raise :class:`WeightUpdateError` unless every engine reports serving ``version`` (each answer waited for
    at most ``deadline_s``)."""
    wrong = _Calls(engines, get, deadline_s).not_serving(range(len(engines)), str(version))
    if wrong:
        raise WeightUpdateError(f"weight version {version} not served by every engine: "
                                + "; ".join(f"engine {i}: {w}" for i, w in sorted(wrong.items())))


def switch_all_or_none(
    engines: Sequence[Any], get: Callable, model_path: str, version: str, previous: Served | None,
    deadline_s: float | None = None,
) -> Served:
    """Switch every engine to ``version`` (from ``model_path``), acknowledged, or none of them.

    Returns the acknowledged :class:`Served`. On a failure the engines that no longer serve ``previous``
    (those that loaded the new version; an engine that refused a load keeps its weights) are sent back to
    it, every engine's version is read back, and :class:`WeightUpdateError` is raised; generation is
    resumed either way.

    Every answer is waited for at most ``deadline_s`` (None: for ever). An engine that misses it (or that
    cannot even be paused) is left out of the rest of the switch: the others are switched back and resumed,
    the new version is not acknowledged, and the error names it."""
    version = str(version)
    calls = _Calls(engines, get, deadline_s)
    everyone = range(len(engines))
    failed: dict[int, str] = {}
    paused: list[int] = []
    try:
        paused_answers, unpaused = calls.call(everyone, "pause_generation")
        paused = sorted(paused_answers)
        failed.update(unpaused)
        _, unflushed = calls.call(paused, "flush_cache")
        failed.update(unflushed)
        ready = [i for i in paused if i not in failed]
        failed.update(calls.load(ready, model_path, version))
        failed.update(calls.not_serving([i for i in ready if i not in failed], version))
        if not failed:
            logger.info("weight version %s acknowledged by every engine (%d)", version, len(engines))
            return Served(version, model_path)
        what = "; ".join(f"engine {i}: {why}" for i, why in sorted(failed.items()))
        if previous is None:
            raise WeightUpdateError(f"weight version {version} was not taken by every engine ({what}), and there is "
                                    "no acknowledged earlier version to return them to")
        # left out: engines that did not answer in time, or could not be paused (never asked to load)
        left_out = sorted(set(calls.silent) | set(unpaused))
        reachable = [i for i in paused if i not in calls.silent]
        moved = sorted(calls.not_serving(reachable, previous.version))
        back = calls.load(moved, previous.model_path, previous.version) or calls.not_serving(
            [i for i in reachable if i not in calls.silent], previous.version)
        if back:
            raise WeightUpdateError(
                f"weight version {version} was not taken by every engine ({what}); returning them to version "
                f"{previous.version} failed too (" + "; ".join(f"engine {i}: {w}" for i, w in sorted(back.items()))
                + "). The engines serve mixed versions: restart them")
        if left_out:
            others = [i for i in everyone if i not in left_out]
            raise WeightUpdateError(
                f"weight version {version} was not taken by every engine ({what}); "
                + (f"{_engines(others)} back on version {previous.version} and generating; " if others else "")
                + f"{_engines(left_out)} did not answer and {'is' if len(left_out) == 1 else 'are'} not acknowledged "
                f"on any version. Fix: restart {_engines(left_out)} (or look at {'its' if len(left_out) == 1 else 'their'} "
                "log) before training on")
        raise WeightUpdateError(f"weight version {version} was not taken by every engine ({what}); every engine is "
                                f"back on version {previous.version}. Fix: look at that engine's log")
    finally:
        unresumed = calls.resume(sorted(set(paused) | set(calls.silent)))
        if unresumed and sys.exc_info()[0] is None:  # switched, but an engine stays paused: not a success
            raise WeightUpdateError(
                f"weight version {version} was acknowledged, but generation did not resume on "
                + "; ".join(f"engine {i}: {why}" for i, why in sorted(unresumed.items()))
                + ". Fix: look at that engine's log, or restart it")


def initial_served(engines: Sequence[Any], get: Callable, model_path: str,
                   deadline_s: float | None = None) -> Served | None:
    """What the engines serve before the first update (all the same version, from ``model_path``:
    the checkpoint slime started them on), or None when they disagree or one does not answer in time."""
    answers, failed = _Calls(engines, get, deadline_s).call(range(len(engines)), "get_weight_version")
    versions = {str(v) for v in answers.values()}
    return Served(versions.pop(), model_path) if len(versions) == 1 and not failed else None
