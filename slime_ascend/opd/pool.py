"""TeacherPool: one resident teacher, the next one prefetched in the background.

MOPD/GLM-5.3-style dynamic teacher switching. Only the *active* teacher is resident on the
device; the others stay on local disk as safetensors. While the active teacher scores, the next
teacher of the schedule is staged by a background thread (read into pinned host memory when an
accelerator is present, plain host memory on CPU; or, for an external engine, copied to a local
stage directory / read once to warm the page cache). A switch then costs only the hand-over
(host->device copy, an in-memory ``assign`` on CPU, or one ``/update_weights_from_disk`` call).

Memory bound: at most one resident + one prefetched teacher; a new prefetch for a different
teacher discards the old one, and a cold load drops any prefetched teacher first.

Loaders (:class:`~slime_ascend.opd.loaders.TeacherLoader`) adapt the pool to the thing that holds the
weights: :mod:`slime_ascend.opd.loaders` (in-process modules and weight dicts),
:mod:`slime_ascend.opd.engine_loader` (an HTTP teacher engine). Checkpoints are read by
:mod:`slime_ascend.opd.safetensors_dir`; :mod:`slime_ascend.opd.pool_actor` serves a pool from a Ray actor.

Faults: a missing/corrupt checkpoint marks only that teacher ``failed`` (name and path in the
error); the others stay usable. Vocabulary/tokenizer mismatches with the student are refused at
construction. A failed stage is retried once, then reported.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_ascend.opd.compat import check_teacher_compatible
from slime_ascend.opd.loaders import Staged, TeacherLoader
from slime_ascend.opd.teachers import TeacherSpec, parse_teachers

__all__ = ["TeacherLoadError", "TeacherUnavailableError", "SwitchInfo", "TeacherPool"]


class TeacherLoadError(RuntimeError):
    """Staging or activating a teacher failed; names the teacher and its checkpoint path."""

    def __init__(self, name: str, path: Path | str, reason: str, attempts: int = 1) -> None:
        super().__init__(f"teacher {name!r} ({path}): {reason} (after {attempts} attempt(s))")
        self.name, self.path, self.reason, self.attempts = name, str(path), reason, attempts


class TeacherUnavailableError(TeacherLoadError):
    """The teacher was marked failed earlier; the pool refuses it."""


@dataclass
class SwitchInfo:
    """Outcome of :meth:`TeacherPool.activate`."""

    teacher: str
    previous: str | None
    switched: bool
    prefetch: str  # "hit" (staged in time), "late" (waited for the prefetch), "miss" (cold load), "none"
    stall_s: float


@dataclass
class _Slot:
    name: str
    future: Future


class TeacherPool:
    """One resident teacher plus at most one prefetched teacher.

    Args:
        teachers: teacher specs (or raw dicts, parsed with :func:`parse_teachers`).
        loader: the :class:`TeacherLoader` that owns the weights.
        student_vocab_size / student_tokenizer_revision / student_dir: when given, each teacher is
            checked with :func:`check_teacher_compatible` and a mismatch raises at construction.
        compat_check: that check's mode (strict | warn | off) for teachers without their own.
        validate: run ``loader.validate`` per teacher at start (failures mark that teacher failed).
        stage_attempts: attempts per stage (default 2 = retried once).
    """

    def __init__(
        self,
        teachers: Sequence[TeacherSpec | Mapping[str, Any]],
        loader: TeacherLoader,
        *,
        student_vocab_size: int | None = None,
        student_tokenizer_revision: str | None = None,
        student_dir: str | Path | None = None,
        compat_check: str = "strict",
        validate: bool = True,
        stage_attempts: int = 2,
    ) -> None:
        specs = parse_teachers(list(teachers))
        for spec in specs:  # mismatches are configuration errors: refuse the whole pool
            check_teacher_compatible(
                spec,
                student_vocab_size=student_vocab_size,
                student_tokenizer_revision=student_tokenizer_revision,
                student_dir=student_dir,
                mode=compat_check,
            )
        if stage_attempts < 1:
            raise ValueError(f"stage_attempts must be >= 1, got {stage_attempts}")
        self.specs: dict[str, TeacherSpec] = {s.name: s for s in specs}
        self.loader = loader
        self.stage_attempts = stage_attempts
        self._lock = threading.RLock()  # state transitions; may be held while waiting on a prefetch
        self._count_lock = threading.Lock()  # counters and byte totals; never held while waiting
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher-prefetch")
        self._active: str | None = None
        self._slot: _Slot | None = None
        self._schedule: list[str] = []
        self._errors: dict[str, str] = {}
        self._resident_host_bytes = 0
        self._staged_host_bytes = 0
        self._closed = False
        self.counters: dict[str, float] = {
            "switches": 0,
            "stall_s": 0.0,
            "last_stall_s": 0.0,
            "cold_loads": 0,
            "prefetch_hits": 0,
            "prefetch_late": 0,
            "prefetch_misses": 0,
            "prefetch_started": 0,
            "prefetch_discarded": 0,
            "stage_retries": 0,
            "stage_failures": 0,
            "stage_s": 0.0,  # seconds spent staging (reading the checkpoint; on the background thread when prefetched)
            "read_bytes": 0,  # bytes read from the checkpoints to stage them
            "peak_host_bytes": 0,
        }
        if validate:
            for spec in specs:
                try:
                    loader.validate(spec)
                except Exception as e:
                    self._errors[spec.name] = f"invalid checkpoint at {spec.checkpoint_dir}: {e}"

    # ---------------------------------------------------------------- introspection
    @property
    def active(self) -> str | None:
        return self._active

    @property
    def prefetched(self) -> str | None:
        slot = self._slot
        return slot.name if slot is not None else None

    def state(self) -> dict[str, dict[str, Any]]:
        """Per teacher: ``status`` (resident/prefetched/prefetching/on_disk/failed) and ``error``."""
        with self._lock:
            out: dict[str, dict[str, Any]] = {}
            for name, spec in self.specs.items():
                if name in self._errors:
                    status = "failed"
                elif name == self._active:
                    status = "resident"
                elif self._slot is not None and self._slot.name == name:
                    status = "prefetched" if self._slot.future.done() else "prefetching"
                else:
                    status = "on_disk"
                out[name] = {"status": status, "path": str(spec.checkpoint_dir), "error": self._errors.get(name)}
            return out

    def metrics(self) -> dict[str, float]:
        """Counters: switches, stall seconds, prefetch hits/late/misses, retries, peak host bytes."""
        with self._count_lock:
            m = dict(self.counters)
            m["host_bytes"] = self._resident_host_bytes + self._staged_host_bytes
            m["failed_teachers"] = len(self._errors)
            return m

    # ---------------------------------------------------------------- scheduling / prefetch
    def set_schedule(self, names: Sequence[str]) -> None:
        """Declare the upcoming teacher order; prefetches the first one that is not active."""
        for n in names:
            self._spec(n)
        with self._lock:
            self._schedule = list(names)
            self._prefetch_next()

    def prefetch(self, name: str) -> bool:
        """Start staging ``name`` in the background. False if active, failed or already staged.

        A prefetch for another teacher still in the slot is discarded (bound: one prefetched).
        """
        spec = self._spec(name)
        with self._lock:
            if self._closed or name == self._active or name in self._errors:
                return False
            if self._slot is not None:
                if self._slot.name == name:
                    return False
                self._discard_slot()
            fut = self._executor.submit(self._stage_bg, spec)
            self._slot = _Slot(name, fut)
            self._count("prefetch_started")
            return True

    def _prefetch_next(self) -> None:
        for n in self._schedule:
            if n != self._active and n not in self._errors:
                self.prefetch(n)
                return

    def _stage_bg(self, spec: TeacherSpec) -> Staged:
        staged = self._stage_with_retry(spec)
        self._host_bytes(staged.host_bytes)
        return staged

    def _stage_with_retry(self, spec: TeacherSpec) -> Staged:
        last: BaseException | None = None
        for attempt in range(1, self.stage_attempts + 1):
            t0 = time.perf_counter()
            try:
                staged = self.loader.stage(spec)
                self._count("stage_s", time.perf_counter() - t0)
                self._count("read_bytes", staged.read_bytes)
                return staged
            except Exception as e:  # retried, then reported with name and path
                last = e
                if attempt < self.stage_attempts:
                    self._count("stage_retries")
        self._count("stage_failures")
        raise TeacherLoadError(spec.name, spec.checkpoint_dir, f"staging failed: {last}", self.stage_attempts) from last

    def _discard_slot(self) -> None:
        slot, self._slot = self._slot, None
        if slot is None:
            return
        self._count("prefetch_discarded")
        try:
            staged = slot.future.result()
        except Exception:
            return
        self._host_bytes(-staged.host_bytes)
        self.loader.discard(staged)

    def _count(self, key: str, delta: float = 1) -> None:
        with self._count_lock:
            self.counters[key] += delta

    def _host_bytes(self, staged_delta: int = 0, resident: int | None = None) -> None:
        """Add ``staged_delta`` to the staged bytes or set the resident bytes, keeping the peak of their sum."""
        with self._count_lock:
            self._staged_host_bytes += staged_delta
            if resident is not None:
                self._resident_host_bytes = resident
            now = self._resident_host_bytes + self._staged_host_bytes
            self.counters["peak_host_bytes"] = max(self.counters["peak_host_bytes"], now)

    def _spec(self, name: str) -> TeacherSpec:
        try:
            return self.specs[name]
        except KeyError:
            raise KeyError(f"unknown teacher {name!r}; configured: {sorted(self.specs)}") from None

    # ---------------------------------------------------------------- switching
    def activate(self, name: str) -> SwitchInfo:
        """Make ``name`` the resident teacher; then prefetch the next teacher of the schedule.

        Raises :class:`TeacherUnavailableError` for a teacher marked failed, and
        :class:`TeacherLoadError` when staging (after the retry) or activation fails; in both
        cases the teacher is marked failed and the pool stays usable for the others.
        """
        spec = self._spec(name)
        with self._lock:
            if self._closed:
                raise RuntimeError("TeacherPool is closed")
            if name in self._errors:
                raise TeacherUnavailableError(name, spec.checkpoint_dir, self._errors[name])
            prev = self._active
            if name == prev:
                self._advance_schedule(name)
                return SwitchInfo(name, prev, False, "none", 0.0)
            t0 = time.perf_counter()
            try:
                if self._slot is not None and self._slot.name == name:
                    slot, self._slot = self._slot, None
                    kind = "hit" if slot.future.done() else "late"
                    staged = slot.future.result()
                else:
                    kind = "miss"
                    self._discard_slot()  # keep the bound: resident + the one being loaded
                    staged = self._stage_with_retry(spec)
                    self._count("cold_loads")
                    self._host_bytes(staged.host_bytes)
            except TeacherLoadError as e:
                self._errors[name] = e.reason
                self._count("prefetch_misses")
                raise
            # the staged bytes move to "resident" (or are freed) by the activation below
            self._host_bytes(-staged.host_bytes)
            try:
                resident_bytes = self.loader.activate(spec, staged)
            except Exception as e:
                self._errors[name] = f"activation failed: {e}"
                self._active = None  # the previous teacher's weights may be partly overwritten
                self._host_bytes(resident=0)
                raise TeacherLoadError(name, spec.checkpoint_dir, f"activation failed: {e}") from e
            finally:
                if prev is not None:
                    self.loader.release(self.specs[prev])
            garbage = self.loader.take_garbage()
            if garbage is not None:
                self._executor.submit(_drop, garbage)  # runs before the next prefetch (one worker)
                del garbage
            self._active = name
            self._host_bytes(resident=resident_bytes)
            stall = time.perf_counter() - t0
            with self._count_lock:
                c = self.counters
                c["switches"] += 1
                c["stall_s"] += stall
                c["last_stall_s"] = stall
                c[{"hit": "prefetch_hits", "late": "prefetch_late", "miss": "prefetch_misses"}[kind]] += 1
            self._advance_schedule(name)
            return SwitchInfo(name, prev, True, kind, stall)

    def _advance_schedule(self, name: str) -> None:
        if name in self._schedule:
            del self._schedule[: self._schedule.index(name) + 1]
        self._prefetch_next()

    def close(self) -> None:
        """Stop the background thread and drop any prefetched teacher."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._discard_slot()
        self._executor.shutdown(wait=True)
        self.loader.close()

    def __enter__(self) -> TeacherPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _drop(garbage: Any) -> None:
    if isinstance(garbage, (list, dict)):
        garbage.clear()
