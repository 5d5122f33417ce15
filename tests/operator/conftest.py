"""Real kopf, in-process, against the kmock Kubernetes API emulator over HTTP.

Fixtures: ``api`` (the emulator with builtin kinds and the DistTrainJob resource), ``operator`` (a started
operator; ``await operator.restart()`` kills and restarts it), ``k`` (small async HTTP helpers acting as
kubectl, kubelet and node controller).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kmock
import kopf
import pytest
from kubernetes import client as k8s
from prometheus_client import CollectorRegistry
from tests.operator.emulator import ApiEmulator

from disttrain.api import constants
from disttrain.operator import handlers
from disttrain.operator.metrics import OperatorMetrics

JOBS = f"/apis/{constants.GROUP}/{constants.VERSION}/namespaces/default/{constants.PLURAL}"
PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture
async def api():
    emulator = ApiEmulator()
    async with emulator, kmock.Server(emulator) as server:
        emulator.resources.load_bundled()
        emulator.resources[f"{constants.GROUP}/{constants.VERSION}/{constants.PLURAL}"] = kmock.ResourceInfo(
            kind=constants.KIND,
            singular=constants.SINGULAR,
            namespaced=True,
            subresources={"status", "scale"},
            shortnames={constants.SHORT_NAME},
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        )
        emulator.url_ = str(server.url).rstrip("/")
        yield emulator


class Operator:
    def __init__(self, url: str) -> None:
        self.url = url
        self.task: asyncio.Task | None = None
        self.metrics_registry = CollectorRegistry()
        self.metrics = OperatorMetrics(self.metrics_registry)

    async def start(self) -> None:
        registry = kopf.OperatorRegistry()

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=self.url, insecure=True)

        @kopf.on.startup(registry=registry)
        def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
            handlers.configure(settings)
            settings.posting.enabled = False  # kopf's generateName events collide (409) on kmock 0.8
            settings.watching.connect_timeout = 5

        def api_client() -> k8s.ApiClient:
            configuration = k8s.Configuration()
            configuration.host = self.url
            self.api_client = k8s.ApiClient(configuration)
            return self.api_client

        handlers.register(registry, handlers.OperatorHandlers(api_client, self.metrics))
        ready = asyncio.Event()
        self.stop_flag = asyncio.Event()
        self.task = asyncio.create_task(
            kopf.operator(
                registry=registry, clusterwide=True, standalone=True, ready_flag=ready, stop_flag=self.stop_flag
            )
        )
        await asyncio.wait_for(ready.wait(), timeout=10)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None
        # Cancelling kopf does not stop the adapter's API calls already running in threads (asyncio.to_thread):
        # one could still open a connection to the emulator after the client's pool was closed, leaving a socket
        # that is garbage-collected unclosed (a ResourceWarning, an error in a later teardown). Wait for them.
        await asyncio.get_running_loop().shutdown_default_executor()
        if getattr(self, "api_client", None) is not None:
            self.api_client.close()  # its keep-alive sockets to the emulator
            self.api_client = None

    async def restart(self) -> None:
        """Stop through kopf's stop flag (a graceful exit; cancelling kopf's task mid-run also cancels the
        awaiting test task) and start a fresh operator with fresh memory."""
        self.stop_flag.set()
        done, _ = await asyncio.wait({self.task}, timeout=20)  # kopf's task ends as cancelled: do not await it
        assert done, "kopf did not stop within 20 s"
        self.task = None
        await self.start()


@pytest.fixture
async def operator(api):
    logging.getLogger("kopf").setLevel(logging.WARNING)
    op = Operator(api.url_)
    await op.start()
    yield op
    await op.stop()


class Kubectl:
    """HTTP helpers that play kubectl, the kubelet and the node controller."""

    def __init__(self, api: ApiEmulator) -> None:
        self.api = api

    async def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        async with self.api.request(method, path, json=body, headers={"Content-Type": content_type}) as response:
            assert response.status < 300, f"{method} {path}: {response.status} {await response.text()}"
            return await response.json()

    async def merge(self, path: str, body: Any) -> Any:
        return await self.request("PATCH", path, body, "application/merge-patch+json")

    async def get(self, path: str) -> Any:
        async with self.api.get(path) as response:
            return await response.json() if response.status == 200 else None

    async def job(self, name: str = "demo") -> dict[str, Any]:
        return await self.get(f"{JOBS}/{name}")

    async def pods(self) -> dict[str, dict[str, Any]]:
        items = (await self.get(PODS))["items"]
        return {p["metadata"]["name"]: p for p in items}

    async def run_pod(self, name: str, node: str) -> None:
        """The scheduler binds the pod and the kubelet reports it Running and Ready."""
        await self.merge(
            f"{PODS}/{name}/status",
            {
                "spec": {"nodeName": node},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
            },
        )

    async def fail_pod(self, name: str, exit_code: int) -> None:
        await self.merge(
            f"{PODS}/{name}/status",
            {
                "status": {
                    "phase": "Failed",
                    "containerStatuses": [
                        {
                            "name": "trainer",
                            "image": "example/trainer:1",
                            "imageID": "",
                            "ready": False,
                            "restartCount": 0,
                            "state": {"terminated": {"exitCode": exit_code}},
                        }
                    ],
                }
            },
        )

    async def node(self, name: str, ready: str = "True") -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name},
            "status": {"conditions": [{"type": "Ready", "status": ready}]},
        }
        if await self.get(f"/api/v1/nodes/{name}") is None:
            await self.request("POST", "/api/v1/nodes", body)
        else:
            await self.merge(f"/api/v1/nodes/{name}/status", {"status": body["status"]})

    async def agent_reports(self, name: str, **status: Any) -> None:
        """What the job agent relays (it may patch only status)."""
        await self.merge(f"{JOBS}/{name}/status", {"status": status})


@pytest.fixture
def k(api) -> Kubectl:
    return Kubectl(api)


async def eventually(check, timeout: float = 10.0, interval: float = 0.05):
    """Await ``check()`` until it returns a truthy value; fail with the last value after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    last = None
    while asyncio.get_running_loop().time() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s; last value: {last!r}")
