"""A worker pod from the real builder, translated to a local process: only endpoint, paths and ports change."""

import sys

from tests.workerpods import worker_command, worker_env_dict

from disttrain.api import env
from disttrain.api.spec import DistTrainJob
from disttrain.operator import pods
from disttrain.operator.local import translate


def _job(make_job) -> DistTrainJob:
    obj = make_job("tr").build()
    container = obj["spec"]["template"]["spec"]["containers"][0]
    container["command"] = ["python", "-u", "train.py"]
    container["args"] = ["--ckpt", "/var/lib/disttrain/checkpoints/default/tr/extra"]
    container["env"] = [
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "GREETING", "value": "hello $(POD)"},
    ]
    obj["spec"]["checkpoint"] = {"claimName": "c", "path": "/var/lib/disttrain/checkpoints", "intervalSteps": 5}
    return DistTrainJob.model_validate(obj)


def _site(job: DistTrainJob) -> translate.LocalSite:
    return translate.LocalSite(
        agent_hosts=("tr-agent.default.svc", "tr-agent"),
        cluster_port=29400,
        local_port=41234,
        cluster_checkpoint_dir=pods.checkpoint_dir(job),
        checkpoint_dir="/tmp/state/ckpt",
        workdir="/tmp/work",
        base_env={"PATH": "/usr/bin"},
    )


def test_the_cluster_pod_becomes_the_same_command_on_localhost(make_job):
    job = _job(make_job)
    pod = pods.build_worker_pod(job, 1)
    spec = translate.to_process(pod, _site(job), "local-7", metrics_port=45000, ready_port=45001)
    argv = list(spec.argv)
    assert argv[:3] == [sys.executable, "-m", "disttrain.trainer.launch"]
    assert "--rdzv-endpoint=127.0.0.1:41234" in argv
    assert argv[-5:] == [sys.executable, "-u", "train.py", "--ckpt", "/tmp/state/ckpt/extra"]
    # Everything else torchrun gets is the builder's, untouched.
    cluster = worker_command(pod)
    same = [a for a in cluster if "rdzv-endpoint" not in a and a not in ("python",) and "/var/lib" not in a]
    assert all(a in argv for a in same)
    assert spec.env[env.AGENT_ENDPOINT] == "127.0.0.1:41234"
    assert spec.env[env.CHECKPOINT_DIR] == "/tmp/state/ckpt"
    assert spec.env[env.METRICS_PORT] == "45000" and spec.env[env.READY_PORT] == "45001"
    assert spec.env[env.NODE_NAME] == "tr-worker-1"
    assert spec.env[env.CONTRACT] == worker_env_dict(pod)[env.CONTRACT]
    assert spec.env["POD"] == "tr-worker-1" and spec.env["GREETING"] == "hello tr-worker-1"
    assert spec.env["PATH"] == "/usr/bin" and spec.cwd == "/tmp/work"


def test_the_agent_listens_on_the_local_port(make_job):
    job = _job(make_job)
    spec = translate.to_process(pods.build_agent_pod(job), _site(job), "local-1", metrics_port=0)
    assert list(spec.argv) == [sys.executable, "-m", "disttrain.trainer.agent", "--port", "41234"]


def test_agent_service_names_are_rewritten_only_as_whole_host_names():
    site = translate.LocalSite(
        agent_hosts=("a-agent.ns.svc", "a-agent"),
        cluster_port=29400,
        local_port=5,
        cluster_checkpoint_dir="/c/ns/a",
        checkpoint_dir="/l",
        workdir="/",
    )
    assert translate.translate_text("a-agent.ns.svc:29400", site) == "127.0.0.1:5"
    assert translate.translate_text("tcp://a-agent:29400/x", site) == "tcp://127.0.0.1:5/x"
    assert translate.translate_text("a-agent-old:29400", site) == "a-agent-old:29400"
    assert translate.translate_text("/c/ns/a/step-3", site) == "/l/step-3"


def test_worker_and_agent_get_the_local_jobs_store_secret_in_their_env(make_job):
    """No Secret volume locally: the runtime's secret goes into the env, and the pod's file path is dropped (a
    process told to read a file that does not exist would refuse to start)."""
    job = _job(make_job)
    site = translate.LocalSite(**{**_site(job).__dict__, "store_secret": "local-secret"})
    for pod in (pods.build_worker_pod(job, 0), pods.build_agent_pod(job)):
        spec = translate.to_process(pod, site, "local-1", metrics_port=0)
        assert spec.env[env.STORE_SECRET] == "local-secret" and env.STORE_SECRET_FILE not in spec.env


def test_a_pulsing_agent_pulses_on_the_local_port_with_the_local_key_file(make_job):
    """The pod's pulse port (derived from the store's) and its Secret's key path become the runtime's own; an
    agent that does not pulse gets neither."""
    job = _job(make_job)
    site = translate.LocalSite(**{**_site(job).__dict__, "pulse_port": 41999, "pulse_key_file": "/tmp/state/key"})
    pulsing = pods.AgentSettings(pulse_s=0.2, pulse_key=bytes(32))
    spec = translate.to_process(pods.build_agent_pod(job, pulsing), site, "local-1", metrics_port=0)
    assert spec.env[env.AGENT_PULSE_PORT] == "41999" and spec.env[env.AGENT_PULSE_KEY_FILE] == "/tmp/state/key"
    assert spec.env[env.POD_IP] == "127.0.0.1"
    quiet = translate.to_process(pods.build_agent_pod(job, pods.LOCAL_AGENT), site, "local-1", metrics_port=0)
    assert env.AGENT_PULSE_PORT not in quiet.env and env.AGENT_PULSE_KEY_FILE not in quiet.env
