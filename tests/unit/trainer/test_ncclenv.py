"""The NCCL environment of the worker's launcher: our values by default, the user's wherever they set one."""

from __future__ import annotations

import logging
import os

import pytest

from disttrain.api import env as env_names
from disttrain.trainer.launch import launcher, ncclenv, warmstart

FOLDER = "/ckpt/flight-recorder/node-0"


def test_without_user_settings_every_value_is_ours():
    nccl = ncclenv.plan(60, FOLDER, {})
    assert nccl.kept == {}
    assert nccl.to_set == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "140",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "5000",
        "TORCH_FR_DUMP_TEMP_FILE": f"{FOLDER}/nccl_trace_rank_",
    }


@pytest.mark.parametrize(
    ("collective_timeout_s", "dump_wait_ms", "heartbeat_s"),
    [(60, 5_000, 60 + 20 + 60), (10, 5_000, 10 + 20 + 60), (600, 15_000, 600 + 60 + 60), (60, 1_500, 60 + 8 + 60)],
    ids=["default-timeout", "short-timeout", "long-timeout-torch-dump-wait", "dump-wait-rounded-up"],
)
def test_the_heartbeat_outlasts_a_late_timeout_the_dump_wait_and_the_reform(
    collective_timeout_s, dump_wait_ms, heartbeat_s
):
    assert ncclenv.heartbeat_timeout_s(collective_timeout_s, dump_wait_ms) == heartbeat_s


@pytest.mark.parametrize(
    ("user", "kept", "set_as"),
    [
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, None),
        (
            {"NCCL_ASYNC_ERROR_HANDLING": "0"},
            {"NCCL_ASYNC_ERROR_HANDLING": "0"},
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"),
        ),
        ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, ("TORCH_FR_BUFFER_SIZE", "0")),
        ({"TORCH_FR_DUMP_TEMP_FILE": "/x/fr_"}, {"TORCH_FR_DUMP_TEMP_FILE": "/x/fr_"}, None),
        (
            {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/old_"},
            {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/old_"},
            ("TORCH_FR_DUMP_TEMP_FILE", "/x/old_"),
        ),
        ({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, None),
        ({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900"}, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900"}, None),
    ],
    ids=["async-name", "async-alias", "buffer-alias", "dump-file-name", "dump-file-alias", "dump-off", "heartbeat"],
)
def test_a_setting_the_user_made_under_any_of_its_names_is_theirs(user, kept, set_as):
    nccl = ncclenv.plan(60, FOLDER, user)
    assert nccl.kept == kept
    for name in user:
        assert name not in nccl.to_set or nccl.to_set[name] == user[name]
    if set_as is not None:  # an alias only: copied to the name torch reads first (torchrun would set its own)
        name, value = set_as
        assert nccl.to_set[name] == value
    touched = {name for s in ncclenv.settings(60, FOLDER) if set(user) & set(s.names) for name in s.names}
    ours = ncclenv.plan(60, FOLDER, {}).to_set
    assert {k: v for k, v in nccl.to_set.items() if k not in touched} == {
        k: v for k, v in ours.items() if k not in touched
    }


def test_the_heartbeat_follows_the_users_dump_wait():
    nccl = ncclenv.plan(60, FOLDER, {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "15000"})
    assert nccl.to_set["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == str(60 + 4 * 15 + 60)
    assert "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC" not in nccl.to_set


def test_a_warm_interpreter_started_before_the_nccl_settings_can_still_be_taken():
    warm = {"PATH": "/bin"}
    worker = dict(warm, **ncclenv.plan(60, FOLDER, {}).to_set)
    assert warmstart.env_is_compatible(warm, worker)


def _contract(timeout: int) -> str:
    return (
        '{"training": {"globalBatchSize": 4, "microBatchSize": 1, "lr": {"base": 0.1}, "maxSteps": 2},'
        f' "checkpoint": {{"intervalSteps": 2}}, "collective_timeout_seconds": {timeout}}}'
    )


def test_the_launcher_sets_them_on_a_cuda_node_into_a_folder_it_creates_and_logs_what_it_kept(tmp_path, caplog):
    environ = {
        env_names.CONTRACT: _contract(30),
        env_names.CHECKPOINT_DIR: str(tmp_path / "ckpt"),
        env_names.NODE_NAME: "node-2",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    }
    with caplog.at_level(logging.INFO, logger="disttrain.launch"):
        launcher.apply_nccl_env(environ, has_cuda=True)
    folder = tmp_path / "ckpt" / "flight-recorder" / "node-2"
    assert folder.is_dir()
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(folder, "nccl_trace_rank_")
    assert environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == str(30 + 20 + 60)
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert "kept from the pod's env: TORCH_NCCL_DUMP_ON_TIMEOUT=0" in caplog.text


def test_the_launcher_sets_nothing_on_a_node_without_cuda(tmp_path):
    environ = {env_names.CHECKPOINT_DIR: str(tmp_path)}
    launcher.apply_nccl_env(environ, has_cuda=False)
    assert environ == {env_names.CHECKPOINT_DIR: str(tmp_path)}
    assert list(tmp_path.iterdir()) == []


def test_without_a_readable_contract_the_launcher_takes_the_default_collective_timeout(tmp_path):
    environ = {env_names.CHECKPOINT_DIR: str(tmp_path)}
    launcher.apply_nccl_env(environ, has_cuda=True)
    assert environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == str(60 + 20 + 60)
