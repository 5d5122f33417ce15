"""Exit codes of forks as a forking process reports them (a fork server, a warm interpreter): each belongs to the
fork that held the pid, though a reaped fork's pid may name a later one (a real pipe and reader thread, no
process)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import pytest

from disttrain.common.forkedpopen import Fork, ForkAnswers


class Forker:
    """The forking process's side of the pipe: it answers as ``warmproc`` does."""

    def __init__(self) -> None:
        read_end, self.write_end = os.pipe()
        self.answers = ForkAnswers(read_end, "test-fork-answers")

    def say(self, answer: dict[str, int]) -> bool:
        os.write(self.write_end, json.dumps(answer).encode() + b"\n")
        return True

    def fork(self, pid: int) -> Fork:
        fork, refused = self.answers.request_fork(lambda: self.say({"spawned": pid}), timeout=10)
        assert fork is not None and fork.pid == pid, refused
        return fork

    def exited(self, pid: int, code: int) -> None:
        self.say({"exit": pid, "status": code << 8})

    def close(self) -> None:
        """The forking process ends: the pipe closes (once)."""
        if self.write_end >= 0:
            os.close(self.write_end)
            self.write_end = -1
        self.answers.join(10)


@pytest.fixture
def forker() -> Iterator[Forker]:
    forker = Forker()
    yield forker
    forker.close()


def test_a_fork_that_reuses_an_exited_forks_pid_runs_until_its_own_exit(forker: Forker):
    first = forker.fork(4242)
    forker.exited(4242, 7)
    assert forker.answers.exit_code(first, timeout=10) == 7
    second = forker.fork(4242)  # the pid came round again
    assert forker.answers.exit_code(second, timeout=0) is None, "the new fork took the earlier one's exit"
    assert forker.answers.is_busy()
    forker.exited(4242, 0)
    assert forker.answers.exit_code(second, timeout=10) == 0
    assert forker.answers.exit_code(first, timeout=0) == 7
    assert not forker.answers.is_busy()


def test_the_exit_of_a_child_it_started_for_itself_is_no_later_forks_exit(forker: Forker):
    forker.exited(5151, 0)  # e.g. a helper its imports ran and it reaped
    fork = forker.fork(5151)
    assert forker.answers.exit_code(fork, timeout=0) is None
    forker.exited(5151, 3)
    assert forker.answers.exit_code(fork, timeout=10) == 3


def test_forks_still_running_when_the_process_goes_count_as_killed(forker: Forker):
    done, running = forker.fork(100), forker.fork(101)
    forker.exited(100, 7)
    forker.close()
    assert forker.answers.gone
    assert forker.answers.exit_code(done, timeout=0) == 7
    assert forker.answers.exit_code(running, timeout=0) == -signal.SIGKILL
