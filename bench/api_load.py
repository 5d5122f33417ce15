"""API load of running jobs, counted by a real Kubernetes API server (its own ``apiserver_request_total``).

Starts etcd and kube-apiserver (``tests/cluster/controlplane.py``), creates N Nodes that send kubelet
heartbeats, runs the real operator as a process under the Helm chart's RBAC, applies J three-node jobs whose
pods the harness keeps Running and whose real job agents relay what stand-in trainers write into their stores
(``bench/_jobs.py`` says why that is faithful), waits until every job is Running, then measures a steady-state
window: disttrain's requests (operator and agents; ``bench/_apicount.py`` says how the harness's own are told
apart), the agents' status writes by the agent's own reason for each, the operator's RSS and CPU time. Last, the
directive latency: one job at a time is scaled from its N nodes to N - 1
through its scale subresource while the others train, and the time until the drain directive is in its
status is taken from a watch on that job (and from one on every job, for comparison with earlier figures), with
the time to the request's answer and to the operator's decision (its ``issuedAt``) beside it.

    python bench/api_load.py [--jobs 50] [--nodes 100] [--window 60] [--step-seconds 0.25] [--checkpoint-every 12]
                             [--agent-poll-seconds 0.25] [--agent-pulse-seconds 0.2]

Defaults mirror the issue's measurement: 4 steps/s and a checkpoint every 12 steps (20 a minute).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import pathlib
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Optional

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.cluster: the control plane and the operator process of the test tier

import _apicount  # noqa: E402
import _fleet  # noqa: E402
import _jobs  # noqa: E402
from kubernetes import client as k8s  # noqa: E402
from kubernetes import config as kube_config  # noqa: E402
from tests.chart.helm import object_name  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.harness import start_operator  # noqa: E402

from disttrain.api import constants, timestamps  # noqa: E402

NAMESPACE = "bench"
AGENT_WRITES = "the agents' status writes"
TIMEOUT = 30


def job_manifest(name: str, nodes: int = 3) -> dict[str, Any]:
    """A job of ``nodes`` one-process worker nodes (elastic from 1 to one more), scaled down by one when probed."""
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.KIND,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "template": {
                "spec": {
                    "containers": [{"name": "trainer", "image": "bench/trainer:1", "command": ["python", "train.py"]}]
                }
            },
            "nodes": {"min": 1, "max": nodes + 1, "replicas": nodes},
            "training": {
                "globalBatchSize": _jobs.global_batch(nodes + 1),
                "microBatchSize": _jobs.MICRO_BATCH,
                "lr": {"base": 0.1},
                "maxSteps": 10**8,
            },
            "checkpoint": {"claimName": "ckpt", "intervalSteps": 12},
            "elastic": {"scaleDebounceSeconds": 0},
        },
    }


def process_stats(pid: int) -> tuple[float, float]:
    """(RSS in MiB, user + system CPU seconds) of a process, from /proc."""
    rss_kb = 0
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return rss_kb / 1024, (int(fields[11]) + int(fields[12])) / ticks


def wait_for(check: Any, timeout: float, what: str, interval: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s (last: {value!r})")
        time.sleep(interval)


def list_jobs(custom: k8s.CustomObjectsApi) -> list[dict[str, Any]]:
    response = custom.list_namespaced_custom_object(
        constants.GROUP,
        constants.VERSION,
        NAMESPACE,
        constants.PLURAL,
        _preload_content=False,
        _request_timeout=120,  # 500 jobs are megabytes
    )
    return list(json.loads(response.data)["items"])


def all_running(custom: k8s.CustomObjectsApi) -> bool:
    try:
        return all((j.get("status") or {}).get("phase") == "Running" for j in list_jobs(custom))
    except Exception:  # noqa: BLE001 (a busy API server: ask again later)
        return False


def agent_kubeconfig(plane: ControlPlane, core: k8s.CoreV1Api, name: str) -> str:
    """A kubeconfig holding a token of the job's own ServiceAccount (created by the operator)."""
    answer = core.create_namespaced_service_account_token(
        f"{name}-agent",
        NAMESPACE,
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 7200}},
        _request_timeout=TIMEOUT,
    )
    return str(plane.write_kubeconfig(f"agent-{name}", answer.status.token))


class DirectiveClock:
    """A watch on every job: when a job's ``status.control.generation`` moves past a given value."""

    def __init__(self, api_client: k8s.ApiClient) -> None:
        self.custom = k8s.CustomObjectsApi(api_client)
        self.generation: dict[str, int] = {}
        self.seen_at: dict[tuple[str, int], float] = {}
        self.issued_at: dict[tuple[str, int], str] = {}
        """The operator's own stamp of its decision (``status.control.issuedAt``), per job and generation."""
        self.changed = threading.Condition()
        threading.Thread(target=self._watch, name="directive-clock", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                response = self.custom.list_namespaced_custom_object(
                    constants.GROUP,
                    constants.VERSION,
                    NAMESPACE,
                    constants.PLURAL,
                    watch=True,
                    timeout_seconds=3600,
                    _preload_content=False,
                    # 500 jobs write every few seconds: a minute without an event is a dead connection, not calm
                    _request_timeout=(10, 60),
                )
                for event in _fleet.stream_events(response):
                    job = event.get("object") or {}
                    name = (job.get("metadata") or {}).get("name", "")
                    control = (job.get("status") or {}).get("control") or {}
                    generation = int(control.get("generation", 0))
                    with self.changed:
                        if generation != self.generation.get(name):
                            self.generation[name] = generation
                            self.seen_at.setdefault((name, generation), time.monotonic())
                            if control.get("issuedAt"):
                                self.issued_at[name, generation] = control["issuedAt"]
                            self.changed.notify_all()
            except Exception:  # noqa: BLE001 (a broken watch: start another)
                time.sleep(0.5)

    def wait_listed(self, names: list[str], timeout: float) -> None:
        """Until the watch has delivered every one of ``names``: at 500 jobs its first list takes the API server
        seconds, which must not fall on the first scale requests."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not all(name in self.generation for name in names):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sum(name not in self.generation for name in names)
                    raise TimeoutError(f"the watch on every job delivered {len(names) - missing} of {len(names)}")
                self.changed.wait(left)

    def wait_past(self, name: str, generation: int, timeout: float) -> tuple[float, Optional[str]]:
        """Monotonic time at which the watch showed a generation above ``generation``, and its issuedAt."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.generation.get(name, 0) <= generation:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no new directive for {name} within {timeout:.0f} s")
                self.changed.wait(left)
            key = (name, self.generation[name])
            return self.seen_at[key], self.issued_at.get(key)


class JobWatch:
    """A watch on one job alone (a field selector on its name), as ``kubectl get dtj NAME --watch`` holds one.

    Why beside :class:`DirectiveClock`: that watch carries every job's writes (about 50 a second at 500 jobs), and
    this process decodes each of them before it reaches the probed job's, so it adds the probe's own delay to
    the directive's."""

    def __init__(self, custom: k8s.CustomObjectsApi, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        self.response = custom.list_namespaced_custom_object(
            constants.GROUP,
            constants.VERSION,
            NAMESPACE,
            constants.PLURAL,
            field_selector=f"metadata.name={name}",
            watch=True,
            timeout_seconds=int(timeout) + 30,
            _preload_content=False,
            _request_timeout=(10, timeout),
        )
        self.events = _fleet.stream_events(self.response)
        self.generation = self._generation(next(self.events))  # the job as it is (the watch's first ADDED)

    @staticmethod
    def _generation(event: dict[str, Any]) -> int:
        return int(((event.get("object") or {}).get("status") or {}).get("control", {}).get("generation", 0))

    def _wait_for(self, reached: Callable[[dict[str, Any]], bool], what: str) -> float:
        """Monotonic time at which the watch showed an event for which ``reached`` holds."""
        deadline = time.monotonic() + self.timeout
        try:
            for event in self.events:
                if reached(event):
                    return time.monotonic()
                if time.monotonic() > deadline:
                    break
        except Exception as error:  # the client's read timeout, or a closed watch
            raise TimeoutError(f"{self.name}: {what}, not on its own watch: {error}") from error
        raise TimeoutError(f"{self.name}: {what}, not within {self.timeout:.0f} s on its own watch")

    def wait_past(self, generation: int) -> float:
        """Monotonic time at which the watch showed a generation above ``generation``."""
        return self._wait_for(lambda event: self._generation(event) > generation, "a new directive")

    def wait_settled(self, nodes: int) -> float:
        """Monotonic time at which the watch showed the directive done (``control.action`` none: a new round at the
        target size) and ``nodes`` worker pods left (the drain's victim deleted)."""

        def settled(event: dict[str, Any]) -> bool:
            status = (event.get("object") or {}).get("status") or {}
            done = (status.get("control") or {}).get("action", "none") == "none"
            return done and status.get("replicas") == nodes

        return self._wait_for(settled, f"the drain's end at {nodes} nodes")

    def close(self) -> None:
        self.response.close()


@dataclasses.dataclass
class Probes:
    """Milliseconds from each scale request to: its answer, the operator's decision, the directive seen."""

    answered: list[float] = dataclasses.field(default_factory=list)
    decided: list[float] = dataclasses.field(default_factory=list)
    seen_own_watch: list[float] = dataclasses.field(default_factory=list)
    seen_all_jobs_watch: list[float] = dataclasses.field(default_factory=list)
    settled: list[float] = dataclasses.field(default_factory=list)
    """To the drain's end: the group re-formed at the new size and the victim's pod gone (settled pacing only)."""
    seconds: float = 0.0
    """How long the probes took, all together."""
    rows: list[tuple[float, float, Optional[float], float]] = dataclasses.field(default_factory=list)
    """Per probe: seconds since the first, then its answer, decision (None: no issuedAt) and directive (own watch)."""


def measure_directive_latency(
    kubeconfig: str, names: list[str], samples: int, timeout: float, settle: bool = True, job_nodes: int = 3
) -> Probes:
    """Scale ``samples`` jobs of ``job_nodes`` nodes down by one, one at a time, and time each: the scale request's
    answer, the operator's decision (its ``issuedAt`` stamp, same clock), and the directive in the job's status as
    seen by a watch on that job alone (:class:`JobWatch`) and by one on every job (:class:`DirectiveClock`). Runs in
    a process of its own (:func:`probe_directive_latency`): in the benchmark's process the J agents' threads would
    delay the request and the watches (one interpreter, one GIL), which a user's ``kubectl scale`` never shares.

    ``settle``: the next request waits until the job scaled last has finished its drain (the time to that is taken
    too), so each directive is timed among jobs that train, as the issue asks; without it (the pacing of earlier
    figures) a request follows 0.5 s after the last directive, while that job's drain still writes."""
    admin = kube_config.new_client_from_config(config_file=kubeconfig)
    custom = k8s.CustomObjectsApi(admin)
    clock = DirectiveClock(admin)
    clock.wait_listed(names, timeout)
    time.sleep(2.0)  # the API server is done with the watch's first list (every job, each a few KiB) before a request
    chosen = names[:: max(1, len(names) // samples)][:samples]
    probes = Probes()
    began = time.monotonic()
    for name in chosen:
        watch = JobWatch(custom, name, timeout)
        with clock.changed:
            before = clock.generation.get(name, 0)
        started = time.monotonic()
        started_wall = time.time()
        try:
            custom.patch_namespaced_custom_object_scale(
                constants.GROUP,
                constants.VERSION,
                NAMESPACE,
                constants.PLURAL,
                name,
                {"spec": {"replicas": job_nodes - 1}},
                _content_type="application/merge-patch+json",
                _request_timeout=TIMEOUT,
            )
            answered = (time.monotonic() - started) * 1000
            probes.answered.append(answered)
            try:
                seen_own = watch.wait_past(watch.generation)
                seen_all, issued = clock.wait_past(name, before, max(1.0, timeout - (time.monotonic() - started)))
            except TimeoutError as error:  # counted at the timeout (the p99 shows it), with what the job says
                job = custom.get_namespaced_custom_object(
                    constants.GROUP, constants.VERSION, NAMESPACE, constants.PLURAL, name
                )
                status = job.get("status") or {}
                replicas = (job["spec"].get("nodes") or {}).get("replicas")
                print(
                    f"{error}: spec.nodes.replicas {replicas}, status.control {status.get('control')}, "
                    f"pendingScale {status.get('pendingScale')}, the all-jobs watch's generation "
                    f"{clock.generation.get(name)}",
                    file=sys.stderr,
                )
                probes.seen_own_watch.append(timeout * 1000)
                probes.seen_all_jobs_watch.append(timeout * 1000)
                continue
            probes.seen_own_watch.append((seen_own - started) * 1000)
            probes.seen_all_jobs_watch.append((seen_all - started) * 1000)
            issued_s = timestamps.parse_time(issued)
            decided = None if issued_s is None else (issued_s - started_wall) * 1000
            if decided is not None:
                probes.decided.append(decided)
            probes.rows.append((started - began, answered, decided, (seen_own - started) * 1000))
            if settle:
                try:
                    probes.settled.append((watch.wait_settled(job_nodes - 1) - started) * 1000)
                except TimeoutError as error:
                    print(error, file=sys.stderr)
                    probes.settled.append(timeout * 1000)
        finally:
            watch.close()
        time.sleep(0.5)
    probes.seconds = time.monotonic() - began
    return probes


def probe_directive_latency(
    plane: ControlPlane, names: list[str], samples: int, timeout: float, settle: bool = True, job_nodes: int = 3
) -> Probes:
    """:func:`measure_directive_latency` in a fresh interpreter."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as probe:
        return probe.submit(
            measure_directive_latency, str(plane.kubeconfig), names, samples, timeout, settle, job_nodes
        ).result()


class ApiserverProfile:
    """The API server's CPU profile over the next ``seconds`` (its built-in ``/debug/pprof/profile``, on by
    default), fetched in a thread into ``folder/apiserver-<label>.pprof``; nothing when ``folder`` is None.

    Why: the directive's tail is the API server's answers on a CPU-bound machine, and only its own profile says
    which of its stages (decoding, admission, managed fields, watch fan-out) take the CPU."""

    def __init__(self, plane: ControlPlane, folder: Optional[pathlib.Path], label: str, seconds: float) -> None:
        self.thread: Optional[threading.Thread] = None
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"apiserver-{label}.pprof"
        self.url = f"{plane.server}/debug/pprof/profile?seconds={int(seconds)}"
        self.seconds = seconds
        self.context = ssl.create_default_context(cafile=str(plane.pki.ca_crt))
        self.token = plane.admin_token
        self.thread = threading.Thread(target=self._fetch, name=f"profile-{label}", daemon=True)
        self.thread.start()

    def _fetch(self) -> None:
        request = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=self.seconds + 60) as response:
                self.path.write_bytes(response.read())
            print(f"API server CPU profile: {self.path}", flush=True)
        except (OSError, urllib.error.URLError) as error:
            print(f"no API server profile ({self.path.name}): {error}", file=sys.stderr)

    def join(self) -> None:
        """Wait for the profile (the probes may end before its time is up)."""
        if self.thread is not None:
            self.thread.join()


class OperatorProfile:
    """The operator's Python stacks over the next ``seconds``, sampled by ``py-spy record`` (folded stacks, one line
    per stack with its sample count) into ``folder/operator-<label>.txt``; nothing when ``folder`` is None.

    Why: what the operator spends its CPU on as jobs and pods grow is read off its own stacks, not guessed."""

    def __init__(self, pid: int, folder: Optional[pathlib.Path], label: str, seconds: float) -> None:
        self.process: Optional[subprocess.Popen[bytes]] = None
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"operator-{label}.txt"
        command = ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "50"]
        command += ["--format", "raw", "--nonblocking", "--output", str(self.path)]
        try:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except OSError as error:
            print(f"no operator profile: {error}", file=sys.stderr)

    def join(self) -> None:
        if self.process is None:
            return
        _out, err = self.process.communicate()
        if self.process.returncode == 0:
            print(f"operator CPU profile: {self.path} (top: {', '.join(top_functions(self.path, 5))})", flush=True)
        else:
            print(f"no operator profile: {err.decode(errors='replace')[-300:]}", file=sys.stderr)


def top_functions(folded: pathlib.Path, count: int) -> list[str]:
    """The functions with the most samples on their stacks (inclusive) in a folded-stacks file, with their share."""
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in folded.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            continue
        total += int(samples)
        for frame in set(stack.split(";")):
            inclusive[frame.split(" (")[0]] += int(samples)
    return [f"{name} {value / max(total, 1):.0%}" for name, value in inclusive.most_common(count)]


def events_by_reason(core: k8s.CoreV1Api, since: float) -> collections.Counter[str]:
    """Events in the benchmark's namespace last recorded at or after ``since`` (Unix time), by reason."""
    reasons: collections.Counter[str] = collections.Counter()
    for event in core.list_namespaced_event(NAMESPACE, _request_timeout=120).items:
        stamp = event.last_timestamp or event.event_time or event.metadata.creation_timestamp
        if stamp is not None and stamp.timestamp() >= since:
            reasons[f"{event.type} {event.reason}"] += 1
    return reasons


class CpuShares:
    """CPU seconds per wall second of the processes that share this machine, over a window."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.started = time.monotonic()
        self.before = {name: process_stats(pid)[1] for name, pid in pids.items()}

    def lines(self) -> list[str]:
        elapsed = time.monotonic() - self.started
        shares = {name: (process_stats(pid)[1] - self.before[name]) / elapsed for name, pid in self.pids.items()}
        return [f"  {name:28s} {share:5.2f} cores" for name, share in sorted(shares.items(), key=lambda kv: -kv[1])]


def _quantile(values: list[float], q: int) -> float:
    """The ``q``-th percentile (inclusive method: between the sorted values, never beyond them)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _p99(values: list[float]) -> float:
    return _quantile(values, 99)


def _quantile_columns(values: list[float]) -> str:
    if not values:
        return "(none)"
    return "".join(f"{v:8.0f}" for v in (_quantile(values, 50), _quantile(values, 95), _p99(values), max(values)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=100, help="Nodes of the cluster (at most 110 pods each)")
    parser.add_argument(
        "--job-nodes",
        type=int,
        default=3,
        help="worker nodes (pods) of each job; a job has one agent pod more (2,000 jobs of 10: 20,000 worker pods)",
    )
    parser.add_argument("--window", type=float, default=60.0, help="seconds of steady state measured")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of steady state before the window")
    parser.add_argument("--step-seconds", type=float, default=0.25, help="one training step of every job")
    parser.add_argument("--checkpoint-every", type=int, default=12, help="steps between checkpoints")
    parser.add_argument(
        "--latency-samples",
        type=int,
        default=200,
        help="scale requests probed, one job each (at most --jobs): the p99 of 60 samples lies between their two "
        "largest, of 200 at the third largest",
    )
    parser.add_argument(
        "--agent-poll-seconds",
        type=float,
        default=0.25,
        help="how often each agent reads its store (the agent's default; no API request depends "
        "on it, but J agents share this process's CPU)",
    )
    parser.add_argument(
        "--agent-processes",
        type=int,
        default=4,
        help="interpreters the J agents are spread over (in a cluster each has a pod of its own; in one interpreter "
        "their watches are read late, behind one GIL)",
    )
    parser.add_argument(
        "--no-progress-level",
        dest="progress_level",
        action="store_false",
        help="without the chart's priority level for the agents' status writes (flowControl.progress.enabled=false)",
    )
    parser.add_argument(
        "--agent-pulse-seconds",
        type=float,
        default=constants.AGENT_PULSE_SECONDS,
        help="the operator's --agent-pulse-seconds: every agent pod's pulse, which the operator holds a link to "
        "(0: none; default %(default)s)",
    )
    parser.add_argument(
        "--back-to-back",
        dest="settle",
        action="store_false",
        help="the next scale request 0.5 s after the last directive was seen, while that job still drains (the "
        "pacing of the figures until 2026-12-03 afternoon); by default it waits until that drain is over",
    )
    parser.add_argument(
        "--control-plane-gogc",
        type=int,
        help="GOGC for etcd and kube-apiserver (Go's default is 100): a diagnosis of how much of the tail is the "
        "API server's garbage collection on a CPU-bound machine, not a setting disttrain ships",
    )
    parser.add_argument(
        "--apiserver-profile",
        type=pathlib.Path,
        help="a folder: save the API server's CPU profile (Go pprof, /debug/pprof/profile) over the steady window "
        "and over the directive probes there (read with `go tool pprof -top FILE`)",
    )
    parser.add_argument(
        "--operator-profile",
        type=pathlib.Path,
        help="a folder: save the operator's Python stacks over the steady window there (py-spy record, folded)",
    )
    args = parser.parse_args()
    if args.job_nodes < 2:
        parser.error(f"--job-nodes={args.job_nodes}: at least 2 (each probe scales a job down by one node)")
    pods_per_job = args.job_nodes + 1
    if args.nodes * 110 < args.jobs * pods_per_job:
        parser.error(
            f"--nodes={args.nodes} hold at most {args.nodes * 110} pods; {args.jobs} jobs of {args.job_nodes} nodes "
            f"need {args.jobs * pods_per_job} (with their agents)"
        )

    if args.control_plane_gogc is not None:
        os.environ["GOGC"] = str(args.control_plane_gogc)  # inherited by the control plane's processes only (Go)
    plane = ControlPlane(service_cidr="10.0.0.0/16")  # a ClusterIP per job agent Service
    work = pathlib.Path(tempfile.mkdtemp(prefix="disttrain-apiload-"))
    operator = None
    fleet = jobs = None
    try:
        print(f"control plane at {plane.server}; logs in {plane.logs}; operator log in {work}", flush=True)
        pulse_key = os.urandom(32)
        (work / "pulse-key").write_text(pulse_key.hex())
        operator_args = [
            f"--agent-pulse-seconds={args.agent_pulse_seconds:g}",
            f"--agent-pulse-key-file={work}/pulse-key",
        ]
        operator = start_operator(plane, work / "operator.log", operator_args)
        if not args.progress_level:  # as before the chart bounded them: the agents' writes in workload-low
            plane.kubectl("delete", "flowschema,prioritylevelconfiguration", f"{object_name()}-progress")
        admin = plane.api_client()
        core, custom = k8s.CoreV1Api(admin), k8s.CustomObjectsApi(admin)
        plane.create_namespace(NAMESPACE)
        # No controller-manager runs: create the ServiceAccount that its controller would (pods need it).
        core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": "default"}}, _request_timeout=TIMEOUT)

        fleet = _fleet.Fleet(admin, pulse_key)
        fleet.add_nodes(args.nodes)
        fleet.start()
        names = [f"job-{i:04d}" for i in range(args.jobs)]
        started = time.monotonic()
        for name in names:
            custom.create_namespaced_custom_object(
                constants.GROUP,
                constants.VERSION,
                NAMESPACE,
                constants.PLURAL,
                job_manifest(name, args.job_nodes),
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )
        pods = pods_per_job * args.jobs
        wait_for(lambda: len(fleet.running) >= pods, timeout=120 + pods / 2, what=f"{pods} pods running")
        print(f"{pods} pods running after {time.monotonic() - started:.0f} s", flush=True)

        shard_options = _jobs.ShardOptions(
            step_seconds=args.step_seconds,
            checkpoint_every=args.checkpoint_every,
            poll_seconds=args.agent_poll_seconds,
            job_nodes=args.job_nodes,
            jobs_per_second=25.0,
            writes_dir=work / "agent-writes",
        )
        jobs = _jobs.ShardedJobFleet(args.agent_processes, shard_options)
        for name in names:
            jobs.add(NAMESPACE, name, agent_kubeconfig(plane, core, name))
        jobs.start()
        wait_for(lambda: all_running(custom), timeout=120 + 2 * args.jobs, what="every job Running", interval=5.0)
        print(
            f"{args.jobs} jobs Running after {time.monotonic() - started:.0f} s; warming up {args.warmup:.0f} s",
            flush=True,
        )
        time.sleep(args.warmup)

        metrics_text = plane.request("GET", "/metrics", raw=True).decode()
        counts_before, flows_before = _apicount.read_counts(metrics_text), _apicount.read_flows(metrics_text)
        _rss, cpu_before = process_stats(operator.proc.pid)
        shares = CpuShares(
            {
                **{name: proc.pid for name, proc in plane.processes.items()},
                "operator": operator.proc.pid,
                "benchmark (nodes, kubelets)": os.getpid(),
                **{f"agents ({i + 1}/{len(jobs.pids)})": pid for i, pid in enumerate(jobs.pids)},
            }
        )
        window_profile = ApiserverProfile(plane, args.apiserver_profile, "window", args.window)
        operator_profile = OperatorProfile(operator.proc.pid, args.operator_profile, "window", args.window)
        writes_before = jobs.status_writes()
        window_started = time.monotonic()
        window_started_wall = time.time()
        time.sleep(args.window)
        window_profile.join()
        operator_profile.join()
        elapsed = time.monotonic() - window_started
        writes_delta = jobs.status_writes() - writes_before
        metrics_text = plane.request("GET", "/metrics", raw=True).decode()
        counts_after, flows_after = _apicount.read_counts(metrics_text), _apicount.read_flows(metrics_text)
        rss_mb, cpu_after = process_stats(operator.proc.pid)
        minutes = elapsed / 60
        print(f"CPU over the window (load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores):")
        print("\n".join(shares.lines()))

        delta = _apicount.disttrain_delta(counts_before, counts_after)
        total = sum(delta.values())
        print(f"\ndisttrain's requests over {elapsed:.0f} s of steady state ({args.jobs} jobs, {args.nodes} nodes):")
        for key, value in sorted(delta.items(), key=lambda kv: -kv[1]):
            print(f"  {_apicount.describe(key):40s} {value:8.0f}  ({value / args.jobs / minutes:.2f} per job-minute)")
        print("by caller (the chart's FlowSchemas; a watch counts when it starts):")
        by_caller: dict[str, float] = {}
        for caller, schema in (
            ("the operator", object_name()),
            (AGENT_WRITES, f"{object_name()}-progress"),
        ):
            value = flows_after.get(schema, 0.0) - flows_before.get(schema, 0.0)
            by_caller[caller] = value / args.jobs / minutes
            print(f"  {caller:40s} {value:8.0f}  ({by_caller[caller]:.2f} per job-minute)")
        print(f"the agents' status writes by the agent's reason ({_jobs.WRITES_FILE_SECONDS:g} s resolution):")
        for reason, value in writes_delta.most_common():
            print(f"  {reason:40s} {value:8.0f}  ({value / args.jobs / minutes:.2f} per job-minute)")
        print("Events recorded in the window (after the count: this list is not in it), by type and reason:")
        for reason, value in events_by_reason(core, window_started_wall).most_common():
            print(f"  {reason:40s} {value:8.0f}")
        phases = {(j.get("status") or {}).get("phase") for j in list_jobs(custom)}
        print(f"job phases at the end of the window: {sorted(str(p) for p in phases)}")
        if fleet.errors:
            print(f"harness errors: {fleet.errors[:5]}")

        metrics_before = plane.request("GET", "/metrics", raw=True).decode()
        durations_before = _apicount.read_durations(metrics_before)
        stages_before = _apicount.read_stages(metrics_before)
        probe_profile = ApiserverProfile(plane, args.apiserver_profile, "probes", args.window)
        probe_counts = _apicount.read_counts(metrics_before)
        probes = probe_directive_latency(
            plane, names, min(args.latency_samples, args.jobs), timeout=60, settle=args.settle, job_nodes=args.job_nodes
        )
        probe_profile.join()
        metrics_after = plane.request("GET", "/metrics", raw=True).decode()
        probe_delta = _apicount.disttrain_delta(probe_counts, _apicount.read_counts(metrics_after))
        pacing = "each after the last drain ended" if args.settle else "back to back"
        print(
            f"\n{len(probes.seen_own_watch)} scale requests ({pacing}) in {probes.seconds:.0f} s; disttrain's "
            f"requests meanwhile: {sum(probe_delta.values()) / max(probes.seconds, 1e-9):.1f} a second "
            f"(steady state: {total / elapsed:.1f}), per scale request and kind:"
        )
        for key, value in sorted(probe_delta.items(), key=lambda kv: -kv[1]):
            print(f"  {_apicount.describe(key):40s} {value / max(1, len(probes.seen_own_watch)):8.1f}")
        durations = (durations_before, _apicount.read_durations(metrics_after))
        for key in (("PATCH", "disttrainjobs", "scale"), ("PATCH", "disttrainjobs", "status")):
            p50, p99 = (_apicount.duration_quantile(*durations, key, q) for q in (0.5, 0.99))
            print(f"API server's own latency of {_apicount.describe(key)} meanwhile: p50 <= {p50} s, p99 <= {p99} s")
        print("inside the API server meanwhile (APF queue wait, execution, etcd; count, p50, p99):")
        print("\n".join(_apicount.stage_lines(stages_before, _apicount.read_stages(metrics_after))))
        print("from the scale request (ms):           p50     p95     p99     max   all, sorted")
        for label, values in (
            ("its answer", probes.answered),
            ("the operator's decision (issuedAt)", probes.decided),
            ("the directive, the job's own watch", probes.seen_own_watch),
            ("the directive, a watch on every job", probes.seen_all_jobs_watch),
            ("the drain's end (new round, N - 1)", probes.settled),
        ):
            if values:
                print(f"  {label:36s} {_quantile_columns(values)}   {', '.join(f'{v:.0f}' for v in sorted(values))}")
        print("the slowest directives (at s since the first request: answer / decision / directive, ms):")
        for offset, answered, decided, seen in sorted(probes.rows, key=lambda row: -row[3])[:8]:
            decision = "-" if decided is None else f"{decided:.0f}"
            print(f"  at {offset:6.1f} s: {answered:5.0f} / {decision:>5s} / {seen:5.0f}")
        forbidden = operator.forbidden_lines()
        if forbidden:
            print("operator 403s:\n" + "\n".join(forbidden[:10]))

        print(f"jobs: {args.jobs}")
        print(f"nodes: {args.nodes}")
        print(f"worker_pods: {args.jobs * args.job_nodes}")
        print(f"window_seconds: {elapsed:.0f}")
        print(f"requests_per_job_minute: {total / args.jobs / minutes:.2f}")
        print(f"requests_per_job_minute_operator: {by_caller['the operator']:.2f}")
        print(f"requests_per_job_minute_agent_status_writes: {by_caller[AGENT_WRITES]:.2f}")
        lease_writes = 60 / constants.AGENT_LEASE_RENEW_SECONDS
        print(
            "agent_lease_renewals_per_job_minute: 0 at the chart's default (no Lease while the agents pulse); "
            f"{lease_writes:.0f} with agent.heartbeatSeconds {constants.AGENT_LEASE_RENEW_SECONDS:g} "
            "(not in the counts: the benchmark's agents renew none)"
        )
        print(f"operator_rss_mb: {rss_mb:.0f}")
        print(f"operator_cpu_seconds_per_minute: {(cpu_after - cpu_before) / minutes:.2f}")
        print(
            f"agent_pulse_seconds: {args.agent_pulse_seconds:g}; operator pulse links at the end: {fleet.pulse_links()}"
        )
        print(f"directive_latency_p99_ms: {_p99(probes.seen_own_watch):.0f}")
        print(f"directive_latency_all_jobs_watch_p99_ms: {_p99(probes.seen_all_jobs_watch):.0f}")
        if probes.decided:
            print(f"decision_latency_p99_ms: {_p99(probes.decided):.0f}")
        if probes.settled:
            print(f"scale_down_done_p99_ms: {_p99(probes.settled):.0f}")
        return 0
    except Exception as error:  # noqa: BLE001 (any failure: say what, with the operator's last words)
        print(f"benchmark failed: {error}", file=sys.stderr)
        if operator is not None:
            print(operator.log_text()[-3000:], file=sys.stderr)
        return 1
    finally:
        if jobs is not None:
            jobs.stop()
        if fleet is not None:
            fleet.stop()
        if operator is not None:
            operator.kill()
        plane.stop()


if __name__ == "__main__":
    raise SystemExit(main())
