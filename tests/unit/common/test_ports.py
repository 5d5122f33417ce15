"""Ports for local stores are chosen where the kernel never hands one out, so a store that died can come back on
its port while every other process binds and connects as it likes."""

import socket
from pathlib import Path

from disttrain.common import ports


def test_a_chosen_port_lies_below_the_ephemeral_range_and_is_free() -> None:
    low, _ = ports.ephemeral_range()
    chosen = {ports.free_port() for _ in range(20)}
    for port in chosen:
        assert ports.CHOSEN_RANGE[0] <= port < min(low, ports.CHOSEN_RANGE[1])
        assert ports.bindable("127.0.0.1", port)
    assert len(chosen) > 1, "every call chose the same port"


def test_a_port_freed_by_its_owner_is_not_taken_by_the_kernels_picks() -> None:
    port = ports.free_port()
    held = []
    try:
        for _ in range(500):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            held.append(sock)
        assert port not in {sock.getsockname()[1] for sock in held}
        assert ports.bindable("127.0.0.1", port)
    finally:
        for sock in held:
            sock.close()


def test_a_listening_port_is_not_bindable() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert not ports.bindable("127.0.0.1", listener.getsockname()[1])


def test_an_unreadable_range_leaves_the_choice_to_the_kernel(tmp_path: Path) -> None:
    assert ports.ephemeral_range(tmp_path / "absent") == (0, 0)
    (tmp_path / "garbled").write_text("not a range")
    assert ports.ephemeral_range(tmp_path / "garbled") == (0, 0)
    (tmp_path / "range").write_text("20000\t60999\n")
    assert ports.ephemeral_range(tmp_path / "range") == (20000, 60999)
