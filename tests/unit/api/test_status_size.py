"""Status stays under etcd's request limit at 10,000 nodes, and the packed pod-name sets read back exactly.

Before: ``trackedPods`` (name -> uid of every live pod) alone was 669 KB at 10,000 nodes; with the directive's
exclude list, silent nodes and handled uids the status reached about 1 MB in this test's worst case (1.68 MB
measured on a live 10k job). ``trackedPods`` is now a packed set (disttrain.api.nameset).
"""

from __future__ import annotations

import json
import uuid

import pytest

from disttrain.api import nameset
from disttrain.api.status import DistTrainJobStatus

NODES = 10_000
STEADY_BOUND = 64 * 1024
"""A running 10k-node job: every pod tracked, a full round, nothing in flight."""
WORST_BOUND = 512 * 1024
"""Worst case this test builds: half the nodes being drained (exclude), 1024 lost and 1024 silent."""


def _names(job: str = "train-llm-70b") -> list[str]:
    return [f"{job}-worker-{i}" for i in range(NODES)]


def _size(status: dict[str, object]) -> int:
    model = DistTrainJobStatus.model_validate(status)
    return len(json.dumps(model.model_dump(mode="json", by_alias=True, exclude_none=True), separators=(",", ":")))


def test_a_running_10k_node_job_has_a_small_status():
    names = _names()
    status = {
        "phase": "Running",
        "trackedPods": {n: str(uuid.uuid4()) for n in [*names, "train-llm-70b-agent"]},
        "roundMembers": names[:1024],
        "handledPods": [str(uuid.uuid4()) for _ in range(100)],
    }
    assert _size(status) <= STEADY_BOUND, _size(status)


def test_the_worst_case_10k_node_status_stays_under_the_etcd_limit():
    names = _names()
    status = {
        "phase": "Reforming",
        "trackedPods": names,
        "roundMembers": names[:1024],
        "handledPods": [str(uuid.uuid4()) for _ in range(1000)],
        "control": {"generation": 3, "action": "drain", "exclude": names[5000:], "lost": names[:1024]},
        "silentNodes": [{"node": n, "lastHeartbeat": "2026-12-04T13:00:00Z"} for n in names[:1024]],
    }
    assert _size(status) <= WORST_BOUND, _size(status)
    assert _size(status) < 1_572_864  # etcd's default request limit, 1.5 MiB


@pytest.mark.parametrize(
    "names",
    [
        set(),
        {"j-agent"},
        {f"j-worker-{i}" for i in range(0, 10_000, 2)},
        {"j-worker-0", "j-worker-0-1", "j-worker-0-2", "j-worker-10", "j-worker-007", "j-agent", "x"},
        {f"a-worker-{i}" for i in range(5)} | {f"b-worker-{i}" for i in range(3, 9)},
    ],
    ids=["empty", "agent-only", "every-other", "incarnations", "two-prefixes"],
)
def test_packed_names_read_back_exactly(names):
    assert nameset.unpack(nameset.pack(names)) == names
    model = DistTrainJobStatus.model_validate({"trackedPods": sorted(names)})
    wire = json.loads(json.dumps(model.model_dump(mode="json", by_alias=True)))
    assert DistTrainJobStatus.model_validate(wire).tracked_pods == names


def test_the_older_name_to_uid_map_is_still_read():
    old = {"trackedPods": {"j-worker-0": "u0", "j-agent": "u1"}}
    assert DistTrainJobStatus.model_validate(old).tracked_pods == {"j-worker-0", "j-agent"}


@pytest.mark.parametrize("entry", ["j-worker-[1-x]", "j-worker-[9-1]", "j-worker-[0-99999999]", 7])
def test_a_malformed_packed_entry_is_refused_naming_it(entry):
    with pytest.raises(ValueError, match=r"trackedPods|range|number|pod name"):
        DistTrainJobStatus.model_validate({"trackedPods": [entry]})
