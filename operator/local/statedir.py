"""The local state directory of one job: what ``run`` writes and what ``status`` / ``scale`` read and write.

Layout (``<root>/<job name>/`` by default, ``.disttrain/<job name>/`` under the working directory)::

    job.json          the job as the local "API server" holds it: metadata, spec, status (the agent's source)
    status.json       the job's status alone (written atomically after every reconcile that changed it)
    events.jsonl      one JSON event per line: time, type, reason, message
    runtime.json      pid of the running ``disttrain local run``, its metrics URL, node metrics ports
    requests/         scale requests from other terminals (``scale-<time>.json``), consumed by the runtime
    logs/             one log per node (``<pod name>.log``) and ``agent.log``
    checkpoints/      the job's checkpoint directory (DISTTRAIN_CHECKPOINT_DIR of every node)
    summary.json      the final summary once the run ended

Every JSON file is replaced atomically (write a temp file, rename), so a reader in another terminal never sees
half a document.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any, Optional

from disttrain.api import constants

DEFAULT_ROOT = ".disttrain"


class StateDir:
    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    @classmethod
    def for_job(cls, job_name: str, state_dir: Optional[str] = None) -> StateDir:
        if state_dir:
            return cls(pathlib.Path(state_dir).resolve())
        return cls((pathlib.Path.cwd() / DEFAULT_ROOT / job_name).resolve())

    # -- layout
    @property
    def job_file(self) -> pathlib.Path:
        return self.path / constants.LOCAL_JOB_FILE

    @property
    def status_file(self) -> pathlib.Path:
        return self.path / "status.json"

    @property
    def events_file(self) -> pathlib.Path:
        return self.path / "events.jsonl"

    @property
    def runtime_file(self) -> pathlib.Path:
        return self.path / "runtime.json"

    @property
    def summary_file(self) -> pathlib.Path:
        return self.path / "summary.json"

    @property
    def requests_dir(self) -> pathlib.Path:
        return self.path / "requests"

    @property
    def logs_dir(self) -> pathlib.Path:
        return self.path / "logs"

    @property
    def checkpoints_dir(self) -> pathlib.Path:
        return self.path / "checkpoints"

    def log_file(self, name: str) -> pathlib.Path:
        return self.logs_dir / f"{name}.log"

    def create(self) -> None:
        for folder in (self.path, self.requests_dir, self.logs_dir, self.checkpoints_dir):
            folder.mkdir(parents=True, exist_ok=True)

    # -- documents
    def write_json(self, path: pathlib.Path, document: Any) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)

    def read_json(self, path: pathlib.Path) -> Optional[Any]:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def append_event(self, event: dict[str, Any]) -> None:
        with self.events_file.open("a") as out:
            out.write(json.dumps(event, sort_keys=True) + "\n")

    def read_events(self) -> list[dict[str, Any]]:
        try:
            lines = self.events_file.read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    # -- scale requests (another terminal -> the runtime)
    def request_scale(self, replicas: int) -> pathlib.Path:
        self.requests_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        path = self.requests_dir / f"scale-{now:.6f}-{os.getpid()}.json"
        self.write_json(path, {"replicas": replicas, "time": now})
        return path

    def take_scale_requests(self) -> list[int]:
        """Replica counts requested since the last call, oldest first; the request files are consumed."""
        found = []
        for path in sorted(self.requests_dir.glob("scale-*.json")):
            document = self.read_json(path)
            path.unlink(missing_ok=True)
            if isinstance(document, dict) and isinstance(document.get("replicas"), int):
                found.append(document["replicas"])
        return found

    def is_running(self) -> bool:
        """A ``disttrain local run`` process for this state directory is alive."""
        runtime = self.read_json(self.runtime_file) or {}
        pid = runtime.get("pid")
        if not isinstance(pid, int) or runtime.get("finished"):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
