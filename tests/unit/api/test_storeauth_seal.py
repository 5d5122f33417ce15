"""seal/unseal: an envelope verifies only for the key, job and secret it was made for, and nothing else does."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from disttrain.api import storeauth

SECRET, UID, KEY = "s" * 64, "uid-1", "s-abc/torch.rendezvous.run"
VALUE = b"base64-of-a-pickle"


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1 :]


def test_a_sealed_value_unseals_to_its_value_and_seq() -> None:
    raw = storeauth.seal(SECRET, UID, KEY, VALUE, 7)
    assert storeauth.unseal(SECRET, UID, KEY, raw) == storeauth.Sealed(VALUE, 7)
    assert len(raw) == len(VALUE) + storeauth.HEADER_BYTES


def test_an_empty_value_and_the_extreme_seqs_round_trip() -> None:
    for seq in (0, storeauth.SEQ_MAX):
        raw = storeauth.seal(SECRET, UID, KEY, b"", seq)
        assert storeauth.unseal(SECRET, UID, KEY, raw) == storeauth.Sealed(b"", seq)


_RAW = storeauth.seal(SECRET, UID, KEY, VALUE, 7)
INVALID: dict[str, Callable[[], bool]] = {
    "wrong key name": lambda: storeauth.unseal(SECRET, UID, KEY + "x", _RAW) is None,
    "key without its prefix": lambda: storeauth.unseal(SECRET, UID, "torch.rendezvous.run", _RAW) is None,
    "other job uid": lambda: storeauth.unseal(SECRET, "uid-2", KEY, _RAW) is None,
    "empty job uid": lambda: storeauth.unseal(SECRET, "", KEY, _RAW) is None,
    "other secret": lambda: storeauth.unseal("t" * 64, UID, KEY, _RAW) is None,
    "truncated value": lambda: storeauth.unseal(SECRET, UID, KEY, _RAW[:-1]) is None,
    "truncated header": lambda: storeauth.unseal(SECRET, UID, KEY, _RAW[: storeauth.HEADER_BYTES - 1]) is None,
    "empty": lambda: storeauth.unseal(SECRET, UID, KEY, b"") is None,
    "extra byte": lambda: storeauth.unseal(SECRET, UID, KEY, _RAW + b"\0") is None,
    "flipped bit in magic": lambda: storeauth.unseal(SECRET, UID, KEY, _flip(_RAW, 0)) is None,
    "flipped bit in seq": lambda: storeauth.unseal(SECRET, UID, KEY, _flip(_RAW, 11)) is None,
    "flipped bit in mac": lambda: storeauth.unseal(SECRET, UID, KEY, _flip(_RAW, 20)) is None,
    "flipped bit in value": lambda: storeauth.unseal(SECRET, UID, KEY, _flip(_RAW, len(_RAW) - 1)) is None,
    "plain value": lambda: storeauth.unseal(SECRET, UID, KEY, VALUE) is None,
    "8 MiB junk": lambda: storeauth.unseal(SECRET, UID, KEY, os.urandom(8 << 20)) is None,
    "8 MiB junk with the magic": lambda: (
        storeauth.unseal(SECRET, UID, KEY, storeauth.MAGIC + os.urandom(8 << 20)) is None
    ),
    # a job-uid/key boundary shift must not produce the same MAC (length-prefixed fields)
    "uid and key shifted": lambda: storeauth.unseal(SECRET, "uid-1s", "-abc/torch.rendezvous.run", _RAW) is None,
}


@pytest.mark.parametrize("case", sorted(INVALID), ids=sorted(INVALID))
def test_an_envelope_for_anything_else_does_not_unseal(case: str) -> None:
    assert INVALID[case]()


def test_a_replayed_lower_seq_still_verifies_so_the_reader_must_compare_seqs() -> None:
    """unseal is pure: an old value is a valid envelope; the reader's high-water mark refuses it."""
    old = storeauth.unseal(SECRET, UID, KEY, storeauth.seal(SECRET, UID, KEY, b"old", 3))
    new = storeauth.unseal(SECRET, UID, KEY, storeauth.seal(SECRET, UID, KEY, b"new", 4))
    assert old is not None and new is not None and old.seq < new.seq


def test_the_seq_is_authenticated_so_it_cannot_be_raised_by_an_outsider() -> None:
    raw = storeauth.seal(SECRET, UID, KEY, VALUE, 3)
    bumped = raw[:4] + (4).to_bytes(8, "big") + raw[12:]
    assert storeauth.unseal(SECRET, UID, KEY, bumped) is None


@pytest.mark.parametrize("seq", [-1, 2**64], ids=["negative", "too-large"])
def test_a_seq_out_of_range_is_refused_naming_it(seq: int) -> None:
    with pytest.raises(ValueError, match="seq="):
        storeauth.seal(SECRET, UID, KEY, VALUE, seq)


def test_sealing_without_a_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="secret is empty"):
        storeauth.seal("", UID, KEY, VALUE, 1)
