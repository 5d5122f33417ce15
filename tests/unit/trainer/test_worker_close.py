"""torchrun's stop of a worker whose session is already gone (a warm worker reaped by its warm interpreter)."""

from __future__ import annotations

import os
import sys

import pytest
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

from disttrain.trainer.launch import launcher

pytestmark = pytest.mark.timeout(60)


def _exited_and_reaped(tmp_path) -> SubprocessHandler:
    """A real worker process in a session of its own, exited and reaped: no process of its session is left, as
    for a warm worker once its interpreter reaped it."""
    handler = SubprocessHandler(
        sys.executable, ("-c", "pass"), dict(os.environ), str(tmp_path / "out.log"), None, 0, None
    )
    handler.proc.wait()
    return handler


def test_stopping_a_worker_whose_session_is_gone_is_no_error(tmp_path):
    stock = _exited_and_reaped(tmp_path)
    with pytest.raises(ProcessLookupError):  # torchrun's own close, which ended the launcher with exit 1
        launcher._stock_close(stock)
    assert stock._stdout is not None and not stock._stdout.closed  # it raised before closing the log
    stock._stdout.close()
    handler = _exited_and_reaped(tmp_path)
    launcher.close_worker(handler)
    assert handler._stdout is not None and handler._stdout.closed
