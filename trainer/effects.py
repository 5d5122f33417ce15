"""Side effects carried out once per committed step: declared in a step, recorded with its checkpoint, run after.

A training script registers named handlers (``effects={"upload": upload}``; functions cannot be checkpointed) and
declares an effect with a small JSON payload during a step (:meth:`~disttrain.trainer.loop.ElasticTrainer.
declare_effect`). The declaration is recorded in the ``COMPLETE.json`` of the checkpoint that covers that step
(:attr:`~disttrain.api.manifest.CheckpointManifest.effects`), so it exists exactly when that commit does. After the
commit, global rank 0 calls the handler with the effect's key ``<run id>/<step>/<name>`` and, once it returns,
writes a confirmation (fsync'd) under ``<checkpoint dir>/effects/``. A run that resumes carries out what the newest
commit recorded and no confirmation covers; each checkpoint records every effect still unconfirmed when it is saved,
so nothing a commit once held is dropped by a later one.

What a handler may rely on: it is called again, with the same key, only when no confirmation was written (the
process died between the handler and the confirmation, or the handler raised); a downstream system that refuses a
key it has seen makes the effect exactly once. Effects declared in steps no commit covers die with the run and are
declared again when those steps are redone. A failing handler is logged, counted and retried at the next step
boundary; a name without a handler (the script changed) stays recorded until a run registers it.

Called by the loop (declare, carry out at step boundaries and after the last commit) and by
:mod:`disttrain.trainer.snapshots` (what a checkpoint records, what a resume owes). Never imports the loop.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import stat
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import prometheus_client as prom
import pydantic

from disttrain.api.manifest import EFFECT_NAME_PATTERN, MAX_EFFECTS, CheckpointManifest, EffectRecord
from disttrain.trainer.checkpoint import commit

log = logging.getLogger("disttrain.trainer")

Handler = Callable[[str, dict[str, Any]], None]
"""``handler(key, payload)``: carries out one effect; raising means "not done" (retried with the same key)."""

CONFIRMED_DIR = "effects"
"""Under the checkpoint directory: one confirmation file per effect carried out."""
MAX_PAYLOAD_BYTES = 4096
"""Largest JSON payload of one declaration: a pointer to what to upload, a few metrics, never the data itself."""
MAX_CONFIRMATION_BYTES = 4096
_NAME = re.compile(EFFECT_NAME_PATTERN)


class Confirmation(pydantic.BaseModel):
    """The file that says an effect was carried out (read back from a hostile volume: JSON, checked)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    key: str
    confirmed_at: str


def effect_key(run_id: str, step: int, name: str) -> str:
    """The key a handler receives: who declared the effect (the run), at which global step, under which name."""
    return f"{run_id or 'run'}/{step}/{name}"


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"effect name {name!r} is not allowed: lower-case letters, digits, '_', '.', '-', at most 63 characters, "
            "starting with a letter or digit"
        )


def make_record(name: str, payload: Mapping[str, Any], step: int, run_id: str) -> EffectRecord:
    """A declaration, checked now (in the user's step) rather than at the commit: JSON only, bounded."""
    check_name(name)
    try:
        text = json.dumps(dict(payload), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"effect {name!r}: the payload must be a JSON object of plain values ({exc})") from None
    if len(text.encode()) > MAX_PAYLOAD_BYTES:
        raise ValueError(
            f"effect {name!r}: the payload is {len(text.encode())} bytes of JSON, at most {MAX_PAYLOAD_BYTES} are "
            "recorded with a checkpoint; pass a reference (a path, an id) instead of the data"
        )
    return EffectRecord(name=name, step=step, key=effect_key(run_id, step, name), payload=json.loads(text))


def merge(first: Iterable[EffectRecord], then: Iterable[EffectRecord]) -> list[EffectRecord]:
    """One record per (step, name), in (step, first seen) order; a later record of the same effect replaces an
    earlier one (a step redone after an in-place reform declares again)."""
    out: dict[tuple[int, str], EffectRecord] = {}
    for r in (*first, *then):
        out.pop((r.step, r.name), None)
        out[(r.step, r.name)] = r
    return sorted(out.values(), key=lambda r: r.step)


class Confirmations:
    """The durable "carried out" marks under ``<root>/effects/``: ``<step>-<name>.json`` holding the key.

    Links are never followed; a mark that does not parse does not count (the effect is carried out again, with
    its key)."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / CONFIRMED_DIR

    def path(self, record: EffectRecord) -> Path:
        return self.dir / f"{record.step}-{record.name}.json"

    def is_confirmed(self, record: EffectRecord) -> bool:
        """A mark for the record's (step, name), whichever run wrote it: once per step, even when the step was
        redone by another run after a fallback to an older checkpoint."""
        try:
            data = commit.read_regular(self.path(record), MAX_CONFIRMATION_BYTES)
            mark = Confirmation.model_validate_json(data)
        except FileNotFoundError:
            return False
        except (OSError, pydantic.ValidationError, ValueError) as exc:
            log.warning("effect %s: confirmation %s is not usable (%s)", record.key, self.path(record), exc)
            return False
        if mark.key != record.key:
            log.info("side effect %s: step %d was carried out before as %s", record.key, record.step, mark.key)
        return True

    def confirm(self, record: EffectRecord) -> None:
        """Write the mark atomically and durably: tmp (exclusive, no links) -> fsync -> rename -> dir fsync."""
        self._ensure_dir()
        final = self.path(record)
        tmp = self.dir / f".{final.name}.{uuid.uuid4().hex[:12]}.tmp"
        body = Confirmation(
            key=record.key, confirmed_at=datetime.datetime.now(datetime.timezone.utc).isoformat()
        ).model_dump_json()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, final)
        except BaseException:
            commit.remove_entry(tmp)
            raise
        commit.fsync_path(self.dir)

    def _ensure_dir(self) -> None:
        try:
            mode = os.lstat(self.dir).st_mode
        except FileNotFoundError:
            os.makedirs(self.dir, exist_ok=True)
            commit.fsync_path(self.dir.parent, follow_symlinks=True)
            return
        if not stat.S_ISDIR(mode):
            raise commit.LinkError(
                0, "is not a directory (links in the checkpoint tree are never followed)", str(self.dir)
            )


class EffectMetrics:
    """Effects carried out and handler failures, on the worker's registry."""

    def __init__(self, registry: Optional[prom.CollectorRegistry]) -> None:
        self.carried_out = prom.Counter(
            "disttrain_trainer_effects_carried_out", "Side effects whose handler returned (rank 0)", registry=registry
        )
        self.failures = prom.Counter(
            "disttrain_trainer_effect_failures",
            "Side-effect handler calls that raised or had no handler (retried at the next boundary)",
            registry=registry,
        )
        self.outstanding = prom.Gauge(
            "disttrain_trainer_effects_outstanding",
            "Committed side effects not yet confirmed carried out (rank 0)",
            registry=registry,
        )


class EffectLedger:
    """What is declared, what a commit holds and what is still owed, for one process.

    ``declared``: declarations of steps no commit covers yet. ``due``: effects a commit holds and this process has
    not confirmed (only the runner, global rank 0, keeps them: its manifest is the one written). ``held``: effects
    the resumed commit holds while that commit is not durable (with a bucket, a local copy not COMPLETE in the
    bucket). A save records ``held``, ``due`` and the declarations of the steps it covers (:meth:`record_for`);
    once the loop sees that save durable (:meth:`note_committed`) they become due."""

    def __init__(
        self,
        handlers: Mapping[str, Handler],
        run_id: str,
        root: Path,
        runner: bool,
        metrics: Optional[EffectMetrics] = None,
    ) -> None:
        for name in handlers:
            check_name(name)
        self.handlers = dict(handlers)
        self.run_id = run_id
        self.confirmations = Confirmations(root)
        self.runner = runner
        self.metrics = metrics
        self.declared: list[EffectRecord] = []
        self.due: list[EffectRecord] = []
        self.held: list[EffectRecord] = []
        self._saving: dict[int, list[EffectRecord]] = {}
        self._confirmed: set[tuple[int, str]] = set()
        self._warned: set[str] = set()

    # ---- declare and record -------------------------------------------------------------------------------
    def declare(self, name: str, payload: Mapping[str, Any], step: int) -> str:
        """Declare ``name`` for global ``step`` (the step being run); returns its key."""
        if name not in self.handlers:
            known = ", ".join(sorted(self.handlers)) or "none"
            raise ValueError(
                f"effect {name!r} has no handler: register it with effects={{{name!r}: fn}} (known: {known})"
            )
        record = make_record(name, payload, step, self.run_id)
        declared = merge(self.declared, [record])
        waiting = len(declared) + len(self.due) + len(self.held)
        if waiting > MAX_EFFECTS:
            raise ValueError(
                f"{waiting} side effects would wait for a commit or their handler, at most "
                f"{MAX_EFFECTS} are recorded with a checkpoint: declare them for rare events, or checkpoint more often"
            )
        self.declared = declared
        return record.key

    def record_for(self, step: int) -> list[EffectRecord]:
        """What the checkpoint of ``step`` records (remembered until that save commits or another replaces it)."""
        records = merge(merge(self.held, self.due), [r for r in self.declared if r.step <= step])
        self._saving = {s: v for s, v in self._saving.items() if s < step}
        self._saving[step] = records
        return records

    def note_committed(self, step: Optional[int]) -> None:
        """The newest durable step as the loop sees it (committed on a volume, COMPLETE in the bucket with one): a
        save of that step that this ledger recorded survives losing this node, so its effects become due and their
        declarations leave ``declared``."""
        if step is None or step not in self._saving:
            return
        records = self._saving.pop(step)
        self._saving = {s: v for s, v in self._saving.items() if s > step}
        self.declared = [r for r in self.declared if r.step > step]
        self.held = []  # every save recorded since the resume holds them
        if self.runner:
            self.due = merge(self.due, [r for r in records if (r.step, r.name) not in self._confirmed])
            self._export()

    def restore(self, manifest: Optional[CheckpointManifest], resumed_step: int, durable: bool = True) -> None:
        """After a resume at ``resumed_step`` from ``manifest`` (the newest commit, None: none): declarations of
        steps that will be redone go; what the commit holds and no confirmation covers is due, or, when that commit
        is not ``durable`` (a local copy the bucket does not hold), held until a save that records it is."""
        committed = manifest.step if manifest is not None else 0
        self.declared = [r for r in self.declared if committed < r.step <= resumed_step]
        self._saving.clear()
        self.held = []
        if self.runner and manifest is not None:
            owed = [r for r in manifest.effects if not self._is_confirmed(r)]
            if not durable:
                self.held = owed
                if owed:
                    log.info(
                        "checkpoint step-%d is not in the bucket yet: its %d side effects wait for a save that is",
                        manifest.step,
                        len(owed),
                    )
                return
            self.due = merge(self.due, owed)
            if owed:
                log.info(
                    "checkpoint step-%d holds %d side effects not confirmed carried out: %s",
                    manifest.step,
                    len(owed),
                    ", ".join(r.key for r in owed),
                )
            self._export()

    # ---- carry out ----------------------------------------------------------------------------------------
    def carry_out(self) -> int:
        """Global rank 0: call the handler of every due effect not yet confirmed, confirm each that returns.
        Returns how many were carried out. A failure is logged and counted, and the effect stays due."""
        if not self.runner or not self.due:
            return 0
        done = 0
        still: list[EffectRecord] = []
        for record in self.due:
            if self._is_confirmed(record):
                continue
            handler = self.handlers.get(record.name)
            if handler is None:
                if record.key not in self._warned:
                    log.error("side effect %s has no handler in this script: it stays recorded", record.key)
                    self._warned.add(record.key)
                    self._count_failure()
                still.append(record)
                continue
            try:
                handler(record.key, json.loads(json.dumps(record.payload)))  # a copy the handler may keep
            except Exception as exc:  # noqa: BLE001 - a user's handler; retried with the same key
                log.error("side effect %s failed (retried at the next step boundary): %r", record.key, exc)
                self._count_failure()
                still.append(record)
                continue
            self._confirmed.add((record.step, record.name))
            done += 1
            if self.metrics is not None:
                self.metrics.carried_out.inc()
            try:
                self.confirmations.confirm(record)
            except OSError as exc:
                log.error(
                    "side effect %s was carried out but its confirmation could not be written (%s): a run that "
                    "resumes from this checkpoint calls its handler again, with the same key",
                    record.key,
                    exc,
                )
        self.due = still
        self._export()
        return done

    def _is_confirmed(self, record: EffectRecord) -> bool:
        if (record.step, record.name) in self._confirmed:
            return True
        if self.confirmations.is_confirmed(record):
            self._confirmed.add((record.step, record.name))
            return True
        return False

    def _count_failure(self) -> None:
        if self.metrics is not None:
            self.metrics.failures.inc()

    def _export(self) -> None:
        if self.metrics is not None:
            self.metrics.outstanding.set(len(self.due))
