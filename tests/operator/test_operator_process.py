"""``disttrain operator`` as a real process (kopf.run, the default registry's login from a kubeconfig file, the
Prometheus exporter, kopf's liveness endpoint) against the kmock API emulator over HTTP.

A separate process can be SIGKILLed at any instant, as a crashing pod is: the restart test kills it in the
middle of a reform and checks that the next operator creates no duplicate and loses no status.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.operator.conftest import PODS, eventually
from tests.operator.test_kopf_kmock import _count_workers, _future, _phase, running_job, workers
from tests.operatorprocess import spawn_operator

from disttrain.api import constants
from disttrain.common.ports import free_port

pytestmark = pytest.mark.timeout(60)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except OSError:
        return 0, ""


class OperatorProcess:
    """The operator process (:func:`tests.operatorprocess.spawn_operator`) with a kubeconfig naming the emulator."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: emulator\n"
            f"clusters: [{{name: emulator, cluster: {{server: '{url}'}}}}]\n"
            "users: [{name: tester, user: {token: not-checked}}]\n"
            "contexts: [{name: emulator, context: {cluster: emulator, user: tester}}]\n"
        )
        self.log = tmp / "operator.log"
        self.proc: subprocess.Popen | None = None
        self.metrics_port = self.liveness_port = 0

    async def start(self) -> None:
        self.metrics_port, self.liveness_port = free_port(), free_port()
        self.proc = spawn_operator(self.kubeconfig, self.log, self.metrics_port, self.liveness_port)

        async def alive():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            status, _ = await asyncio.to_thread(http_get, f"http://127.0.0.1:{self.liveness_port}/healthz")
            return status == 200

        await eventually(alive, timeout=20, interval=0.1)

    def kill(self) -> None:
        """SIGKILL: no cleanup, no graceful stop, as when the node or the container dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    async def scrape(self) -> str:
        status, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{self.metrics_port}/metrics")
        assert status == 200
        return text


@pytest.fixture
async def process_operator(api, tmp_path):
    op = OperatorProcess(api.url_, tmp_path)
    await op.start()
    yield op
    op.kill()


def _indices(pods: dict) -> list[str]:
    return sorted(p["metadata"]["labels"][constants.LABEL_NODE_INDEX] for p in pods.values())


async def test_sigkill_mid_reform_creates_no_duplicates_and_keeps_status(process_operator, api, k):
    await running_job(k, 3)
    await asyncio.sleep(0.1)  # running_job reported progress "now"; the next directive must be issued after it
    # A first reform, completed, so there is a lastReform to keep.
    await k.request("DELETE", f"{PODS}/demo-worker-1")
    await eventually(lambda: _count_workers(k, 3))
    await k.node("node-3")
    await k.run_pod("demo-worker-1", "node-3")
    await k.agent_reports("demo", worldSize=3, step=8, lastProgressTime=_future(0), rendezvousRound=2)
    first = (await eventually(lambda: _phase(k, "Running")))["status"]
    assert first["infrastructureLosses"]["total"] == 1 and first.get("lastReform"), first

    # A second loss; kill the operator while that reform is in flight.
    await k.request("DELETE", f"{PODS}/demo-worker-2")
    before = (await eventually(lambda: _phase(k, "Reforming")))["status"]
    process_operator.kill()
    assert before["infrastructureLosses"]["total"] == 2 and before["control"]["action"] == "reform", before

    await process_operator.start()
    pods = await eventually(lambda: _count_workers(k, 3))
    await asyncio.sleep(1.5)  # the new operator had time to act on everything it saw
    pods = await workers(k)
    assert sorted(pods) == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert _indices(pods) == ["0", "1", "2"], "one pod per node index"
    assert len([p for p in (await k.pods()) if p == "demo-agent"]) == 1
    after = (await k.job())["status"]
    assert after["infrastructureLosses"] == before["infrastructureLosses"], "a loss is never counted twice"
    assert after["restarts"] == before["restarts"] == {"total": 0, "byReason": {}}
    assert after["control"]["generation"] == before["control"]["generation"]
    assert after["control"]["action"] == "reform"
    assert after["lastReform"] == before["lastReform"], "the reform in flight keeps its start (not reset)"
    assert after["reforms"] == before["reforms"] == first["reforms"] + 1
    assert after["phase"] == "Reforming"

    # The reform completes under the new operator.
    await k.node("node-4")
    await k.run_pod("demo-worker-2", "node-4")
    await k.agent_reports("demo", worldSize=3, step=12, lastProgressTime=_future(0), rendezvousRound=3)
    done = (await eventually(lambda: _phase(k, "Running")))["status"]
    assert done["infrastructureLosses"]["total"] == 2 and len(done["infrastructureLosses"]["recent"]) == 2
    assert done["lastReform"]["start"] == before["lastReform"]["start"] and done["lastReform"]["to"] == 3, done
    assert done["lastReform"]["durationSeconds"] > 0 and done["reforms"] == before["reforms"]
    assert len(await workers(k)) == 3


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name, frozenset(sample.labels.items())] = sample.value
    return out


async def test_metrics_after_a_node_loss(process_operator, k, tmp_path):
    await running_job(k, 2)
    await asyncio.sleep(0.1)
    committed = time.time() - 5
    from disttrain.api.conditions import format_time

    await k.agent_reports(
        "demo",
        samplesConsumed=480,
        step=20,
        lastCheckpoint={"step": 20, "samples": 480, "time": format_time(committed)},
    )
    await k.node("node-1", ready="False")
    await eventually(lambda: _phase(k, "Reforming"))

    async def unscheduled():
        return [name for name, pod in (await workers(k)).items() if not pod["spec"].get("nodeName")]

    [replacement] = await eventually(unscheduled)
    await k.node("node-5")
    await k.run_pod(replacement, "node-5")
    await k.agent_reports(
        "demo", worldSize=2, step=21, samplesConsumed=504, lastProgressTime=_future(0), rendezvousRound=2
    )
    status = (await eventually(lambda: _phase(k, "Running")))["status"]

    job = {("namespace", "default"), ("job", "demo")}

    async def scraped():
        values = samples(await process_operator.scrape())
        return (
            values
            if values.get(("disttrain_job_samples_consumed", frozenset(job))) == 504
            and values.get(("disttrain_job_phase", frozenset(job | {("phase", "Running")}))) == 1
            else None
        )

    text_values = await eventually(scraped)
    get = lambda name, **labels: text_values.get((name, frozenset(job | set(labels.items()))))  # noqa: E731
    assert get("disttrain_job_world_size") == 2
    assert get("disttrain_job_desired_nodes") == 2
    assert get("disttrain_job_phase", phase="Reforming") == 0
    assert get("disttrain_job_infrastructure_losses_total", reason="NodeNotReady") == 1
    assert get("disttrain_job_restarts_total", reason="NodeNotReady") == 0
    assert get("disttrain_job_infrastructure_losses_last_hour") == 1
    assert get("disttrain_job_max_infrastructure_losses_per_hour") == 20
    assert get("disttrain_job_reforms_total", reason=status["lastReform"]["reason"]) == status["reforms"] == 1
    assert get("disttrain_job_reform_duration_seconds_count") == 1
    assert get("disttrain_job_reform_duration_seconds_sum") == pytest.approx(status["lastReform"]["durationSeconds"])
    assert get("disttrain_job_last_complete_checkpoint_step") == 20
    assert 4 <= get("disttrain_job_checkpoint_age_seconds") < 60
    reconciles = text_values[("disttrain_operator_reconcile_duration_seconds_count", frozenset())]
    assert reconciles >= 5
    text = await process_operator.scrape()
    assert (
        "# TYPE disttrain_operator_reconcile_errors_total counter" in text
        or "# TYPE disttrain_operator_reconcile_errors counter" in text
    )
    assert not any(name == "disttrain_operator_reconcile_errors_total" for name, _ in text_values), (
        "no reconcile failed"
    )

    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is missing: install the Debian package 'prometheus' (`make test` does)"
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert lint.returncode == 0, lint.stdout + lint.stderr
