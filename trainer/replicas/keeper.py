"""The versions of the training state one rank keeps in host memory, and their copy on its partner's node.

After each step that every rank counted, a rank captures its own items (:mod:`.capture`) and sends the items no
other node holds to its partner (:func:`~.catalogue.partner_of`), receiving its source's in turn, in a background
thread on a gloo group of its own. A step is reported only once every rank's copy of it landed (the trainer
waits for :meth:`ReplicaKeeper.wait_replicated` and agrees on it right after the capture), so the newest step any
rank reported is whole in the survivors' memory. Two versions of each are kept: a group that breaks while a step's
copies are in flight may hold that step whole or not, and the newest step whole on every side is then the one
before (:func:`~.catalogue.choose_step`).

Memory, per rank: two host copies of its own shards, plus two of its source's shards where no other node holds
them (FSDP2 and FSDP x TP; HSDP with two or more replicas and DDP need none).

Fault injection (tests only): ``DISTTRAIN_FAULT_SLOW_COPY=<seconds>`` delays each of this process's copies by that
long, so a node killed at any moment of a step is most likely lost while its copy is in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from disttrain.trainer.replicas import capture as capture_mod
from disttrain.trainer.replicas import wire
from disttrain.trainer.replicas.catalogue import Catalogue, ItemKey, ItemSpec, needs_copy, partner_of

log = logging.getLogger("disttrain.trainer")

VERSIONS = 2
"""Versions of each kind a rank keeps (see the module docstring)."""

FAULT_SLOW_COPY = "DISTTRAIN_FAULT_SLOW_COPY"


def injected_copy_delay(environ: Optional[Mapping[str, str]] = None) -> float:
    """The seconds fault injection (:data:`FAULT_SLOW_COPY`) delays each copy by; 0 without it."""
    value = (environ if environ is not None else os.environ).get(FAULT_SLOW_COPY, "").strip()
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        raise ValueError(f"{FAULT_SLOW_COPY}={value!r}: expected a number of seconds") from None


@dataclasses.dataclass
class Version:
    step: int
    values: dict[ItemKey, capture_mod.Value]
    complete: bool = True


class ReplicaKeeper:
    """What one rank of one group holds: its own versions and its source's copies (see the module docstring)."""

    def __init__(self, catalogue: Catalogue, rank: int, group: Optional[dist.ProcessGroup]) -> None:
        self.catalogue = catalogue
        self.rank = rank
        self.group = group
        nodes = [m.node for m in catalogue.members]
        self.partner = partner_of(rank, nodes)
        self.source = next((r for r in range(len(nodes)) if partner_of(r, nodes) == rank), None)
        copies = needs_copy(catalogue)
        specs = catalogue.specs()
        self.sent_keys: list[ItemKey] = sorted(copies.get(rank, [])) if self.partner is not None else []
        self.received_specs: list[ItemSpec] = (
            [specs[k] for k in sorted(copies.get(self.source, []))] if self.source is not None else []
        )
        self.own: list[Version] = []
        self.capturer = capture_mod.Capturer()
        self.copies: list[Version] = []
        self._thread: Optional[threading.Thread] = None
        self._failure: Optional[BaseException] = None
        self._epoch = 0
        """Bumped when the group ends: a copy still in flight then (a receive from a dead peer only ends at its
        timeout) changes nothing when it returns."""

    @property
    def replicates(self) -> bool:
        return bool(self.sent_keys or self.received_specs)

    def copy_bytes(self) -> int:
        """Host bytes of one version of the source's copy (the memory cost beside the own versions)."""
        return sum(capture_mod.nbytes(s) for s in self.received_specs)

    def capture(self, step: int, steady: Callable[[], dict[str, Any]], rest: dict[str, Any]) -> None:
        """Keep this rank's items at ``step`` (the state every rank just counted; ``steady``: the model and optimizer
        state dicts, ``rest``: the others, :class:`~.capture.Capturer`) and start copying them to the partner. Waits
        for the previous copy first (one in flight at a time)."""
        self.wait_replicated()
        reuse = self.own.pop(0) if len(self.own) >= VERSIONS else None
        _, values = self.capturer.capture(steady, rest, into=reuse.values if reuse is not None else None)
        self.own.append(Version(step, values))
        self.start_replication(step, values)

    def start_replication(self, step: int, values: Mapping[ItemKey, capture_mod.Value]) -> None:
        """Copy ``values`` (this rank's items at ``step``) to the partner in the background."""
        if self.replicates and self.group is not None:
            self._failure = None
            self._thread = threading.Thread(
                target=self._replicate, args=(step, values, self._epoch), name="disttrain-replicate", daemon=True
            )
            self._thread.start()

    def _replicate(self, step: int, values: Mapping[ItemKey, capture_mod.Value], epoch: int) -> None:
        try:
            delay = injected_copy_delay()
            if delay:
                time.sleep(delay)
            outgoing = {}
            if self.partner is not None and self.sent_keys:
                tensors = [values[k] for k in self.sent_keys]
                parts = [capture_mod.as_bytes(t) for t in tensors if isinstance(t, torch.Tensor)]
                outgoing[self.partner] = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
            incoming = {}
            if self.source is not None and self.received_specs:
                incoming[self.source] = sum(capture_mod.nbytes(s) for s in self.received_specs)
            received = wire.exchange(outgoing, incoming, self.group)
            if epoch != self._epoch:
                return  # the group ended while this copy was in flight
            if self.source is not None and self.received_specs:
                raw = received[self.source]
                reuse = self.copies.pop(0) if len(self.copies) >= VERSIONS else None
                out: dict[ItemKey, capture_mod.Value] = reuse.values if reuse is not None else {}
                offset = 0
                for spec in self.received_specs:
                    size = capture_mod.nbytes(spec)
                    chunk = raw[offset : offset + size]
                    old = out.get(spec.key)
                    if isinstance(old, torch.Tensor) and old.numel() * old.element_size() == size:
                        if size:
                            old.reshape(-1).view(torch.uint8).copy_(chunk)
                    else:
                        out[spec.key] = capture_mod.from_bytes(chunk, spec)
                    offset += size
                self.copies.append(Version(step, out))
        except BaseException as exc:  # noqa: BLE001 - reported to the training thread at its next gate
            if epoch == self._epoch:
                self._failure = exc

    def wait_replicated(self) -> None:
        """Wait for the copy in flight; raise what it failed with (a peer gone: the group failed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def values_at(self, step: int) -> dict[ItemKey, capture_mod.Value]:
        """Every item this rank holds at ``step`` (its own and its source's copy)."""
        out: dict[ItemKey, capture_mod.Value] = {}
        for version in [*self.copies, *self.own]:
            if version.step == step and version.complete:
                out.update(version.values)
        return out

    def release(self) -> None:
        """Drop every version (after the new group rebuilt its state, or when it fell back to a checkpoint)."""
        self.own, self.copies = [], []

    def detach(self) -> None:
        """The group ended: keep what is held for the next group's recovery. A copy still in flight is not waited
        for (its receive from a dead peer would only end at the collective timeout); whatever it brings is dropped."""
        if self._thread is not None:
            self._thread.join(timeout=0.5)
            if self._thread.is_alive():
                log.info("the in-memory copy in flight is dropped with its group")
        self._epoch += 1
        self._thread, self._failure = None, None
        self.group = None
