"""The control channel through a store hosted by a separate process (the job agent's role): progress and
checkpoint keys are published, drain checkpoints and exits DRAINED, a generation already seen is not acted on
after a restart, reform exits REFORM at once; and the per-worker Prometheus exporter serves the metrics."""

import json
import re
import time
import urllib.request

import pytest

from disttrain.api import control

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def scrape(port: int, attempts: int = 3) -> str:
    """The worker's /metrics; a scrape that times out is tried again (a loaded machine can stall the exporter's
    thread for seconds, as a real Prometheus would retry at its next interval)."""
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return r.read().decode()
        except TimeoutError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def test_drain_reform_progress_and_metrics_through_the_agent_store(harness):
    port = harness.start_store()
    store = harness.client(port)
    store.set(control.SIGNAL_KEY, control.ControlSignal(generation=3, action="reform", reason="old").model_dump_json())
    metrics_port = harness.free_port()
    contract = harness.contract(global_batch=4, micro=1, max_steps=1000, interval=5)
    extra = {
        "DISTTRAIN_AGENT_ENDPOINT": f"127.0.0.1:{port}",
        "DISTTRAIN_METRICS_PORT": str(metrics_port),
        "TOY_STEP_SLEEP": "0.05",
    }
    proc = harness.start(2, contract, "one", **extra)
    harness.wait_for_step("one", 7)  # generation 3 predates the workers: no reform

    def progress() -> control.ProgressReport:
        return control.ProgressReport.model_validate_json(store.get(control.PROGRESS_KEY))

    # rank 0 publishes with a blind set through its relay: the record may trail the step files a little under load
    harness.wait_until("progress at step 6 in the agent's store", lambda: progress().step >= 6, timeout=30)
    report = progress()
    assert report.world_size == 2 and report.plan["globalBatch"] == 4
    committed = json.loads(store.get(control.CHECKPOINT_KEY))  # step 5, or 10 if the test process was slow
    assert committed["step"] in (5, 10) and committed["world_size"] == 2 and committed["files"]
    text = scrape(metrics_port)
    assert re.search(r"^disttrain_trainer_world_size 2\.0$", text, re.M)
    last_complete = re.search(r"^disttrain_trainer_last_complete_checkpoint_step (\d+)\.0$", text, re.M)
    assert last_complete and int(last_complete.group(1)) in (5, 10)
    for name in (
        "disttrain_trainer_step",
        "disttrain_trainer_grad_accum_steps",
        "disttrain_trainer_lr_scale",
        "disttrain_trainer_checkpoint_save_seconds_bucket",
        "disttrain_trainer_samples_per_second",
        "disttrain_trainer_restart_count",
        "disttrain_trainer_samples_replayed_total",
    ):
        assert name in text
    assert "disttrain_trainer_world_size 2.0" in scrape(metrics_port + 1)  # local rank 1 serves on port + 1

    store.set(control.SIGNAL_KEY, control.ControlSignal(generation=4, action="drain", reason="scale").model_dump_json())
    rc = proc.wait(timeout=60)
    log = harness.log("one")
    harness.assert_exited(rc, log, 83)
    drained = int(re.search(r"drained at step (\d+)", log).group(1))

    proc = harness.start(2, contract, "two", **extra)  # generation 4 is still in the store: not acted on again
    harness.wait_for_step("two", drained + 4)
    assert proc.poll() is None
    t0 = time.monotonic()
    store.set(control.SIGNAL_KEY, control.ControlSignal(generation=5, action="reform", reason="x").model_dump_json())
    rc = proc.wait(timeout=30)
    log = harness.log("two")
    harness.assert_exited(rc, log, 84)
    assert "reform signal (generation 5" in log, log[-3000:]
    assert time.monotonic() - t0 < 10
    assert f"resumed from checkpoint step-{drained}" in log


def test_reform_exits_at_once_even_while_a_collective_is_stuck(harness):
    port = harness.start_store()
    store = harness.client(port)
    contract = harness.contract(global_batch=4, micro=1, max_steps=1000, interval=1000, timeout=300)
    proc = harness.start(2, contract, "stuck", DISTTRAIN_AGENT_ENDPOINT=f"127.0.0.1:{port}", TOY_HANG_RANK1_AT="4")
    harness.wait_for_step("stuck", 3)
    time.sleep(1.0)  # rank 0 is now blocked in step 4's gradient all-reduce (timeout 300 s), rank 1 asleep
    assert proc.poll() is None
    t0 = time.monotonic()
    store.set(control.SIGNAL_KEY, control.ControlSignal(generation=1, action="reform", reason="t").model_dump_json())
    rc = proc.wait(timeout=30)
    assert time.monotonic() - t0 < 10
    log = harness.log("stuck")
    harness.assert_exited(rc, log, 84)
    assert "[disttrain rank 1] WARNING reform signal (generation 1" in log, log[-3000:]
    # Rank 0, stuck in the all-reduce, leaves on the signal too, or on the failure of that collective when rank 1
    # leaving first closed its gloo connection (NCCL would leave it hung: the signal is its way out there).
    rank0 = ("[disttrain rank 0] WARNING reform signal (generation 1", "[disttrain rank 0] ERROR a collective failed")
    assert any(line in log for line in rank0), log[-3000:]


def test_a_seconds_interval_checkpoints_on_rank_zeros_clock(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=24, interval=1000, keep=10, interval_seconds=1)
    rc, log = harness.run(2, contract, "secs", TOY_STEP_SLEEP="0.15")
    assert rc == 0, log[-3000:]
    steps = sorted(int(p.name.split("-")[1]) for p in harness.ckpt.glob("step-*"))
    assert len(steps) >= 3 and steps[-1] == 24, steps  # >= 2 by time in ~3.6 s of training, plus the last


def test_a_job_recreated_under_the_same_name_obeys_its_own_directives_after_resuming_the_old_checkpoint(harness):
    """The old job drained at directive generation 3, and its checkpoint records it. A new job of the same name
    (another uid, a new agent store) resumes that checkpoint: its own generation 1 drain is obeyed, not taken for
    history. The old job's signal, still in a store the new workers reach, is not obeyed: sealed for the old
    job's uid, it does not even verify for the new workers (and were it sealed for theirs, its uid field would
    still not be theirs). Everything goes through the signed store, as on Kubernetes."""
    contract = harness.contract(global_batch=4, micro=1, max_steps=1000, interval=5)

    def connect(port, uid):
        return harness.client(port, job_uid=uid)

    def drain(store, generation, uid):
        store.set(
            control.SIGNAL_KEY,
            control.ControlSignal(generation=generation, action="drain", reason="t", job_uid=uid).model_dump_json(),
        )

    old_port = harness.start_store()
    old = harness.start(
        2,
        contract,
        "old",
        DISTTRAIN_AGENT_ENDPOINT=f"127.0.0.1:{old_port}",
        DISTTRAIN_JOB_UID="uid-old",
        TOY_STEP_SLEEP="0.05",
    )
    harness.wait_for_step("old", 3)
    drain(connect(old_port, "uid-old"), 3, "uid-old")
    harness.assert_exited(old.wait(timeout=60), harness.log("old"), 83)

    new_port = harness.start_store()
    new_store = connect(new_port, "uid-new")
    drain(new_store, 2, "uid-old")  # a stale signal of the old job where the new workers read (sealed for them)
    drain(connect(new_port, "uid-old"), 2, "uid-old")  # and the same sealed for the old job: never verifies
    new = harness.start(
        2,
        contract,
        "new",
        DISTTRAIN_AGENT_ENDPOINT=f"127.0.0.1:{new_port}",
        DISTTRAIN_JOB_UID="uid-new",
        TOY_STEP_SLEEP="0.05",
    )
    drained = int(re.search(r"drained at step (\d+)", harness.log("old")).group(1))
    harness.wait_for_step("new", drained + 3)
    assert new.poll() is None, "the old job's signal was not obeyed"
    drain(new_store, 1, "uid-new")
    rc = new.wait(timeout=60)
    log = harness.log("new")
    harness.assert_exited(rc, log, 83)
    assert f"resumed from checkpoint step-{drained}" in log, log[-3000:]
    assert "drain signal generation 1" in log
