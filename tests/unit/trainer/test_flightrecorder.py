"""A group re-formed in place (its NCCL uid is not 0, so torch's monitor never dumps for it) still gets its
flight-recorder dump: once torch's dump signal is in the group's store, the trace goes to torch's own file name.

The store is a real c10d TCPStore under the same PrefixStore layers torch puts around a group's store; the trace is
given (this CPU build of torch keeps no NCCL flight recorder)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from disttrain.trainer import context, flightrecorder

TRACE = b"\x80\x04pickled flight recorder"


@pytest.fixture
def tcp_store():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    yield store
    del store


def group_store(tcp_store):
    """The default group's store as torch layers it (``default_pg``, the group name, the device)."""
    return dist.PrefixStore("cuda/", dist.PrefixStore("0/", dist.PrefixStore("default_pg", tcp_store)))


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_only_the_first_nccl_group_of_a_process_is_dumped_by_torch():
    assert flightrecorder.torch_dumps(0)
    assert not flightrecorder.torch_dumps(1) and not flightrecorder.torch_dumps(7)


def test_the_dump_file_is_torchs_prefix_and_the_global_rank():
    environ = {"TORCH_FR_DUMP_TEMP_FILE": "/ckpt/flight-recorder/node-1/nccl_trace_rank_"}
    assert flightrecorder.dump_file(environ, 5) == "/ckpt/flight-recorder/node-1/nccl_trace_rank_5"
    assert flightrecorder.dump_file({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/t_"}, 2) == "/x/t_2"
    assert flightrecorder.dump_file({}, 3).endswith("nccl_trace_rank_3")


def test_a_reformed_group_writes_the_trace_once_the_dump_signal_is_in_its_store(tmp_path, tcp_store):
    path = str(tmp_path / "nccl_trace_rank_4")
    watch = flightrecorder.DumpWatch(
        flightrecorder.underlying_store(group_store(tcp_store)), path, trace=lambda: TRACE, poll_s=0.01
    ).start()
    try:
        time.sleep(0.1)
        assert not (tmp_path / "nccl_trace_rank_4").exists(), "no signal, no dump"
        tcp_store.set(flightrecorder.DUMP_SIGNAL_KEY, (2).to_bytes(4, "little", signed=True))  # as a watchdog does
        assert wait_until(lambda: watch.dumped_to == path)
        assert (tmp_path / "nccl_trace_rank_4").read_bytes() == TRACE
        assert wait_until(lambda: not watch.running), "one dump per group"
    finally:
        watch.stop()


def test_a_new_group_stops_the_watch_of_the_one_before(tmp_path, tcp_store):
    first = flightrecorder.DumpWatch(tcp_store, str(tmp_path / "a"), trace=lambda: TRACE, poll_s=0.01).start()
    second = flightrecorder.DumpWatch(tcp_store, str(tmp_path / "b"), trace=lambda: TRACE, poll_s=0.01).start()
    try:
        assert wait_until(lambda: not first.running) and second.running
        tcp_store.set(flightrecorder.DUMP_SIGNAL_KEY, (0).to_bytes(4, "little", signed=True))
        assert wait_until(lambda: second.dumped_to is not None)
        assert first.dumped_to is None and not (tmp_path / "a").exists()
    finally:
        second.stop()


def test_a_store_that_is_gone_ends_the_watch(tmp_path):
    class Gone:
        def check(self, keys):
            raise dist.DistNetworkError("Connection reset by peer")

        def get(self, key):
            raise dist.DistNetworkError("Connection reset by peer")

    watch = flightrecorder.DumpWatch(Gone(), str(tmp_path / "x"), trace=lambda: TRACE, poll_s=0.01).start()
    assert wait_until(lambda: not watch.running)
    assert watch.dumped_to is None


@pytest.mark.parametrize(
    "uid,environ",
    [
        (0, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}),  # torch's own monitor dumps
        (None, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}),  # not an NCCL group
        (3, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}),  # the user turned dumps off
        (3, {}),
    ],
)
def test_no_watch_where_torch_dumps_itself_or_dumps_are_off(uid, environ, tcp_store):
    assert flightrecorder.watch_reformed_group(environ, 0, uid, tcp_store) is None


def test_a_reformed_nccl_group_with_dumps_on_is_watched_on_its_underlying_store(tmp_path, tcp_store):
    environ = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "nccl_trace_rank_")}
    watch = flightrecorder.watch_reformed_group(environ, 6, 4, group_store(tcp_store))
    assert watch is not None
    try:
        assert watch.path == str(tmp_path / "nccl_trace_rank_6")
        assert watch.store is not None and not hasattr(watch.store, "underlying_store")
    finally:
        watch.stop()


def test_a_gloo_group_has_no_nccl_uid(one_process_group):
    assert context.nccl_uid(torch.device("cuda", 0)) is None


def test_stopping_the_current_watch_ends_it_and_forgets_it(tmp_path, tcp_store):
    watch = flightrecorder.DumpWatch(tcp_store, str(tmp_path / "a"), trace=lambda: TRACE, poll_s=0.01).start()
    flightrecorder.DumpWatch.stop_current()
    assert not watch.running and flightrecorder.DumpWatch._current is None
