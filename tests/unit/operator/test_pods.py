"""Pod, Service and RBAC builders: contents, and every object validates against the Kubernetes schema."""

from __future__ import annotations

import base64
import json

import kubernetes_validate
import pytest
from tests.unit.operator.world import job_manifest
from tests.workerpods import worker_command, worker_env_dict

from disttrain.api import env, pulse
from disttrain.api.contract import WorkerContract
from disttrain.api.spec import DistTrainJob
from disttrain.operator import access, cli, pods

pytestmark = pytest.mark.timeout(60)
K8S_VERSION = "1.33.0"


def make_job(**spec):
    manifest = job_manifest(replicas=2, **spec)
    manifest["spec"]["template"]["metadata"] = {"labels": {"team": "ml"}, "annotations": {"note": "x"}}
    manifest["spec"]["template"]["spec"]["containers"][0]["args"] = ["--epochs", "3"]
    manifest["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "USER_VAR", "value": "1"},
        {"name": "DISTTRAIN_NODE_NAME", "value": "spoofed"},
    ]
    return DistTrainJob.model_validate(manifest)


def all_objects(job):
    return [
        pods.build_worker_pod(job, 0),
        pods.build_worker_pod(job, 3),
        pods.build_agent_pod(job),
        *pods.build_support_objects(job),
    ]


@pytest.mark.parametrize(
    "spec",
    [{}, {"runPolicy": {"schedulerName": "volcano", "priorityClassName": "high"}}, {"nprocPerNode": 2}],
    ids=["default", "scheduling", "nproc-2"],
)
def test_every_built_object_validates_against_the_kubernetes_schema(spec):
    for obj in all_objects(make_job(**spec)):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_an_invalid_object_is_refused_by_the_validator():
    bad = pods.build_worker_pod(make_job(), 0)
    bad["spec"]["containers"][0]["ports"][0]["containerPort"] = "nine"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_worker_pod_runs_the_training_command_under_torchrun():
    job = make_job()
    pod = pods.build_worker_pod(job, 1)
    argv = worker_command(pod)
    assert argv[:3] == ["python", "-m", "disttrain.trainer.launch"]  # torchrun, ending with the user's exit code
    assert "--nnodes=1:4" in argv and "--nproc-per-node=1" in argv
    assert "--rdzv-backend=disttrain" in argv
    assert "--rdzv-endpoint=demo-agent.default.svc:29400" in argv
    assert "--rdzv-id=job-uid-1" in argv
    conf = next(a for a in argv if a.startswith("--rdzv-conf="))
    assert conf == (
        "--rdzv-conf=is_host=false,join_timeout=600,last_call_timeout=30,close_timeout=10,"
        "keep_alive_interval=1,keep_alive_max_attempt=3,silent_after=1"
    )
    assert f"--max-restarts={pods.TORCHRUN_MAX_RESTARTS}" in argv
    no_python = argv.index("--no-python")
    assert argv[no_python + 1 :] == ["python", "train.py", "--epochs", "3"]
    assert "args" not in pod["spec"]["containers"][0]
    trainer = pod["spec"]["containers"][0]
    assert trainer["terminationMessagePath"] == "/dev/termination-log"
    assert {"name": "DISTTRAIN_TERMINATION_LOG", "value": "/dev/termination-log"} in trainer["env"]


def test_worker_pod_identity_labels_and_owner():
    pod = pods.build_worker_pod(make_job(), 2)
    meta = pod["metadata"]
    assert meta["name"] == "demo-worker-2" and meta["namespace"] == "default"
    assert meta["labels"] == {
        "team": "ml",
        "disttrain.dev/job-name": "demo",
        "disttrain.dev/role": "worker",
        "disttrain.dev/node-index": "2",
        "disttrain.dev/job-uid": "job-uid-1",
    }
    assert meta["annotations"] == {"note": "x"}
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "disttrain.dev/v1alpha1",
            "kind": "DistTrainJob",
            "name": "demo",
            "uid": "job-uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["subdomain"] == "demo-workers"


def test_a_replacement_pod_keeps_the_node_index_it_takes_under_another_name():
    pod = pods.build_worker_pod(make_job(), 1, name="demo-worker-1-1")
    values = worker_env_dict(pod)
    assert pod["metadata"]["name"] == pod["spec"]["hostname"] == values[env.NODE_NAME] == "demo-worker-1-1"
    assert pod["metadata"]["labels"]["disttrain.dev/node-index"] == values[env.NODE_INDEX] == "1"


def test_worker_env_carries_the_contract_and_drops_user_spoofing():
    job = make_job()
    values = worker_env_dict(pods.build_worker_pod(job, 0))
    assert values["USER_VAR"] == "1"
    assert values[env.NODE_NAME] == "demo-worker-0" and values[env.NODE_INDEX] == "0"
    assert values[env.CHECKPOINT_DIR] == "/var/lib/disttrain/checkpoints/default/demo"
    assert values[env.AGENT_ENDPOINT] == "demo-agent.default.svc:29400"
    assert values[env.JOB_UID] == "job-uid-1"
    assert WorkerContract.from_env_value(values[env.CONTRACT]) == WorkerContract.from_spec(job.spec)
    names = [e["name"] for e in pods.build_worker_pod(job, 0)["spec"]["containers"][0]["env"]]
    assert names.count(env.NODE_NAME) == 1
    # The pod's own uid, from the downward API: the heartbeat report names the pod by it (never a replacement).
    uid = next(e for e in pods.build_worker_pod(job, 0)["spec"]["containers"][0]["env"] if e["name"] == env.POD_UID)
    assert uid["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}


def test_local_runtime_can_override_endpoint_and_checkpoint_dir():
    pod = pods.build_worker_pod(make_job(), 0, endpoint="127.0.0.1:5555", checkpoint_directory="/tmp/ck")
    values = worker_env_dict(pod)
    assert values[env.AGENT_ENDPOINT] == "127.0.0.1:5555" and values[env.CHECKPOINT_DIR] == "/tmp/ck"
    assert "--rdzv-endpoint=127.0.0.1:5555" in worker_command(pod)


def bucket_job(s3: dict | None = None, limit: str | None = None, user_env: list | None = None) -> DistTrainJob:
    manifest = job_manifest()
    checkpoint = {"uri": "s3://ckpt-bucket/jobs", "path": "/local-tier", **({"s3": s3} if s3 else {})}
    manifest["spec"]["checkpoint"] = {**checkpoint, **({"localTierSizeLimit": limit} if limit else {})}
    manifest["spec"]["template"]["spec"]["containers"][0]["env"] = user_env or []
    return DistTrainJob.model_validate(manifest)


def test_a_bucket_gets_an_empty_dir_as_its_local_tier_and_the_secret_s_credentials():
    s3 = {"endpoint": "http://rgw:8080", "addressingStyle": "path", "credentialsSecret": "s3-creds"}
    user_env = [{"name": "AWS_ACCESS_KEY_ID", "value": "from-the-template"}, {"name": "USER_VAR", "value": "1"}]
    job = bucket_job(s3, "50Gi", user_env)
    pod = pods.build_worker_pod(job, 0)
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert {"name": "disttrain-checkpoints", "emptyDir": {"sizeLimit": "50Gi"}} in pod["spec"]["volumes"]
    trainer = pod["spec"]["containers"][0]
    assert {"name": "disttrain-checkpoints", "mountPath": "/local-tier"} in trainer["volumeMounts"]
    by_name = {e["name"]: e for e in trainer["env"]}
    assert by_name["AWS_ACCESS_KEY_ID"]["valueFrom"] == {
        "secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}
    }
    assert by_name["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
    assert by_name["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert [e["name"] for e in trainer["env"]].count("AWS_ACCESS_KEY_ID") == 1  # the template's value gave way
    assert by_name["USER_VAR"]["value"] == "1"
    contract = WorkerContract.from_env_value(worker_env_dict(pod)[env.CONTRACT])
    assert contract.checkpoint.uri == "s3://ckpt-bucket/jobs" and contract.checkpoint.s3 is not None
    assert (contract.checkpoint.s3.endpoint, contract.checkpoint.s3.addressing_style.value) == (
        "http://rgw:8080",
        "path",
    )
    assert worker_env_dict(pod)[env.CHECKPOINT_DIR] == "/local-tier/default/demo"


def test_without_a_secret_a_bucket_job_s_pod_has_no_credentials_but_its_own():
    user_env = [{"name": "AWS_ROLE_ARN", "value": "arn:aws:iam::1:role/train"}]
    pod = pods.build_worker_pod(bucket_job({"region": "eu-west-1"}, user_env=user_env), 0)
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert "AWS_ROLE_ARN" in names and not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(names)
    assert {"name": "disttrain-checkpoints", "emptyDir": {}} in pod["spec"]["volumes"]


def test_checkpoint_claim_is_mounted_and_a_template_volume_can_be_used_instead():
    pod = pods.build_worker_pod(make_job(), 0)
    assert {"name": "disttrain-checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}} in pod["spec"]["volumes"]
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "disttrain-checkpoints", "mountPath": "/var/lib/disttrain/checkpoints"} in mounts
    manifest = job_manifest()
    manifest["spec"]["checkpoint"] = {"volumeName": "shared", "path": "/ckpt"}
    manifest["spec"]["template"]["spec"]["volumes"] = [{"name": "shared", "nfs": {"server": "nfs", "path": "/x"}}]
    pod = pods.build_worker_pod(DistTrainJob.model_validate(manifest), 0)
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    assert [m for m in mounts if m["name"] != access.VOLUME] == [{"name": "shared", "mountPath": "/ckpt"}]
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_worker_and_agent_pods_mount_the_jobs_store_secret_and_nothing_else_of_that_name():
    manifest = job_manifest()
    trainer = manifest["spec"]["template"]["spec"]["containers"][0]
    trainer["env"] = [{"name": env.STORE_SECRET, "value": "chosen-by-the-user"}]
    job = DistTrainJob.model_validate(manifest)
    for pod in (pods.build_worker_pod(job, 0), pods.build_agent_pod(job)):
        [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == access.VOLUME]
        assert volume == {
            "name": access.VOLUME,
            "secret": {"secretName": f"{job.metadata.name}-store-{job.metadata.uid}"},
        }
        container = pod["spec"]["containers"][0]
        assert {"name": access.VOLUME, "mountPath": access.MOUNT_PATH, "readOnly": True} in container["volumeMounts"]
        secret_env = [e for e in container["env"] if e["name"].startswith("DISTTRAIN_STORE_SECRET")]
        assert secret_env == [{"name": env.STORE_SECRET_FILE, "value": access.SECRET_FILE}]
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    secret = access.build_store_secret(job, "s" * 64)
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)


def test_the_jobs_secret_holds_its_agents_pulse_key_derived_from_the_operators_and_the_job_uid():
    """The operator never reads the Secret back: it derives the key again from its own key and the job's uid, the
    same whichever replica or start of the operator asks (a repeated create is a 409: the first Secret stays)."""
    job = make_job()
    settings = pods.AgentSettings(pulse_s=0.2, pulse_key=b"k" * 32)
    secret = access.build_store_secret(job, "s" * 64, settings.job_pulse_key(job))
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    stored = pulse.parse_key(base64.b64decode(secret["data"][pulse.SECRET_KEY]).decode())
    assert stored == pulse.job_key(b"k" * 32, job.metadata.uid or "")
    assert stored == pods.AgentSettings(pulse_s=0.2, pulse_key=b"k" * 32).job_pulse_key(job), "another replica's"
    assert stored != pulse.job_key(b"k" * 32, "another-uid"), "one job's key is not another's"
    no_pulse = access.build_store_secret(job, "s" * 64, pods.AgentSettings(pulse_s=0).job_pulse_key(job))
    assert set(no_pulse["data"]) == {"secret"}


def selects(selector, labels):
    return selector["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("nproc", [1, 3])
def test_network_policies_admit_the_jobs_workers_and_the_scraper_and_select_by_name_role_and_uid(nproc):
    job = make_job(nprocPerNode=nproc)
    agent_policy, worker_policy = access.build_network_policies(job, pods.METRICS_PORT)
    for policy in (agent_policy, worker_policy):
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
        assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress stays open
    agent, worker = pods.build_agent_pod(job), pods.build_worker_pod(job, 1)
    other = make_job(nprocPerNode=nproc)
    other.metadata.uid = "job-uid-2"  # a job of the same name, deleted and applied again
    old_worker = pods.build_worker_pod(other, 1)
    assert selects(agent_policy["spec"]["podSelector"], agent["metadata"]["labels"])
    assert not selects(agent_policy["spec"]["podSelector"], worker["metadata"]["labels"])
    assert selects(worker_policy["spec"]["podSelector"], worker["metadata"]["labels"])
    assert not selects(worker_policy["spec"]["podSelector"], agent["metadata"]["labels"])
    assert not selects(worker_policy["spec"]["podSelector"], old_worker["metadata"]["labels"])
    [to_agent] = agent_policy["spec"]["ingress"]
    [peer] = to_agent["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector: only pods of the job's own namespace
    assert selects(peer["podSelector"], worker["metadata"]["labels"])
    assert not selects(peer["podSelector"], old_worker["metadata"]["labels"])
    assert to_agent["ports"] == [{"protocol": "TCP", "port": job.spec.rendezvous.port}]
    from_workers, from_scraper = worker_policy["spec"]["ingress"]
    assert "ports" not in from_workers  # every port: torchrun's store, gloo and NCCL pick theirs at run time
    assert from_workers["from"] == [peer]
    [scraper] = from_scraper["from"]
    assert scraper == {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    declared = [p["containerPort"] for p in pods.trainer_container(worker)["ports"] if p["name"].startswith("metrics")]
    [ports] = from_scraper["ports"]
    assert list(range(ports["port"], ports.get("endPort", ports["port"]) + 1)) == sorted(declared)


def test_network_policies_follow_the_settings():
    job = make_job()
    assert access.build_network_policies(job, pods.METRICS_PORT, access.NetworkPolicySettings(enabled=False)) == []
    kinds = [o["kind"] for o in pods.build_support_objects(job, access.NetworkPolicySettings(enabled=False))]
    assert "NetworkPolicy" not in kinds
    settings = access.NetworkPolicySettings(
        scraper_namespace_selector={"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        scraper_pod_selector={"matchExpressions": [{"key": "app", "operator": "In", "values": ["vm", "prom"]}]},
    )
    _, worker_policy = access.build_network_policies(job, pods.METRICS_PORT, settings)
    kubernetes_validate.validate(worker_policy, K8S_VERSION, strict=True)
    [scraper] = worker_policy["spec"]["ingress"][1]["from"]
    assert scraper == {
        "namespaceSelector": dict(settings.scraper_namespace_selector),
        "podSelector": dict(settings.scraper_pod_selector),
    }


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{", "not JSON"),
        ("[]", "expected an object"),
        ('{"matchLabel": {}}', "unknown keys"),
        ('{"matchLabels": {"a": 1}}', "string values"),
        ('{"matchExpressions": {}}', "matchExpressions must be a list"),
    ],
)
def test_a_bad_scraper_selector_is_refused_naming_the_flag(text, error):
    with pytest.raises(ValueError, match=f"--flag: .*{error}"):
        access.parse_label_selector("--flag", text)


def test_a_template_volume_name_that_does_not_exist_is_refused_with_the_field():
    manifest = job_manifest()
    manifest["spec"]["checkpoint"] = {"volumeName": "missing", "path": "/ckpt"}
    with pytest.raises(ValueError, match=r"spec\.checkpoint\.volumeName"):
        pods.build_worker_pod(DistTrainJob.model_validate(manifest), 0)


def test_builders_are_pure():
    job = make_job()
    before = json.dumps(job.spec.template, sort_keys=True)
    assert pods.build_worker_pod(job, 0) == pods.build_worker_pod(job, 0)
    assert json.dumps(job.spec.template, sort_keys=True) == before


def test_agent_role_allows_only_its_own_job_its_status_and_a_patch_of_its_own_lease():
    job = make_job()
    role = pods.build_role(job)
    lease, agent = pods.build_agent_lease(job), pods.build_agent_pod(job)
    names = {tuple(rule["resources"]): rule["resourceNames"] for rule in role["rules"]}
    assert names == {
        ("disttrainjobs",): ["demo"],
        ("disttrainjobs/status",): ["demo"],
        ("leases",): [lease["metadata"]["name"]],
    }
    verbs = {tuple(rule["resources"]): rule["verbs"] for rule in role["rules"]}
    assert verbs == {
        ("disttrainjobs",): ["get", "watch"],
        ("disttrainjobs/status",): ["get", "patch"],
        ("leases",): ["patch"],  # no create: the operator makes the Lease, so the agent can touch no other
    }
    container_env = {e["name"]: e for e in agent["spec"]["containers"][0]["env"]}
    assert container_env["DISTTRAIN_AGENT_LEASE"]["value"] == lease["metadata"]["name"]
    assert container_env["DISTTRAIN_POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert lease in pods.build_support_objects(job)  # created with every agent
    assert lease["metadata"]["ownerReferences"][0]["uid"] == job.metadata.uid  # and goes with the job
    binding = pods.build_role_binding(make_job())
    assert binding["subjects"][0]["name"] == pods.build_agent_pod(make_job())["spec"]["serviceAccountName"]


def test_agent_pod_and_service_meet_on_the_rendezvous_port():
    job = make_job()
    agent, service = pods.build_agent_pod(job), pods.build_agent_service(job)
    assert service["spec"]["selector"].items() <= agent["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["port"] == 29400
    assert agent["spec"]["containers"][0]["command"] == ["python", "-m", "disttrain.trainer.agent", "--port", "29400"]


@pytest.mark.parametrize("nproc", [1, 3])
def test_each_local_ranks_exporter_has_a_named_metrics_port(nproc):
    """Worker pods declare ``metrics``, ``metrics-1``, ... on 9400 + local rank: what the chart's PodMonitor keeps."""
    manifest = job_manifest(nprocPerNode=nproc)
    manifest["spec"]["template"]["spec"]["containers"][0]["ports"] = [
        {"name": "http", "containerPort": 8000},
        {"name": "metrics-1", "containerPort": 1},
    ]
    pod = pods.build_worker_pod(DistTrainJob.model_validate(manifest), 0)
    [container] = pod["spec"]["containers"]
    named = {port["name"]: port["containerPort"] for port in container["ports"]}
    base = int({e["name"]: e.get("value") for e in container["env"]}[env.METRICS_PORT])
    assert named == {"http": 8000, **{("metrics" if r == 0 else f"metrics-{r}"): base + r for r in range(nproc)}}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_a_worker_reads_ready_when_its_launcher_listens_and_a_probe_of_the_users_is_kept():
    """The readiness port is how the operator knows a newcomer's workers start warm
    (disttrain.trainer.launch.readiness)."""
    [container] = pods.build_worker_pod(make_job(), 0)["spec"]["containers"]
    port = int(worker_env_dict({"spec": {"containers": [container]}})[env.READY_PORT])
    assert container["readinessProbe"] == {"tcpSocket": {"port": port}, "periodSeconds": 1}
    assert port not in {p["containerPort"] for p in container["ports"]}  # never one of the metrics ports
    manifest = job_manifest(replicas=2)
    own = {"httpGet": {"path": "/ready", "port": 8000}}
    manifest["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] = own
    [container] = pods.build_worker_pod(DistTrainJob.model_validate(manifest), 0)["spec"]["containers"]
    assert container["readinessProbe"] == own


def test_a_replacement_avoids_the_dead_nodes_and_keeps_the_templates_placement_rules():
    plain = pods.build_worker_pod(make_job(), 0, avoid_nodes=["node-b", "node-a"])
    # One requirement per node: the API server refuses a node field selector with more than one value.
    avoid = {"key": "metadata.name", "operator": "NotIn", "values": ["node-a"]}
    assert plain["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchFields": [avoid, {**avoid, "values": ["node-b"]}]}]
    }
    manifest = job_manifest(replicas=2)
    gpu = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}
    arm = {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["arm64"]}]}
    manifest["spec"]["template"]["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [gpu, arm]}}
    }
    job = DistTrainJob.model_validate(manifest)
    pod = pods.build_worker_pod(job, 0, avoid_nodes=["node-a"])
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    one = avoid
    assert terms == [{**gpu, "matchFields": [one]}, {**arm, "matchFields": [one]}]  # ANDed into each ORed term
    assert "matchFields" not in str(job.spec.template), "the job's own template is left alone"
    assert "affinity" not in pods.build_worker_pod(make_job(), 0)["spec"]
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_pods_meet_the_restricted_pod_security_standard_by_default():
    job = make_job()
    for pod in (pods.build_worker_pod(job, 0), pods.build_agent_pod(job)):
        spec = pod["spec"]
        assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        for container in spec["containers"]:
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            }


def test_what_the_template_says_about_security_is_kept():
    manifest = job_manifest(replicas=2)
    template = manifest["spec"]["template"]["spec"]
    template["securityContext"] = {"runAsNonRoot": False, "runAsUser": 0}
    template["containers"][0]["securityContext"] = {"capabilities": {"add": ["SYS_PTRACE"]}}
    template["initContainers"] = [
        {
            "name": "fetch",
            "image": "busybox",
            "command": ["true"],
            "securityContext": {"allowPrivilegeEscalation": True},
        }
    ]
    template["automountServiceAccountToken"] = True
    spec = pods.build_worker_pod(DistTrainJob.model_validate(manifest), 0)["spec"]
    assert spec["securityContext"] == {
        "runAsNonRoot": False,
        "runAsUser": 0,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert spec["containers"][0]["securityContext"] == {
        "capabilities": {"add": ["SYS_PTRACE"]},
        "allowPrivilegeEscalation": False,
    }
    assert spec["initContainers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert spec["automountServiceAccountToken"] is True


def test_workers_do_not_mount_a_service_account_token_and_the_agent_does():
    job = make_job()
    assert pods.build_worker_pod(job, 0)["spec"]["automountServiceAccountToken"] is False
    agent = pods.build_agent_pod(job)["spec"]
    assert "automountServiceAccountToken" not in agent and agent["serviceAccountName"]


def test_the_agent_runs_the_operators_image_never_the_users():
    job = DistTrainJob.model_validate(job_manifest())
    user_image = job.spec.trainer_container()["image"]
    default = pods.build_agent_pod(job)["spec"]["containers"][0]["image"]
    assert default.startswith(pods.AGENT_IMAGE_REPOSITORY + ":") and default != user_image
    chosen = pods.build_agent_pod(job, pods.AgentSettings(image="registry.example/disttrain-trainer:9"))["spec"][
        "containers"
    ][0]
    assert chosen["image"] == "registry.example/disttrain-trainer:9" and "imagePullPolicy" not in chosen


def test_the_operator_refuses_a_bad_scraper_selector_before_it_starts(capsys):
    code = cli.main(["operator", "--all-namespaces", "--metrics-scraper-pod-selector", '{"app": "prometheus"}'])
    assert code == 2
    assert "--metrics-scraper-pod-selector: unknown keys ['app']" in capsys.readouterr().err


def test_a_replacement_agent_avoids_its_predecessors_node_and_keeps_its_own_placement():
    manifest = job_manifest()
    manifest["spec"]["agent"] = {"nodeSelector": {"pool": "agents"}}
    pod = pods.build_agent_pod(DistTrainJob.model_validate(manifest), avoid_nodes=["node-a"])
    assert pod["spec"]["nodeSelector"] == {"pool": "agents"}
    [term] = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "NotIn", "values": ["node-a"]}]
    assert "nodeAffinity" not in pods.build_agent_pod(DistTrainJob.model_validate(manifest))["spec"]["affinity"]


def test_an_agent_heartbeat_of_zero_means_no_lease_and_no_renewals():
    job = make_job()
    assert not [obj for obj in pods.build_support_objects(job, heartbeat_s=0) if obj["kind"] == "Lease"]
    names = {
        e["name"] for e in pods.build_agent_pod(job, pods.AgentSettings(heartbeat_s=0))["spec"]["containers"][0]["env"]
    }
    assert "DISTTRAIN_AGENT_LEASE" not in names
    lease = pods.build_agent_lease(job, heartbeat_s=2.5)
    assert lease["spec"]["leaseDurationSeconds"] == 8  # three periods, rounded up


def test_the_agent_pulses_on_the_port_after_its_stores_bound_to_its_pod_ip_and_only_the_operator_is_admitted():
    job = make_job()
    agent = pods.build_agent_pod(job, pods.AgentSettings(pulse_s=0.25))
    kubernetes_validate.validate(agent, K8S_VERSION, strict=True)
    container = agent["spec"]["containers"][0]
    pulse_port = job.spec.rendezvous.port + 1
    assert {"name": "pulse", "containerPort": pulse_port, "protocol": "TCP"} in container["ports"]
    env = {e["name"]: e for e in container["env"]}
    assert env["DISTTRAIN_AGENT_PULSE_PORT"]["value"] == str(pulse_port)
    assert env["DISTTRAIN_AGENT_PULSE_SECONDS"]["value"] == "0.25"
    assert env["DISTTRAIN_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["DISTTRAIN_POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}, "its first line"
    assert env["DISTTRAIN_AGENT_PULSE_KEY_FILE"]["value"] == access.PULSE_KEY_FILE, "in the job's Secret, mounted"
    no_pulse = pods.build_agent_pod(job, pods.AgentSettings(heartbeat_s=0, pulse_s=0))["spec"]["containers"][0]
    assert [p["name"] for p in no_pulse["ports"]] == ["rendezvous"]
    assert not {e["name"] for e in no_pulse["env"]} & {"DISTTRAIN_AGENT_PULSE_PORT", "DISTTRAIN_POD_IP"}

    [_from_workers] = access.build_network_policy(job)["spec"]["ingress"]  # no operator known: none admitted
    settings = access.NetworkPolicySettings(
        operator_namespace="disttrain-system", operator_pod_selector={"matchLabels": {"app": "disttrain"}}
    )
    policy = access.build_network_policy(job, settings)
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    from_workers, from_operator = policy["spec"]["ingress"]
    assert from_workers == _from_workers
    assert from_operator == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "disttrain-system"}},
                "podSelector": {"matchLabels": {"app": "disttrain"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": pulse_port}],
    }
