"""Sharded models re-form in place from memory: real torchrun agents under the worker pod's launcher, gloo, a node's
whole process tree SIGKILLed between checkpoints while a replacement joins at once.

The survivors keep their processes; the new group rebuilds the state from the survivors' own shards and the partner
copies of the lost node's shards (HSDP's replicas need none), with no checkpoint read and no restart, and the run
ends bit for bit where the uninterrupted run of the same world size ends. FSDP2 runs the toy MLP on three nodes of
one process; HSDP and FSDP x TP run the example GPT (tests/trainer/workers/mesh2d.py) on two nodes of two."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from tests.trainer.conftest import REPO, TOY, Harness
from tests.trainer.test_inplace_reform import launcher_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MESH_WORKER = REPO / "tests" / "trainer" / "workers" / "mesh2d.py"
LAUNCHER = [sys.executable, "-m", "disttrain.trainer.launch"]


def _mesh_contract(mesh: dict, steps: int) -> str:
    return json.dumps(
        {
            "training": {
                "globalBatchSize": 8,
                "microBatchSize": 1,
                "lr": {"base": 0.001},
                "maxSteps": steps,
                "seed": 3,
                "mesh": mesh,
            },
            "checkpoint": {"path": "/unused", "intervalSteps": 4, "keep": 3},
            "collective_timeout_seconds": 10,
            "reform_in_place": True,
        }
    )


SCENARIOS = {
    "fsdp2": {"nodes": 3, "nproc": 1, "steps": 20, "kill_at": 7, "final": "{run}-final.pt"},
    "hsdp": {"nodes": 2, "nproc": 2, "steps": 12, "kill_at": 6, "mesh": {"shard": 2}, "final": "{run}-final.pt"},
    "fsdp-x-tp": {
        "nodes": 2,
        "nproc": 2,
        "steps": 12,
        "kill_at": 6,
        "mesh": {"tensorParallel": 2},
        "final": "{run}-final.pt",
    },
}


def _start(harness: Harness, scenario: dict, run: str, port: int, name: str, **extra: str):
    nodes, nproc = scenario["nodes"], scenario["nproc"]
    ckpt = harness.tmp / f"ckpt-{name}"
    base = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **extra}
    if "mesh" in scenario:
        contract = _mesh_contract(scenario["mesh"], scenario["steps"])
        env = harness.env(contract, run, ckpt, MESH_OUT=str(harness.out), MESH_RUN=run, MESH_STEP_SLEEP="0.2", **base)
        script = MESH_WORKER
    else:
        contract = harness.contract(
            global_batch=12, micro=1, max_steps=scenario["steps"], interval=5, timeout=10, reform_in_place=True
        )
        env = harness.env(
            contract, run, ckpt, TOY_STEP_SLEEP="0.15", TOY_PARALLELISM="fsdp2", TOY_LOG_EVERY="1", **base
        )
        script = TOY
    cmd = [*LAUNCHER, f"--nproc-per-node={nproc}", *launcher_args(port, nodes), str(script)]
    return harness.popen(cmd, env, harness.out / f"{run}.log")


def _run(harness: Harness, scenario: dict, name: str, kill: bool) -> str:
    """The scenario's nodes training to the end; with ``kill``, the last node's tree is SIGKILLed once the group
    passed ``kill_at`` and a replacement starts at once. Returns the logs of the nodes that finished."""
    port = harness.start_store()
    runs = [f"{name}{i}" for i in range(scenario["nodes"])]
    # The node to be killed copies its shards slowly: it is lost while its copy of the last step is in flight.
    slow = {runs[-1]: {"DISTTRAIN_FAULT_SLOW_COPY": "0.5"}} if kill and "mesh" not in scenario else {}
    agents = {run: _start(harness, scenario, run, port, name, **slow.get(run, {})) for run in runs}
    if kill:
        world = scenario["nodes"] * scenario["nproc"]
        harness.wait_until(
            "the whole world passes the kill step",
            lambda: (
                max([r["step"] for run in runs for r in harness.records(run) if r["world"] == world] or [0])
                >= scenario["kill_at"]
            ),
            240,
        )
        victim = runs.pop()
        harness.kill_tree(agents.pop(victim).pid)
        runs.append(f"{name}r")
        agents[runs[-1]] = _start(harness, scenario, runs[-1], port, name)
    for run, agent in agents.items():
        assert agent.wait(timeout=300) == 0, harness.log(run)[-4000:]
    return "".join(harness.log(run) for run in runs)


@pytest.mark.parametrize("kind", list(SCENARIOS))
def test_a_node_lost_between_checkpoints_is_rebuilt_from_memory_bit_for_bit(harness, kind):
    scenario = SCENARIOS[kind]
    assert "resumed in place" not in _run(harness, scenario, "ref", kill=False)
    logs = _run(harness, scenario, "kill", kill=True)
    committed = [int(m) for m in re.findall(r"checkpoint step-(\d+) committed", logs)]
    resumed = [int(m) for m in re.findall(r"resumed in place from step (\d+) held in memory", logs)]
    assert resumed and len(set(resumed)) == 1, logs[-4000:]
    from_memory = resumed[0]
    assert from_memory > max(c for c in committed if c <= from_memory), "the memory must hold a newer step than disk"
    assert "resumed from checkpoint" not in logs.split("resumed in place from step")[-1], "a member read the disk"
    assert "cannot resume in place" not in logs and "exiting 84" not in logs, logs[-4000:]
    if kind == "fsdp2":  # rank 0 logs every step it reports: the group resumes at the newest of them (0 lost)
        before = "".join(harness.log(f"kill{i}").split("re-forming in place")[0] for i in range(2))
        reported = [int(m) for m in re.findall(r"rank 0\] INFO step (\d+) loss", before)]
        assert reported and from_memory == max(reported), f"reported up to {reported[-3:]}, resumed at {from_memory}"
    final = scenario["final"]
    reference = torch.load(harness.out / final.format(run="ref0"))
    rebuilt = torch.load(harness.out / final.format(run="kill0"))
    assert reference.keys() == rebuilt.keys()
    for key, value in reference.items():
        assert torch.equal(value, rebuilt[key]), f"{key} differs from the uninterrupted run"


def test_a_rank_and_its_partner_lost_together_fall_back_to_the_checkpoint_and_say_so(harness: Harness):
    """FSDP2 on three nodes, two of them killed at once: the copy of one's shards was on the other, so no step is
    whole in the survivor's memory; the group loads its newest checkpoint, and the log says why."""
    scenario = {**SCENARIOS["fsdp2"], "kill_at": 7}
    port = harness.start_store()
    runs = [f"pair{i}" for i in range(3)]
    agents = {run: _start(harness, scenario, run, port, "pair") for run in runs}
    harness.wait_until(
        "the group passes step 7",
        lambda: max([r["step"] for run in runs for r in harness.records(run) if r["world"] == 3] or [0]) >= 7,
        240,
    )
    for victim in runs[1:]:
        harness.kill_tree(agents.pop(victim).pid)
    assert agents[runs[0]].wait(timeout=300) == 0, harness.log(runs[0])[-4000:]
    log = harness.log(runs[0])
    assert "cannot resume in place from memory (no step is whole in the members' memory" in log, log[-4000:]
    assert re.search(r"resumed from checkpoint step-\d+ \(saved at world size 3\) at world size 1", log), log[-3000:]
