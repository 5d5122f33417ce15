"""User errors a restart cannot fix end the worker with ExitCode.PERMANENT and a message naming the problem."""

import pytest
import torch

from disttrain.api import control

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_an_invalid_world_size_exits_permanent_naming_the_valid_sizes_and_reports_it_to_the_agent(harness):
    port = harness.start_store()
    contract = harness.contract(global_batch=8, micro=2, max_steps=2)  # 8 / (2 x 3) is not whole
    # Under torchrun itself, which hides the worker's exit code from the pod (it exits 1): the failure record in the
    # agent's store carries it.
    rc, log = harness.run(
        3,
        contract,
        "w3",
        launcher="torch.distributed.run",
        DISTTRAIN_AGENT_ENDPOINT=f"127.0.0.1:{port}",
        DISTTRAIN_NODE_NAME="node-7",
    )
    harness.assert_exited(rc, log, 85)
    assert "world size 3 is invalid" in log and "valid world sizes: 1, 2, 4" in log
    store = harness.client(port)  # signed: only a sealed failure record verifies
    failure = control.WorkerFailure.model_validate_json(store.get(control.FAILURE_KEY))
    assert failure.exit_code == 85 and failure.node == "node-7"
    assert "world size 3 is invalid" in failure.message


def test_resuming_with_a_changed_dataset_exits_permanent_naming_what_changed(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=2, interval=2)
    rc, log = harness.run(1, contract, "first")
    assert rc == 0, log[-3000:]
    rc, log = harness.run(
        1, harness.contract(global_batch=4, micro=1, max_steps=4, interval=2), "second", TOY_DATASET="90"
    )
    harness.assert_exited(rc, log, 85)
    assert "the dataset stream changed since the checkpoint (length: checkpoint has 97, this run has 90)" in log


def test_a_missing_contract_exits_permanent_with_instructions(harness):
    env_contract = ""
    rc, log = harness.run(1, env_contract, "nocontract")
    harness.assert_exited(rc, log, 85)
    assert "$DISTTRAIN_CONTRACT is not set" in log


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_asking_for_cuda_without_cuda_exits_permanent_saying_what_is_missing(harness):
    rc, log = harness.run(1, harness.contract(global_batch=4, micro=1, max_steps=2), "nocuda", TOY_DEVICE="cuda")
    harness.assert_exited(rc, log, 85)
    assert "device='cuda' was asked for but CUDA is not available in this container" in log
    assert "resources.limits['nvidia.com/gpu']" in log
