"""A rank's stall diagnostics: every thread's stack (the main thread's too, while it is stuck) in a file named after
the request, under the node's folder."""

from __future__ import annotations

import threading

from torch.distributed import HashStore

from disttrain.api import control as keys
from disttrain.api import env
from disttrain.trainer import control, diagnostics


def test_the_dump_names_the_stuck_threads_function(tmp_path):
    release = threading.Event()

    def stuck_in_a_collective() -> None:
        release.wait(10)

    thread = threading.Thread(target=stuck_in_a_collective, daemon=True)
    thread.start()
    try:
        written = diagnostics.dump(str(tmp_path), "stall-7", "demo-worker-1", 3)
    finally:
        release.set()
        thread.join()
    stacks = tmp_path / "demo-worker-1" / "stall-7-rank3.stacks.txt"
    assert str(stacks) in written
    assert "stuck_in_a_collective" in stacks.read_text()


def test_an_unsafe_node_name_stays_inside_the_folder(tmp_path):
    written = diagnostics.dump(str(tmp_path), "stall-1", "../../etc", 0)
    assert written and all(path.startswith(str(tmp_path) + "/") and "/../" not in path for path in written)


def test_the_watchdog_dumps_once_per_request_of_its_own_job(tmp_path, monkeypatch):
    monkeypatch.setenv(env.CHECKPOINT_DIR, str(tmp_path))
    monkeypatch.setenv(env.NODE_NAME, "demo-worker-0")
    monkeypatch.setenv("RANK", "2")
    watchdog = control.Watchdog(None, job_uid="uid-1")
    store = HashStore()  # torch's in-memory store, in place of the job's
    watchdog.store = store
    stacks = tmp_path / keys.DIAGNOSTICS_FOLDER / "demo-worker-0" / "stall-9-rank2.stacks.txt"

    def ask(request_id: str, job_uid: str) -> None:
        request = keys.DiagnosticsRequest(id=request_id, job_uid=job_uid)
        store.set(keys.DIAGNOSTICS_KEY, request.model_dump_json())
        watchdog.follow_diagnostics()

    ask("stall-9", "uid-other")
    assert not stacks.exists(), "another job's request"
    ask("stall-9", "uid-1")
    assert stacks.exists()
    stacks.unlink()
    watchdog.follow_diagnostics()
    assert not stacks.exists(), "once per request"
