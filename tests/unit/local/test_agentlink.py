"""What local mode shows of the agent's relayed status: paths in the pod become paths in the state directory."""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.api import constants
from disttrain.operator.local import agentlink
from disttrain.operator.local.statedir import StateDir

POD_DIR = "/checkpoints/demo"


def test_checkpoint_and_stall_dump_paths_name_the_state_directory(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    relayed = {
        "step": 12,
        "lastCheckpoint": {"step": 10, "path": f"{POD_DIR}/step-10", "samples": 240},
        "stalledNodes": [
            {
                "node": "demo-worker-1",
                "ranks": [1],
                "step": 12,
                "diagnostics": f"{POD_DIR}/diagnostics/w1/stall-12-rank*",
            },
            {"node": "demo-worker-2", "ranks": [2], "step": 12},
        ],
        "notAnAgentField": 1,
    }
    (tmp_path / constants.LOCAL_AGENT_STATUS_FILE).write_text(json.dumps(relayed))
    shown = agentlink.read_relayed(state, POD_DIR)
    local = str(state.checkpoints_dir)
    assert shown["lastCheckpoint"]["path"] == f"{local}/step-10"
    assert shown["stalledNodes"][0]["diagnostics"] == f"{local}/diagnostics/w1/stall-12-rank*"
    assert "diagnostics" not in shown["stalledNodes"][1]
    assert "notAnAgentField" not in shown and shown["step"] == 12
