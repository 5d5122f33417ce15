"""A step beacon goes out when the device reaches it: on an accelerator only after its event completed, in the order
the steps sent them, from a thread that never holds up the training thread; on the CPU at once.

A fake device stands in for the accelerator: its events complete when the test says the device got there.
"""

from __future__ import annotations

import threading
import time
import types

import torch

from disttrain.api import control as keys
from disttrain.trainer import beacons, progress
from disttrain.trainer.control import Watchdog


class FakeDevice:
    """A stream of events that complete only as far as :meth:`reach` moved the device."""

    def __init__(self) -> None:
        self.recorded = 0
        self.reached = 0
        self.lock = threading.Lock()

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def reach(self, position: int) -> None:
        with self.lock:
            self.reached = position


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.position = device, 0

    def record(self) -> None:
        self.device.recorded += 1
        self.position = self.device.recorded

    def query(self) -> bool:
        with self.device.lock:
            return self.device.reached >= self.position


class Published:
    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []
        self.changed = threading.Condition()

    def __call__(self, key: str, value: str) -> None:
        with self.changed:
            self.items.append((key, value))
            self.changed.notify_all()

    def wait_for(self, count: int, timeout_s: float = 10.0) -> list[tuple[str, str]]:
        with self.changed:
            self.changed.wait_for(lambda: len(self.items) >= count, timeout_s)
            return list(self.items)


def render(step: int):
    return lambda at: f"step {step} at {at:.3f}"


def test_a_beacon_is_published_only_after_the_device_reached_it_and_in_order():
    device, published = FakeDevice(), Published()
    sender = beacons.BeaconSender(published, device.event, poll_s=0.001)
    try:
        sent_at = time.time()
        for step in (1, 2, 3):
            sender.send("beacon/0", render(step))
        assert sender.waiting == 3
        time.sleep(0.05)  # the thread polls many times meanwhile: nothing may go out before the device got there
        assert published.items == []
        device.reach(2)
        items = published.wait_for(2)
        assert [value.split(" at ")[0] for _, value in items] == ["step 1", "step 2"]
        assert sender.waiting == 1
        device.reach(3)
        items = published.wait_for(3)
        assert [value.split(" at ")[0] for _, value in items] == ["step 1", "step 2", "step 3"]
        assert all(key == "beacon/0" for key, _ in items)
        assert all(float(value.split(" at ")[1]) >= sent_at for _, value in items)
    finally:
        sender.stop()


def test_a_stuck_device_never_blocks_the_sender_and_only_the_newest_beacons_are_kept():
    device, published = FakeDevice(), Published()
    sender = beacons.BeaconSender(published, device.event, capacity=2, poll_s=0.001)
    try:
        for step in range(1, 6):  # returns at once although the device reaches none of them
            sender.send("beacon/0", render(step))
        assert sender.waiting == 2 and sender.dropped == 3
        device.reach(5)
        items = published.wait_for(2)
        assert [value.split(" at ")[0] for _, value in items] == ["step 4", "step 5"]
    finally:
        sender.stop()


def test_stop_ends_the_thread_and_drops_what_waits():
    device, published = FakeDevice(), Published()
    sender = beacons.BeaconSender(published, device.event, poll_s=0.001)
    sender.send("beacon/0", render(1))
    thread = sender._thread
    assert thread is not None and thread.is_alive()
    sender.stop()
    assert not thread.is_alive()
    device.reach(1)
    sender.send("beacon/0", render(2))
    time.sleep(0.02)
    assert published.items == [] and sender.waiting == 0


def test_a_failed_event_drops_its_beacon_and_the_next_ones_still_go_out():
    device, published = FakeDevice(), Published()

    class Failing(FakeEvent):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    events = iter([Failing(device), FakeEvent(device)])
    sender = beacons.BeaconSender(published, lambda: next(events), poll_s=0.001)
    try:
        sender.send("beacon/0", render(1))
        sender.send("beacon/0", render(2))
        device.reach(2)
        items = published.wait_for(1)
        assert [value.split(" at ")[0] for _, value in items] == ["step 2"]
    finally:
        sender.stop()


def test_on_the_cpu_the_beacon_goes_out_at_once_from_the_calling_thread():
    published = Published()
    sender = beacons.for_device(torch.device("cpu"), published)
    sender.send("beacon/1", render(7))
    assert [key for key, _ in published.items] == ["beacon/1"]
    assert sender._thread is None


def test_an_accelerator_gets_a_device_event_per_beacon():
    assert beacons.for_device(torch.device("cuda", 0), Published())._make_event is not None


class DictStore:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value


def test_the_trainers_beacon_on_the_cpu_is_a_step_beacon_under_the_ranks_key_and_stops_with_the_watchdog():
    watchdog = Watchdog(None)
    watchdog.store = DictStore()  # type: ignore[assignment]
    group = types.SimpleNamespace(
        device=torch.device("cpu"),
        rank=3,
        world_size=4,
        checkpoints=types.SimpleNamespace(local_pending_state=lambda: (None, None)),
    )
    reporter = progress.Reporter(10, watchdog, metrics=None, in_place_fallback=None)  # type: ignore[arg-type]
    reporter.send_beacon(group, 12)  # type: ignore[arg-type]
    beacon = keys.StepBeacon.model_validate_json(watchdog.store.values[keys.beacon_key(3)])
    assert (beacon.step, beacon.rank, beacon.world_size, beacon.saving) == (12, 3, 4, False)
    assert watchdog.beacons is not None
    watchdog.stop()
    assert watchdog.beacons is None
