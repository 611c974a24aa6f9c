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

Engines are Ray actor handles of slime's ``SGLangEngine`` (``pause_generation``, ``flush_cache``,
``update_weights_from_disk``, ``get_weight_version``, ``continue_generation``); ``get`` is ``ray.get``.
No slime or Ray import here: the runtime patch ``driver.acknowledged_weight_update`` adapts slime.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


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


def _load(engines: Sequence[Any], which: Sequence[int], get: Callable, model_path: str, version: str) -> dict[int, str]:
    """Ask engines ``which`` to load; ``{engine index: what went wrong}`` for those that did not."""
    refs = {i: engines[i].update_weights_from_disk.remote(model_path=model_path, weight_version=version) for i in which}
    failed: dict[int, str] = {}
    for i, ref in refs.items():
        try:
            answer = get(ref)
        except Exception as exc:  # noqa: BLE001 - an engine's failure is reported, with the others'
            failed[i] = _one_line(exc)
            continue
        if isinstance(answer, dict) and answer.get("success") is False:
            failed[i] = _one_line(Exception(answer.get("message") or answer.get("error") or answer))
    return failed


def _not_serving(engines: Sequence[Any], get: Callable, version: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for i, engine in enumerate(engines):
        try:
            served = get(engine.get_weight_version.remote())
        except Exception as exc:  # noqa: BLE001
            out[i] = f"no version read back ({_one_line(exc)})"
            continue
        if str(served) != str(version):
            out[i] = f"serves version {served}"
    return out


def require_serving(engines: Sequence[Any], get: Callable, version: str) -> None:
    """Raise :class:`WeightUpdateError` unless every engine reports serving ``version``."""
    wrong = _not_serving(engines, get, str(version))
    if wrong:
        raise WeightUpdateError(f"weight version {version} not served by every engine: "
                                + "; ".join(f"engine {i}: {w}" for i, w in sorted(wrong.items())))


def switch_all_or_none(
    engines: Sequence[Any], get: Callable, model_path: str, version: str, previous: Served | None,
) -> Served:
    """Switch every engine to ``version`` (from ``model_path``), acknowledged, or none of them.

    Returns the acknowledged :class:`Served`. On a failure the engines that no longer serve ``previous``
    (those that loaded the new version; an engine that refused a load keeps its weights) are sent back to
    it, every engine's version is read back, and :class:`WeightUpdateError` is raised; generation is
    resumed either way."""
    version = str(version)
    everyone = range(len(engines))
    get([engine.pause_generation.remote() for engine in engines])
    try:
        get([engine.flush_cache.remote() for engine in engines])
        failed = _load(engines, everyone, get, model_path, version) or _not_serving(engines, get, version)
        if not failed:
            logger.info("weight version %s acknowledged by every engine (%d)", version, len(engines))
            return Served(version, model_path)
        what = "; ".join(f"engine {i}: {why}" for i, why in sorted(failed.items()))
        if previous is None:
            raise WeightUpdateError(f"weight version {version} was not taken by every engine ({what}), and there is "
                                    "no acknowledged earlier version to return them to")
        moved = sorted(_not_serving(engines, get, previous.version))
        back = _load(engines, moved, get, previous.model_path, previous.version) or _not_serving(
            engines, get, previous.version)
        if back:
            raise WeightUpdateError(
                f"weight version {version} was not taken by every engine ({what}); returning them to version "
                f"{previous.version} failed too (" + "; ".join(f"engine {i}: {w}" for i, w in sorted(back.items()))
                + "). The engines serve mixed versions: restart them")
        raise WeightUpdateError(f"weight version {version} was not taken by every engine ({what}); every engine is "
                                f"back on version {previous.version}. Fix: look at that engine's log")
    finally:
        get([engine.continue_generation.remote() for engine in engines])


def initial_served(engines: Sequence[Any], get: Callable, model_path: str) -> Served | None:
    """What the engines serve before the first update (all the same version, from ``model_path``:
    the checkpoint slime started them on), or None when they disagree."""
    versions = {str(get(engine.get_weight_version.remote())) for engine in engines}
    return Served(versions.pop(), model_path) if len(versions) == 1 else None
