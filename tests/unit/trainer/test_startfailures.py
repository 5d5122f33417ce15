"""A worker whose group cannot start because its peers are gone re-joins (exit REFORM), a bounded number of times."""

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from disttrain.api.exitcodes import ExitCode
from disttrain.trainer import startfailures

# A real failed start: rank 0 of a world of 2 whose peer never comes, with torchrun's error-file layout.
WORKER = textwrap.dedent(
    """
    import datetime, sys
    import torch.distributed as dist
    from disttrain.trainer import startfailures
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=2,
            timeout=datetime.timedelta(seconds=1),
        )
    except Exception as exc:
        startfailures.exit_if_peers_failed(exc)
        sys.exit(1)
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_worker(error_file: Path) -> int:
    env = {"TORCHELASTIC_ERROR_FILE": str(error_file), "LOCAL_RANK": "0", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", WORKER, str(free_port())], env=env, timeout=120, check=False)
    return done.returncode


def test_a_start_without_its_peers_rejoins_until_the_count_says_it_is_the_users_failure(tmp_path: Path) -> None:
    error_file = tmp_path / "run_1" / "attempt_0" / "0" / "error.json"
    assert start_worker(error_file) == int(ExitCode.REFORM)
    counter = startfailures.counter_path({"TORCHELASTIC_ERROR_FILE": str(error_file), "LOCAL_RANK": "0"})
    assert counter is not None and startfailures.read_count(counter) == 1
    counter.write_text(str(startfailures.MAX_FAILED_STARTS - 1), encoding="ascii")  # as after more failed starts
    assert start_worker(error_file) == int(ExitCode.REFORM)
    assert start_worker(error_file) == 1  # one start too many: the user's failure


def test_a_formed_group_clears_the_count(tmp_path: Path) -> None:
    environ = {"TORCHELASTIC_ERROR_FILE": str(tmp_path / "run" / "attempt_3" / "1" / "error.json"), "LOCAL_RANK": "1"}
    path = startfailures.counter_path(environ)
    assert path is not None and path == tmp_path / "run" / "failed-starts-1"
    path.parent.mkdir(parents=True)
    path.write_text("4", encoding="ascii")
    assert startfailures.read_count(path) == 4
    startfailures.clear(environ)
    assert startfailures.read_count(path) == 0


def test_only_failed_collectives_rejoin() -> None:
    assert startfailures.should_rejoin(RuntimeError("Connection closed by peer [127.0.0.1]:1"), 0)
    assert not startfailures.should_rejoin(ValueError("the user's model is wrong"), 0)
    assert not startfailures.should_rejoin(RuntimeError("Connection closed by peer"), startfailures.MAX_FAILED_STARTS)


def test_without_torchrun_nothing_is_counted() -> None:
    assert startfailures.counter_path({}) is None
