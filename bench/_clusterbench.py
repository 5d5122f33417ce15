"""Shared by the benchmarks on the real control plane of ``tests/cluster``: one run's namespace and nodes.

Importing it puts the repository on ``sys.path`` (``tests.cluster``)."""

from __future__ import annotations

import contextlib
import pathlib
import sys
from collections.abc import Iterator

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.harness import Cluster, checkpoint_claim, delete_jobs  # noqa: E402
from tests.cluster.process_kubelet import ProcessKubelets  # noqa: E402


@contextlib.contextmanager
def run_namespace(plane: ControlPlane, work: pathlib.Path, name: str) -> Iterator[tuple[Cluster, pathlib.Path]]:
    """A new namespace ``name`` with the checkpoint claim and kubelets of its own under ``work/<namespace>`` (also
    yielded); on the way out its jobs are deleted, then its kubelets stopped."""
    namespace = plane.create_namespace(name)
    run_dir = work / namespace
    (run_dir / "volume").mkdir(parents=True)
    checkpoint_claim(plane, namespace, run_dir / "volume")
    kubelets = ProcessKubelets(plane, run_dir / "volume", run_dir / "pods", namespaces={namespace})
    try:
        yield Cluster(plane, namespace, kubelets), run_dir
    finally:
        delete_jobs(plane, namespace)
        kubelets.stop()
