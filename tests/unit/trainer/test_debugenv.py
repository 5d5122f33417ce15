"""spec.debug: the environment and log files the launcher gives the workers (the user's env wins)."""

import os

import pytest
from pydantic import ValidationError
from tests.conftest import JobBuilder
from torch.distributed import run as torchrun

from disttrain.api import env
from disttrain.api.contract import WorkerContract
from disttrain.api.spec import DebugSpec, DistTrainJobSpec
from disttrain.trainer.launch import debugenv, launcher

FOLDER = "/ckpt/debug/node-0/20261204T000000Z-abc"


def debug(**fields) -> DebugSpec:
    return DebugSpec.model_validate(fields)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, {}),
        (
            {"distributed": "DETAIL"},
            {
                "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
                "TORCH_CPP_LOG_LEVEL": "INFO",
                "NCCL_DEBUG": "INFO",
                "NCCL_DEBUG_FILE": f"{FOLDER}/nccl.%h.%p.log",
                env.DEBUG_DIR: FOLDER,
            },
        ),
        (
            {"ncclSubsystems": ["INIT", "COLL", "INIT"]},
            {
                "NCCL_DEBUG": "INFO",
                "NCCL_DEBUG_SUBSYS": "INIT,COLL",
                "NCCL_DEBUG_FILE": f"{FOLDER}/nccl.%h.%p.log",
                env.DEBUG_DIR: FOLDER,
            },
        ),
        ({"perRankLogs": True}, {env.WARM_WORKERS: "0", env.DEBUG_DIR: FOLDER}),
    ],
    ids=["off-sets-nothing", "detail", "nccl-subsystems-alone", "per-rank-logs-alone"],
)
def test_each_debug_setting_sets_its_variables(spec, expected):
    assert debugenv.plan(debug(**spec), FOLDER, {}).to_set == expected


def test_the_users_own_variables_win_and_are_reported_kept():
    user = {"TORCH_DISTRIBUTED_DEBUG": "INFO", "NCCL_DEBUG": "WARN", "PATH": "/bin"}
    planned = debugenv.plan(debug(distributed="DETAIL"), FOLDER, user)
    assert planned.kept == {"TORCH_DISTRIBUTED_DEBUG": "INFO", "NCCL_DEBUG": "WARN"}
    assert "TORCH_DISTRIBUTED_DEBUG" not in planned.to_set and "NCCL_DEBUG" not in planned.to_set
    assert planned.to_set["TORCH_CPP_LOG_LEVEL"] == "INFO"


def test_a_contract_without_debug_mode_is_the_same_document_and_sets_nothing():
    job = JobBuilder("j").build()
    contract = WorkerContract.from_spec(DistTrainJobSpec.model_validate(job["spec"]))
    assert contract.debug is None and "debug" not in contract.to_env_value()
    environ = {env.CONTRACT: contract.to_env_value()}
    assert debugenv.apply(environ) is None and set(environ) == {env.CONTRACT}


def test_every_launcher_start_gets_its_own_folder_and_per_rank_logs_never_overwrite(tmp_path):
    job = JobBuilder("j").set("spec.debug", {"distributed": "DETAIL", "perRankLogs": True}).build()
    contract = WorkerContract.from_spec(DistTrainJobSpec.model_validate(job["spec"])).to_env_value()
    base = {env.CONTRACT: contract, env.CHECKPOINT_DIR: str(tmp_path), env.NODE_NAME: "node-1"}
    first, second = dict(base), dict(base)  # the same pod name started twice (a replacement), in the same second
    assert debugenv.apply(first) is not None and debugenv.apply(second) is not None
    assert first[env.DEBUG_DIR] != second[env.DEBUG_DIR]
    for environ in (first, second):
        folder = environ[env.DEBUG_DIR]
        assert os.path.isdir(folder) and os.path.dirname(folder) == str(tmp_path / "debug" / "node-1")
        assert environ["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and environ[env.WARM_WORKERS] == "0"
        assert environ["NCCL_DEBUG_FILE"] == os.path.join(folder, "nccl.%h.%p.log")
    args = torchrun.parse_args(["--nproc-per-node=2", "--no-python", "python", "train.py"])
    launcher.apply_per_rank_logs(args, first)
    assert (args.log_dir, args.tee, args.redirects) == (os.path.join(first[env.DEBUG_DIR], "logs"), "3", "0")
    # The command line's own choices are kept.
    own = torchrun.parse_args(["--log-dir=/var/log/x", "--redirects=1", "--no-python", "python", "train.py"])
    launcher.apply_per_rank_logs(own, first)
    assert (own.log_dir, own.tee, own.redirects) == ("/var/log/x", "0", "1")


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("distributed", "VERBOSE", "'OFF', 'INFO' or 'DETAIL'"),
        ("ncclSubsystems", ["INIT", "NETWORK"], "'INIT', 'COLL'"),
        ("perRankLogs", "sometimes", "valid boolean"),
        ("colour", True, "Extra inputs are not permitted"),
    ],
    ids=["level", "subsystem", "per-rank-logs", "unknown-field"],
)
def test_a_bad_debug_spec_is_refused_naming_the_field_and_what_is_allowed(field, value, says):
    with pytest.raises(ValidationError) as raised:
        DebugSpec.model_validate({field: value})
    assert says in str(raised.value) and field in str(raised.value)
