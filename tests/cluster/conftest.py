"""The real-control-plane tier: one etcd + kube-apiserver (+ controller-manager and scheduler) per test run.

Fixtures: ``control_plane`` (session; see :class:`ControlPlane`), ``controllers`` (the same control plane with
kube-controller-manager and kube-scheduler running), ``crd`` (the DistTrainJob CRD applied server-side and
Established), ``namespace`` (a fresh namespace per test), ``operator`` (one per module), ``kubelets`` and ``cluster``
(simulated nodes that only report pods Running, and a namespace's helpers). Without the binaries the tier is skipped
locally and fails under CI (``CI=true``): a skipped test proves nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from disttrain.api import constants
from disttrain.operator.local.forkserver import ForkServers
from tests.cluster.controlplane import ControlPlane, start_or_skip
from tests.cluster.harness import Cluster, checkpoint_claim, delete_jobs
from tests.cluster.kubelet import Kubelets
from tests.cluster.operator_process import OperatorProcess
from tests.cluster.process_kubelet import ProcessKubelets
from tests.cluster.rbac import OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT, install_operator_rbac
from tests.conftest import REPO_ROOT

CRD_DIR = REPO_ROOT / "crds"
POD_GROUP_CRDS = REPO_ROOT / "tests" / "data" / "podgroups"


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    plane = start_or_skip()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def controllers(control_plane: ControlPlane) -> ControlPlane:
    control_plane.start_controllers()
    return control_plane


@pytest.fixture(scope="session")
def crd(control_plane: ControlPlane) -> ControlPlane:
    """The CRD exactly as users apply it (README: server-side), waited for until Established."""
    control_plane.kubectl("apply", "--server-side", "-f", str(CRD_DIR))
    control_plane.wait_established(constants.CRD_NAME)
    return control_plane


@pytest.fixture
def namespace(control_plane: ControlPlane) -> str:
    return control_plane.create_namespace(f"t-{uuid.uuid4().hex[:10]}")


@pytest.fixture(scope="session")
def pod_group_crds(control_plane: ControlPlane) -> ControlPlane:
    """Volcano's and scheduler-plugins' PodGroup CRDs (minimal copies of the published schemas, tests/data)."""
    control_plane.kubectl("apply", "--server-side", "-f", str(POD_GROUP_CRDS))
    for name in ("podgroups.scheduling.volcano.sh", "podgroups.scheduling.x-k8s.io"):
        control_plane.wait_established(name)
    return control_plane


@pytest.fixture(scope="module")
def operator(controllers: ControlPlane, crd: ControlPlane, tmp_path_factory) -> Iterator[OperatorProcess]:
    """The operator as a process under the chart's RBAC, one per module; it may hit no 403 over the module."""
    install_operator_rbac(controllers)
    kubeconfig = controllers.service_account_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT)
    process = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log")
    process.start()
    yield process
    process.kill()
    forbidden = process.forbidden_lines()
    assert not forbidden, "the operator hit 403s under the chart's RBAC:\n" + "\n".join(forbidden[:20])


@pytest.fixture
def kubelets(controllers: ControlPlane) -> Iterator[Kubelets]:
    sim = Kubelets(controllers)
    yield sim
    sim.stop()


@pytest.fixture
def cluster(controllers: ControlPlane, namespace: str, kubelets: Kubelets, operator: OperatorProcess) -> Cluster:
    """A namespace with the checkpoint claim the jobs name; the kubelets only report pods Running."""
    checkpoint_claim(controllers, namespace, Path(f"/tmp/pv-{namespace}"))
    return Cluster(controllers, namespace, kubelets)


@pytest.fixture(scope="session")
def fork_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServers]:
    """Fork servers for the session's job pods (as local mode's, under ``DISTTRAIN_LOCAL_FORK``): each pod would
    import torch again, a few CPU-s on the 2 cores the whole tier shares. The e2e recorder reads ``E2E_*`` at run
    time."""
    servers = ForkServers(tmp_path_factory.mktemp("fork-servers"), run_time=("E2E_",))
    yield servers
    servers.close()


@pytest.fixture
def process_cluster(
    controllers: ControlPlane, namespace: str, operator: OperatorProcess, tmp_path: Path, fork_servers: ForkServers
) -> Iterator[Cluster]:
    """A namespace whose pods run as local processes: the real job agent, torchrun and trainer."""
    volume_root = tmp_path / "volume"
    volume_root.mkdir()
    checkpoint_claim(controllers, namespace, volume_root)
    sim = ProcessKubelets(controllers, volume_root, tmp_path / "pods", namespaces={namespace}, forks=fork_servers)
    try:
        yield Cluster(controllers, namespace, sim)
    finally:
        delete_jobs(controllers, namespace)
        sim.stop()
