"""A real Prometheus server for a test: Debian's ``prometheus`` binary on a free localhost port, a temporary data
directory, a 1 s scrape interval, and targets read from file_sd files that the test rewrites as a local job's
processes come and go (as Kubernetes service discovery follows pods). Queried over its HTTP API, as Grafana does.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional

import yaml

from disttrain.common.ports import free_port
from tests.chart.prometheus_tools import find_binary

Target = tuple[str, dict[str, str]]
"""host:port and the target's labels."""


class Prometheus:
    """``with Prometheus(tmp, {"operator": True, "workers": False}) as prom:`` starts it with one scrape job per
    name (True: honor_labels, as the chart's ServiceMonitor for the operator) and stops it on exit, data included."""

    def __init__(self, workdir: pathlib.Path, jobs: dict[str, bool], scrape_interval_s: int = 1) -> None:
        self.workdir = workdir
        self.jobs = jobs
        self.scrape_interval_s = scrape_interval_s
        self.port = 0
        self.process: Optional[subprocess.Popen] = None
        self._targets: dict[str, list[Target]] = {}

    # ---- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for job in self.jobs:
            self.set_targets(job, [])
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self._config()))
        for _attempt in range(3):  # a free port can be taken between the probe and prometheus' bind
            self.port = free_port()
            self._start(config)
            if self._wait_ready(30):
                return self
            self.stop()
        raise RuntimeError(f"prometheus did not become ready; log:\n{self.log_tail()}")

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _config(self) -> dict[str, Any]:
        interval = f"{self.scrape_interval_s}s"
        return {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {
                    "job_name": job,
                    "honor_labels": honor,
                    "file_sd_configs": [{"files": [str(self._sd_file(job))], "refresh_interval": interval}],
                }
                for job, honor in self.jobs.items()
            ],
        }

    def _start(self, config: pathlib.Path) -> None:
        log = (self.workdir / "prometheus.log").open("ab")
        self.process = subprocess.Popen(
            [
                find_binary("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1d",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.workdir,
            start_new_session=True,
        )
        log.close()

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                    if answer.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s: no prometheus outlives the test."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=15)

    def log_tail(self, lines: int = 40) -> str:
        path = self.workdir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- targets ---------------------------------------------------------------------------------------
    def _sd_file(self, job: str) -> pathlib.Path:
        return self.workdir / f"targets-{job}.json"

    def set_targets(self, job: str, targets: list[Target]) -> None:
        """Replace a scrape job's targets (an atomic rename, so prometheus never reads half a file)."""
        targets = sorted(targets, key=lambda t: t[0])
        if self._targets.get(job) == targets:
            return
        self._targets[job] = targets
        groups = [{"targets": [address], "labels": labels} for address, labels in targets]
        tmp = self._sd_file(job).with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self._sd_file(job))

    # ---- HTTP API --------------------------------------------------------------------------------------
    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]

    def samples(self, selector: str, at: float, lookback_s: int = 3600) -> dict[frozenset, list[tuple[float, float]]]:
        """Every raw sample of ``selector`` in the ``lookback_s`` before ``at``: labels (the metric name left out,
        so the series of one target match across metrics) -> [(time, value)]."""
        data = self.api("query", query=f"{selector}[{lookback_s}s]", time=f"{at:.3f}")
        return {
            frozenset((k, v) for k, v in series["metric"].items() if k != "__name__"): [
                (float(t), float(v)) for t, v in series["values"]
            ]
            for series in data["result"]
        }

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=step_s)["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": match})


def finite_points(result: list[dict[str, Any]]) -> list[float]:
    """The values of a query_range answer that are numbers (NaN and infinities left out)."""
    return [float(v) for series in result for _t, v in series["values"] if math.isfinite(float(v))]
