"""A rank's stall diagnostics: every thread's stack (the main thread's too, while it is stuck) in a file named after
the request, under the node's folder."""

from __future__ import annotations

import threading

from disttrain.trainer import diagnostics


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
