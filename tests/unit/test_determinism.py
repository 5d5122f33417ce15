"""``spec.training.deterministic``: the pod carries cuBLAS's fixed workspace (unless the user set one), the worker
turns on torch's deterministic algorithms, and a job without it changes nothing."""

from __future__ import annotations

import copy

import torch
from tests.unit.operator.world import job_manifest
from tests.workerpods import worker_env_dict

from disttrain.api import determinism as api_determinism
from disttrain.api.contract import WorkerContract
from disttrain.api.spec import DistTrainJob
from disttrain.operator import pods
from disttrain.trainer import determinism


def make_job(deterministic: bool, user_env: list[dict[str, str]] = ()) -> DistTrainJob:
    manifest = job_manifest(replicas=2)
    if deterministic:
        manifest["spec"]["training"]["deterministic"] = True
    manifest["spec"]["template"]["spec"]["containers"][0]["env"] = list(user_env)
    return DistTrainJob.model_validate(manifest)


def test_a_deterministic_job_gives_its_workers_the_fixed_cublas_workspace_and_the_contract_says_so():
    job = make_job(True)
    values = worker_env_dict(pods.build_worker_pod(job, 0))
    assert values["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert WorkerContract.from_env_value(values["DISTTRAIN_CONTRACT"]).training.deterministic is True


def test_the_users_own_workspace_setting_is_kept_and_not_doubled():
    job = make_job(True, [{"name": "CUBLAS_WORKSPACE_CONFIG", "value": ":16:8"}])
    env = pods.build_worker_pod(job, 0)["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "CUBLAS_WORKSPACE_CONFIG"] == [":16:8"]


def test_a_job_without_it_sets_nothing():
    job = make_job(False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in worker_env_dict(pods.build_worker_pod(job, 0))
    assert job.spec.training.deterministic is False


def test_the_worker_sets_the_workspace_itself_only_while_cuda_has_not_started():
    environ: dict[str, str] = {}
    assert determinism.workspace_problem(environ, cuda_started=False) is None
    assert environ == {"CUBLAS_WORKSPACE_CONFIG": api_determinism.DETERMINISTIC_WORKSPACE}
    late: dict[str, str] = {}
    problem = determinism.workspace_problem(late, cuda_started=True)
    assert late == {} and problem is not None and "CUBLAS_WORKSPACE_CONFIG" in problem
    assert determinism.workspace_problem({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, cuda_started=True) is None


def test_the_worker_turns_on_deterministic_algorithms_only_when_asked(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    try:
        assert determinism.apply(make_job(False).spec.training) is False
        assert torch.are_deterministic_algorithms_enabled() is before[0]
        assert determinism.apply(copy.deepcopy(make_job(True).spec.training)) is True
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]
