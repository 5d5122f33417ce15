"""Step beacons published when the device reaches them, not when the host queues the work.

On an accelerator the host only queues a step's kernels and runs ahead until the end-of-step wait
(:mod:`disttrain.trainer.completion`), so every rank's host reaches the beacon point of a step in time even when its
GPU is slow or stuck, and the job agent's stall rule (``trainer/agent/stalls.py``) would see no rank behind. A
:class:`BeaconSender` records a device event where the beacon belongs and publishes the beacon from a thread of its
own once the event completed: the beacon's time is when the device got there. The training thread never waits: the
queue is bounded and drops its oldest beacon when full (a newer beacon of the same rank overwrites it in the store
anyway). On the CPU the work is done when the call returns, and the beacon is published at once.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Optional, Protocol

import torch

log = logging.getLogger("disttrain.trainer")

CAPACITY = 4
"""Beacons waiting for their device: the end-of-step wait keeps a host at most one step ahead, so more than one or
two waiting means a stuck device, and only the newest matters."""
POLL_S = 0.01
"""How often the thread asks a waiting event whether the device reached it: far finer than the stall rule's
seconds, and only while a beacon waits."""
STOP_JOIN_S = 2.0


class DeviceMark(Protocol):
    """What a beacon needs of a device event (``torch.Event``): mark the stream's position, ask if it was reached."""

    def record(self) -> None: ...

    def query(self) -> bool: ...


Render = Callable[[float], str]
"""Builds a beacon's value from the time the device reached it."""


class BeaconSender:
    """Publishes ``(key, value)`` beacons once the device reached the point where each was sent (in order)."""

    def __init__(
        self,
        publish: Callable[[str, str], None],
        make_event: Optional[Callable[[], DeviceMark]],
        capacity: int = CAPACITY,
        poll_s: float = POLL_S,
    ) -> None:
        """``make_event``: one device event per beacon (None: the CPU, publish at once)."""
        self._publish = publish
        self._make_event = make_event
        self._poll_s = poll_s
        self._waiting: collections.deque[tuple[DeviceMark, str, Render]] = collections.deque(maxlen=capacity)
        self._wake = threading.Condition()
        self._stopped = False
        self._thread: Optional[threading.Thread] = None
        self.dropped = 0
        """Beacons dropped unpublished because the queue was full (their device never caught up)."""

    def send(self, key: str, render: Render) -> None:
        """Publish ``render(t)`` under ``key`` once the device reached this point of its stream, ``t`` being then."""
        if self._make_event is None:
            self._publish(key, render(time.time()))
            return
        event = self._make_event()
        event.record()
        with self._wake:
            if self._stopped:
                return
            if len(self._waiting) == self._waiting.maxlen:
                self.dropped += 1
            self._waiting.append((event, key, render))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="disttrain-beacons", daemon=True)
                self._thread.start()
            self._wake.notify()

    def stop(self, join_s: float = STOP_JOIN_S) -> None:
        """Stop publishing; beacons still waiting for their device are dropped (the process is leaving its group)."""
        with self._wake:
            self._stopped = True
            self._waiting.clear()
            self._wake.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_s)

    @property
    def waiting(self) -> int:
        """Beacons whose device has not reached them yet."""
        with self._wake:
            return len(self._waiting)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                event, key, render = self._waiting[0]
            try:
                reached = event.query()
            except Exception as exc:  # noqa: BLE001 - a broken device: the beacon is never reached
                log.debug("beacon %s dropped: its event failed (%s)", key, exc)
                reached = None
            if reached is False:
                with self._wake:
                    self._wake.wait(self._poll_s)
                continue
            with self._wake:
                if self._waiting and self._waiting[0][0] is event:
                    self._waiting.popleft()
                if self._stopped:
                    return
            if reached:
                self._publish(key, render(time.time()))


def for_device(device: torch.device, publish: Callable[[str, str], None]) -> BeaconSender:
    """The sender for the trainer's device: events on the current stream of an accelerator, none on the CPU."""
    if device.type == "cpu":
        return BeaconSender(publish, None)
    return BeaconSender(publish, lambda: torch.Event(device=device))
