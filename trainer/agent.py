"""The job agent: ``python -m disttrain.trainer.agent``. One small pod per job (or one process in local mode).

Why it exists: the c10d rendezvous store must outlive every worker (if it lives in a worker, losing that worker
kills the job, pytorch/elastic#115), and the operator needs a channel to the workers that does not depend on any
of them. The agent

* hosts the TCPStore that torchrun's rendezvous (``is_host=false``) and the trainer's control channel use;
* follows its job's ``status.control`` (the operator's directive) and writes it into ``SIGNAL_KEY`` and
  ``TARGET_KEY``;
* relays the trainer's ``PROGRESS_KEY``, ``CHECKPOINT_KEY`` and ``FAILURE_KEY`` into the job's status
  fields it owns (:data:`disttrain.api.status.AGENT_FIELDS`; it writes no other).

Where the job lives is a :class:`JobSource`: :class:`KubeJobSource` reads the DistTrainJob and patches only its
status subresource (the agent's Role allows nothing else); :class:`FileJobSource` lets the local runtime drive
the same agent from a state directory. If the agent dies, the operator recreates it; the workers re-join the
new store and resume from the last complete checkpoint, so nothing is lost.

It never imports kopf or the operator package.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import pathlib
import signal
import tempfile
import threading
from typing import Any, Optional, Protocol, cast

from disttrain.api import constants, env
from disttrain.api import control as keys
from disttrain.api.contract import job_checkpoint_dir
from disttrain.api.manifest import CheckpointManifest
from disttrain.api.spec import CheckpointSpec
from disttrain.api.status import AGENT_FIELDS
from disttrain.api.timestamps import format_time
from disttrain.trainer.commit import step_dir_name

log = logging.getLogger("disttrain.agent")


class JobSource(Protocol):
    """Where the agent reads its job and writes its part of the status."""

    def read(self) -> Optional[dict[str, Any]]:
        """The DistTrainJob (wire form, with status), or None when it no longer exists."""

    def patch_status(self, patch: dict[str, Any]) -> None:
        """Merge-patch (RFC 7386) ``status`` with ``patch``."""


class FileJobSource:
    """Local mode: the job is ``<state>/job.json`` (written by the local runtime), and the agent's status fields
    go to ``<state>/agent-status.json`` (written only by the agent, atomically), which the runtime merges into
    the job's status before each reconcile. Two files, one writer each: no lost updates."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = pathlib.Path(state_dir)
        self.job_path = self.state_dir / constants.LOCAL_JOB_FILE
        self.status_path = self.state_dir / constants.LOCAL_AGENT_STATUS_FILE

    def read(self) -> Optional[dict[str, Any]]:
        try:
            job = json.loads(self.job_path.read_text())
        except FileNotFoundError:
            return None
        status = dict(job.get("status") or {})
        status.update(self.agent_status())
        job["status"] = status
        return job

    def agent_status(self) -> dict[str, Any]:
        try:
            document = json.loads(self.status_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return document if isinstance(document, dict) else {}

    def patch_status(self, patch: dict[str, Any]) -> None:
        current = self.agent_status()
        for key, value in patch.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
        fd, tmp = tempfile.mkstemp(dir=self.state_dir, prefix=".agent-status.")
        with os.fdopen(fd, "w") as handle:
            json.dump(current, handle)
        os.replace(tmp, self.status_path)


class KubeJobSource:
    """Kubernetes: GET the job, PATCH its status subresource (merge patch). Needs only the agent's Role."""

    def __init__(self, namespace: str, name: str, api_client: Any = None) -> None:
        from kubernetes import client, config  # imported here: local mode needs no kubernetes package

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.api = client.CustomObjectsApi(api_client)
        self.namespace, self.name = namespace, name
        self._not_found = client.ApiException

    def read(self) -> Optional[dict[str, Any]]:
        try:
            job = self.api.get_namespaced_custom_object(
                constants.GROUP, constants.VERSION, self.namespace, constants.PLURAL, self.name
            )
            return cast("dict[str, Any]", job)
        except self._not_found as error:
            if error.status == 404:
                return None
            raise

    def patch_status(self, patch: dict[str, Any]) -> None:
        self.api.patch_namespaced_custom_object_status(
            constants.GROUP, constants.VERSION, self.namespace, constants.PLURAL, self.name, {"status": patch}
        )


class Agent:
    """One job's agent. ``sync()`` does one round of follow + relay; ``run()`` loops until stopped."""

    def __init__(self, source: JobSource, store: Any, *, poll_seconds: float = 0.25) -> None:
        self.source = source
        self.store = store
        self.poll_seconds = poll_seconds
        self.stop_event = threading.Event()
        self._written_signal: Optional[str] = None
        self._written_target: Optional[str] = None
        self._round_key: Optional[tuple[Any, ...]] = None
        self._rounds: Optional[int] = None
        self._round_start: Optional[str] = None

    def sync(self) -> bool:
        """Follow the directive and relay progress once. False when the job is gone (the agent should exit)."""
        job = self.source.read()
        if job is None:
            return False
        status = job.get("status") or {}
        self._write_directive(status.get("control") or {})
        patch = self._relay(job, status)
        if patch:
            self.source.patch_status(patch)
        return True

    def _write_directive(self, control: dict[str, Any]) -> None:
        generation = int(control.get("generation", 0))
        signal_value = keys.ControlSignal(
            generation=generation, action=control.get("action", "none"), reason=control.get("reason", "")
        ).model_dump_json()
        if signal_value != self._written_signal:
            self.store.set(keys.SIGNAL_KEY, signal_value)
            self._written_signal = signal_value
            log.info("directive %s", signal_value)
        target_nodes = int(control.get("targetNodes", 0))
        if target_nodes > 0:
            target_value = keys.TargetPlan(
                generation=generation, nodes=target_nodes, exclude=list(control.get("exclude") or [])
            ).model_dump_json()
            if target_value != self._written_target:
                self.store.set(keys.TARGET_KEY, target_value)
                self._written_target = target_value

    def _relay(self, job: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        """Agent-owned status fields that differ from what the job's status holds."""
        wanted: dict[str, Any] = {}
        report = keys.read_model(self.store, keys.PROGRESS_KEY, keys.ProgressReport)
        if report is not None:
            if self._rounds is None:
                self._rounds = int(status.get("rendezvousRound", 0))
            # A new group (round) is a new rank-0 process; the run id, restart count and world size can all
            # repeat (a replaced node that becomes rank 0 after a reform at the same size), the process id not.
            round_key = (report.run_id, report.restart_count, report.world_size, report.process_id)
            if round_key != self._round_key:
                self._round_key = round_key
                self._rounds += 1
                self._round_start = format_time(report.time)
            wanted.update(
                step=report.step,
                samplesConsumed=report.samples_consumed,
                worldSize=report.world_size,
                plan=report.plan,
                lastProgressTime=format_time(report.time),
                rendezvousRound=self._rounds,
                roundStartTime=self._round_start,
            )
        manifest = keys.read_model(self.store, keys.CHECKPOINT_KEY, CheckpointManifest)
        if manifest is not None:
            path = f"{_checkpoint_dir(job)}/{step_dir_name(manifest.step)}"
            wanted["lastCheckpoint"] = {
                "step": manifest.step,
                "samples": manifest.samples_consumed,
                "path": path,
                "time": manifest.created_at,
                "worldSize": manifest.world_size,
            }
        failure = keys.read_model(self.store, keys.FAILURE_KEY, keys.WorkerFailure)
        if failure is not None:
            wanted["workerFailure"] = {
                "exitCode": failure.exit_code,
                "node": failure.node,
                "message": failure.message,
                "time": format_time(failure.time),
            }
        return {k: v for k, v in wanted.items() if k in AGENT_FIELDS and status.get(k) != v}

    def run(self) -> int:
        """Loop until the job is gone or ``stop_event`` is set; transient API errors are logged and retried."""
        while not self.stop_event.is_set():
            try:
                if not self.sync():
                    log.info("job is gone; exiting")
                    return 0
            except Exception:
                log.exception("agent round failed; retrying")
            self.stop_event.wait(self.poll_seconds)
        return 0


def _checkpoint_dir(job: dict[str, Any]) -> str:
    """The job's checkpoint directory as the worker pods see it (``$DISTTRAIN_CHECKPOINT_DIR``)."""
    root = ((job.get("spec") or {}).get("checkpoint") or {}).get("path") or CheckpointSpec.model_fields["path"].default
    meta = job.get("metadata") or {}
    return job_checkpoint_dir(root, meta.get("namespace", "default"), meta.get("name", ""))


def start_store(port: int, host: str = "0.0.0.0", timeout_s: float = 60.0) -> Any:
    """The TCPStore server the c10d rendezvous and the control channel share (torch imported here only)."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disttrain.trainer.agent", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=29400, help="TCPStore port (spec.rendezvous.port)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--state-dir", help="local mode: follow <dir>/job.json instead of the Kubernetes API")
    parser.add_argument("--namespace", default=os.environ.get(env.JOB_NAMESPACE, "default"))
    parser.add_argument("--name", default=os.environ.get(env.JOB_NAME))
    parser.add_argument("--poll-seconds", type=float, default=0.25)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.state_dir:
        source: JobSource = FileJobSource(args.state_dir)
    elif args.name:
        source = KubeJobSource(args.namespace, args.name)
    else:
        parser.error(f"--name (or ${env.JOB_NAME}) or --state-dir is required")
    store = start_store(args.port, args.host)
    agent = Agent(source, store, poll_seconds=args.poll_seconds)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop_event.set())
    log.info("agent for %s serving the store on %s:%d", args.name or args.state_dir, args.host, args.port)
    return agent.run()


if __name__ == "__main__":
    raise SystemExit(main())
