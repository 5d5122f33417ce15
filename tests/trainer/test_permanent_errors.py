"""User errors a restart cannot fix end the worker with ExitCode.PERMANENT and a message naming the problem."""

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_an_invalid_world_size_exits_permanent_naming_the_valid_sizes(harness):
    contract = harness.contract(global_batch=8, micro=2, max_steps=2)  # 8 / (2 x 3) is not whole
    rc, log = harness.run(3, contract, "w3")
    assert "exitcode  : 85" in log, log[-3000:]
    assert "world size 3 is invalid" in log and "valid world sizes: 1, 2, 4" in log


def test_resuming_with_a_changed_dataset_exits_permanent_naming_what_changed(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=2, interval=2)
    rc, log = harness.run(1, contract, "first")
    assert rc == 0, log[-3000:]
    rc, log = harness.run(1, harness.contract(global_batch=4, micro=1, max_steps=4, interval=2), "second",
                          TOY_DATASET="90")
    assert "exitcode  : 85" in log, log[-3000:]
    assert "the dataset stream changed since the checkpoint (length: checkpoint has 97, this run has 90)" in log


def test_a_missing_contract_exits_permanent_with_instructions(harness):
    env_contract = ""
    rc, log = harness.run(1, env_contract, "nocontract")
    assert "exitcode  : 85" in log, log[-3000:]
    assert "$DISTTRAIN_CONTRACT is not set" in log
