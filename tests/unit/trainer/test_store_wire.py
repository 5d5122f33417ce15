"""The store front's pure parts: the handshake proves the secret on fresh nonces, and the request scanner follows
torch's TCPStore wire (captured from torch 2.13's client) and refuses what must not pass."""

from __future__ import annotations

import struct

import pytest

from disttrain.trainer.store import wire

KEY = wire.front_key("the-jobs-secret")


def _string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


# What torch 2.13's client sends for each call (captured through a byte-logging proxy).
CONNECT = b"\x00\xce\xf7\x85<" + b"\x0d\xc6>\x00\x00"  # validate + ping
SET = b"\x01" + _string(b"/k") + _string(b"v")
COMPARE_SET = b"\x02" + _string(b"/k") + _string(b"v") + _string(b"w")
GET = b"\x06" + struct.pack("<Q", 1) + _string(b"/k") + b"\x03" + _string(b"/k")  # wait, then get
ADD = b"\x04" + _string(b"/n") + struct.pack("<q", 1)
MULTI_SET = b"\x0b" + struct.pack("<Q", 1) + _string(b"/a") + _string(b"b")
OTHERS = b"\x05" + struct.pack("<Q", 1) + _string(b"/k") + b"\x07" + b"\x08" + _string(b"/n") + b"\x0c" + b"\x11"


def test_a_client_with_the_secret_and_the_front_prove_it_to_each_other():
    greeting = wire.greeting()
    answer = wire.answer(KEY, greeting)
    proof = wire.check_answer(KEY, greeting, answer)
    assert proof is not None and wire.check_proof(KEY, greeting, answer, proof)


def test_a_wrong_secret_a_replayed_answer_or_junk_is_refused():
    greeting = wire.greeting()
    assert wire.check_answer(KEY, greeting, wire.answer(wire.front_key("another"), greeting)) is None
    recorded = wire.answer(KEY, greeting)
    assert wire.check_answer(KEY, wire.greeting(), recorded) is None, "an answer to another greeting"
    assert wire.check_answer(KEY, greeting, b"\x00" * wire.ANSWER_LEN) is None
    assert wire.check_answer(KEY, greeting, recorded[:-1]) is None
    with pytest.raises(wire.HandshakeFailed):
        wire.answer(KEY, b"\x00\xce\xf7\x85" + b"\x00" * 32)  # a plain TCPStore server does not greet
    proof = wire.check_answer(KEY, greeting, recorded)
    assert proof is not None
    assert not wire.check_proof(wire.front_key("another"), greeting, recorded, proof)


@pytest.mark.parametrize("chunk", [1, 3, 7, 4096])
def test_the_scanner_follows_every_request_a_job_sends_whatever_the_chunking(chunk):
    stream = CONNECT + SET + COMPARE_SET + GET + ADD + MULTI_SET + OTHERS
    scanner = wire.RequestScanner()
    for at in range(0, len(stream), chunk):
        assert scanner.feed(stream[at : at + chunk]) == len(stream[at : at + chunk])
    assert not scanner.mid_request, "every request ended where torch's did"


def test_the_scanner_knows_a_request_that_has_begun_and_not_ended():
    scanner = wire.RequestScanner()
    scanner.feed(SET[:-1])
    assert scanner.mid_request
    scanner.feed(SET[-1:])
    assert not scanner.mid_request


@pytest.mark.parametrize(
    "request_bytes, reason",
    [
        (b"\x09" + _string(b"/k") + _string(b"x"), "append"),
        (b"\x0e" + _string(b"/q") + _string(b"x"), "queue_push"),
        (b"\x0f" + _string(b"/q"), "queue_pop"),
        (b"\x10" + _string(b"/q"), "queue_len"),
        (b"\x7f", "unknown command 127"),
        (b"\x03" + struct.pack("<Q", wire.MAX_KEY + 1), "a key of 8193 bytes"),
        (b"\x01" + _string(b"/k") + struct.pack("<Q", wire.MAX_PAYLOAD + 1), "a value of 8388609 bytes"),
        (b"\x0a" + struct.pack("<Q", wire.MAX_KEY_COUNT + 1), "1025 keys in one request"),
        (b"\x01" + _string(b"/bad\xff\xfe") + _string(b"x"), "not UTF-8"),
        (b"\x05" + struct.pack("<Q", 2) + _string(b"/ok") + _string(b"/\xc3"), "not UTF-8"),
    ],
)
def test_the_scanner_refuses_queues_appends_and_oversized_requests_before_a_byte_of_them_passes(request_bytes, reason):
    scanner = wire.RequestScanner()
    assert scanner.feed(SET + request_bytes + SET) == len(SET), "the set before it passes, nothing from it on"
    assert scanner.refused is not None and reason in str(scanner.refused)
    assert scanner.feed(SET) == 0, "and it stays refused"
