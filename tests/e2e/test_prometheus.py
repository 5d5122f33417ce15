"""A real Prometheus scrapes a local-mode job, as the chart's ServiceMonitor and PodMonitor make it scrape a cluster:
the operator with honor_labels, each worker exporter labelled with the job's namespace and name. The job loses a
node (SIGKILL) and is scaled down by one; then what Prometheus stored is compared with what the job's status,
events and logs said at the same moments, and every query of the Grafana dashboard must answer with data.
"""

from __future__ import annotations

import bisect
import collections
import copy
import dataclasses
import itertools
import math
import re
import shutil
from typing import Any

import pytest

from disttrain.api import conditions as cond
from disttrain.api import goodput as goodput_mod
from disttrain.operator import cli
from disttrain.operator.local import chaos as chaos_mod
from disttrain.operator.local.runtime import LocalRuntime, Snapshot
from tests.chart import dashboard
from tests.e2e.conftest import Run, e2e_job, run_job
from tests.e2e.prometheus import Prometheus, finite_points

pytestmark = [pytest.mark.slow]

JOB, NAMESPACE = "obs", "default"
SELECTOR = f'{{namespace="{NAMESPACE}", job="{JOB}"}}'
KILL_AT_STEP = 6
"""A node's machine dies past this step (and once Prometheus scraped the restart counters at 0)."""
LOG_STEP = re.compile(r"\bstep (\d+) loss \S+ lr \S+ world (\d+) samples/s (\d+)")


@dataclasses.dataclass
class Observed:
    """The run, the Prometheus that scraped it, and the status after every tick of the runtime."""

    run: Run
    prometheus: Prometheus
    ticks: list[float]
    statuses: list[dict[str, Any]]
    end: float

    def ticks_around(self, at: float) -> range:
        """The ticks whose metrics a scrape stamped ``at`` may have read: from the one before the last tick that
        started before ``at`` (gauges are set at the end of a tick) to those that started up to 1 s after it (the
        exporter answers a moment after Prometheus stamps the scrape, later on a busy machine)."""
        first = max(0, bisect.bisect_right(self.ticks, at) - 2)
        return range(first, max(first + 1, bisect.bisect_right(self.ticks, at + 1.0)))

    def statuses_around(self, at: float) -> list[dict[str, Any]]:
        return [self.statuses[i] for i in self.ticks_around(at)]

    def samples(self, metric: str) -> dict[frozenset, list[tuple[float, float]]]:
        return self.prometheus.samples(metric + SELECTOR, at=self.end)

    def only_series(self, metric: str) -> list[tuple[float, float]]:
        series = self.samples(metric)
        assert len(series) == 1, (metric, list(series))
        return next(iter(series.values()))


class Choreography:
    """On every tick: keep Prometheus' targets in step with the live processes, record the status; past step
    :data:`KILL_AT_STEP`, once Prometheus has scraped the job's loss counters at 0 (a counter first scraped at 1
    shows no increase), kill a node; once the group has re-formed after the loss and trained a few steps, scale down by
    one (``disttrain local scale``, as from another terminal)."""

    def __init__(self, prometheus: Prometheus) -> None:
        self.prometheus = prometheus
        self.ticks: list[float] = []
        self.statuses: list[dict[str, Any]] = []
        self.scaled_down_at_step = 0
        self.killed = False
        self._looked_at = 0.0

    def _counters_scraped(self, now: float) -> bool:
        """Prometheus holds two samples of the job's infrastructure-loss counters (looked at twice a second at
        most)."""
        if now - self._looked_at < 0.5:
            return False
        self._looked_at = now
        series = self.prometheus.samples("disttrain_job_infrastructure_losses_total" + SELECTOR, at=now, lookback_s=60)
        return any(len(samples) >= 2 for samples in series.values())

    def __call__(self, runtime: LocalRuntime, snapshot: Snapshot) -> None:
        status = snapshot.status
        self.ticks.append(runtime.started + snapshot.elapsed)
        self.statuses.append(copy.deepcopy(status))
        labels = {"namespace": NAMESPACE, "job": JOB}
        self.prometheus.set_targets("operator", [(runtime.metrics_url.split("/")[2], {})])
        self.prometheus.set_targets(
            "workers",
            [
                (f"127.0.0.1:{pod.metrics_port}", {**labels, "pod": pod.name})
                for pod in runtime.workers.values()
                if pod.metrics_port
            ],
        )
        now = self.ticks[-1]
        if not self.killed and status.get("step", 0) >= KILL_AT_STEP and self._counters_scraped(now):
            self.killed = True
            runtime.apply_chaos(chaos_mod.parse_chaos("kill-node@0s")[0])
        restarted = (status.get("infrastructureLosses") or {}).get("total", 0) >= 1
        settled = status.get("phase") == "Running" and (status.get("control") or {}).get("action", "none") == "none"
        reformed_step = (status.get("lastReform") or {}).get("durationSeconds") is not None
        if (
            restarted
            and settled
            and reformed_step
            and not self.scaled_down_at_step
            and status.get("worldSize", 0) >= 2
            and status.get("step", 0) >= 14
        ):
            self.scaled_down_at_step = status["step"]
            replicas = int(status.get("desiredNodes") or status["worldSize"]) - 1
            assert cli.main(["local", "scale", str(runtime.state.path), "--replicas", str(replicas)]) == 0


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    with Prometheus(tmp / "prometheus", {"operator": True, "workers": False}) as prometheus:
        choreography = Choreography(prometheus)
        builder = e2e_job(JOB, tmp / "records", replicas=3, max_steps=48, dataset=576, step_sleep=0.2)
        # The group waits for the replacement (up to 60 s) instead of re-forming without it: one reform per event,
        # whatever the machine's load.
        builder.set(
            "spec.elastic",
            {
                "scaleDebounceSeconds": 0,
                "replacementWaitSeconds": 60,
                "drainTimeoutSeconds": 60,
                "collectiveTimeoutSeconds": 20,
            },
        )
        run = run_job(tmp, builder, on_tick=choreography, timeout_s=180)
        prometheus.set_targets("operator", [])
        prometheus.set_targets("workers", [])
        yield Observed(run, prometheus, choreography.ticks, choreography.statuses, end=choreography.ticks[-1] + 2)
    shutil.rmtree(tmp / "prometheus" / "data", ignore_errors=True)


def _reforms_by_reason(statuses: list[dict[str, Any]]) -> collections.Counter:
    """Reforms started per reason, from the distinct status.lastReform records up to the last of ``statuses``."""
    starts = {(s["lastReform"]["start"], s["lastReform"]["reason"]) for s in statuses if s.get("lastReform")}
    return collections.Counter(reason for _start, reason in starts)


@pytest.mark.timeout(300)
def test_the_job_lost_a_node_and_was_scaled_down(observed):
    summary = observed.run.summary
    assert summary.succeeded, observed.run.reasons()
    assert summary.infrastructure_losses_by_reason == {"NodeNotReady": 1}, summary.infrastructure_losses_by_reason
    assert summary.restarts_by_reason == {}, summary.restarts_by_reason
    reasons = [r.reason for r in summary.reforms]
    assert reasons == ["NodeNotReady", "ScaledDown"], summary.reforms
    assert all(r.duration_seconds for r in summary.reforms), summary.reforms


@pytest.mark.timeout(300)
def test_infrastructure_losses_by_reason_are_the_status_counts(observed):
    series = observed.samples("disttrain_job_infrastructure_losses_total")
    final = observed.statuses[-1]["infrastructureLosses"]["byReason"]
    assert final and set(final) <= {dict(labels)["reason"] for labels in series}
    for labels, points in series.items():
        reason = dict(labels)["reason"]
        for at, value in points:
            seen = {
                (s.get("infrastructureLosses") or {}).get("byReason", {}).get(reason, 0)
                for s in observed.statuses_around(at)
            }
            assert value in seen, (reason, at, value, seen)
        assert points[-1][1] == final.get(reason, 0), (reason, points[-1])
    node_lost_events = [e for e in observed.run.events if e["reason"] == "NodeLost"]
    assert len(node_lost_events) == sum(final.values())


@pytest.mark.timeout(300)
def test_reforms_by_reason_are_the_status_and_event_counts(observed):
    series = observed.samples("disttrain_job_reforms_total")
    for labels, points in series.items():
        reason = dict(labels)["reason"]
        for at, value in points:
            seen = {_reforms_by_reason(observed.statuses[: i + 1])[reason] for i in observed.ticks_around(at)}
            assert value in seen, (reason, at, value, seen)
    last = {dict(labels)["reason"]: points[-1][1] for labels, points in series.items()}
    reformed_events = collections.Counter(
        re.search(r"after (\w+)", e["message"]).group(1) for e in observed.run.events if e["reason"] == "Reformed"
    )
    assert {r: n for r, n in last.items() if n} == dict(reformed_events) == dict(_reforms_by_reason(observed.statuses))
    assert sum(last.values()) == observed.statuses[-1]["reforms"]


@pytest.mark.timeout(300)
def test_reform_durations_are_the_status_durations(observed):
    durations = [r.duration_seconds for r in observed.run.summary.reforms]
    count = observed.only_series("disttrain_job_reform_duration_seconds_count")
    total = observed.only_series("disttrain_job_reform_duration_seconds_sum")
    assert count[-1][1] == len(durations)
    assert math.isclose(total[-1][1], sum(durations), abs_tol=1e-6), (total[-1], durations)
    # The series starts at 0 and each reform's duration was observed once: every rise of the sum is one
    # status.lastReform.durationSeconds (so increase() sees the first reform too).
    assert count[0][1] == total[0][1] == 0
    rises = [b - a for (_t, a), (_u, b) in itertools.pairwise(total) if b != a]
    assert len(rises) == len(durations)
    assert all(math.isclose(rise, d, abs_tol=1e-6) for rise, d in zip(rises, durations, strict=True)), (
        rises,
        durations,
    )


@pytest.mark.timeout(300)
def test_checkpoint_step_and_age_are_the_status_checkpoint(observed):
    """At every scrape the step is the status' lastCheckpoint.step, and scrape time minus age is its commit time."""
    steps = dict(observed.only_series("disttrain_job_last_complete_checkpoint_step"))
    ages = observed.only_series("disttrain_job_checkpoint_age_seconds")
    committed = {}
    for status in observed.statuses:
        ckpt = status.get("lastCheckpoint")
        if ckpt and ckpt.get("time"):
            committed[ckpt["step"]] = cond.parse_time(ckpt["time"])
    checked = set()
    for at, age in ages:
        step = int(steps[at])
        assert step in committed, (at, step, sorted(committed))
        # The age is computed when scraped (a job that stops progressing is reconciled no more, and its age must
        # still grow): the scrape's own time minus the commit time, within the scrape's latency. A scrape that
        # reads the step gauge just before a status update and the age just after it pairs the step with the next
        # checkpoint's age (two gauges, read one after the other while the runtime updates them).
        later = [committed[s] for s in sorted(committed) if s > step][:1]
        # Within 1.5 s: the scrape's own latency on 2 loaded cores reached 0.66 s.
        ages_fit = [abs(age - (at - commit)) < 1.5 for commit in [committed[step], *later]]
        assert any(ages_fit), (at, age, step, at - committed[step])
        checked.add(step)
    assert len(ages) >= 10 and len(checked) >= 3, (len(ages), checked)
    assert int(steps[max(steps)]) == observed.statuses[-1]["lastCheckpoint"]["step"]
    announced = {
        int(re.search(r"step (\d+)", e["message"]).group(1))
        for e in observed.run.events
        if e["reason"] == "CheckpointCommitted"
    }
    # Events only on transitions (the first checkpoint, the first after a resume), never one per commit: the
    # metrics carry every commit.
    assert min(committed) in announced and announced <= set(committed), (announced, sorted(committed))
    assert len(announced) < len(checked), (announced, checked)


@pytest.mark.timeout(300)
def test_world_size_is_the_status_world_size(observed):
    points = observed.only_series("disttrain_job_world_size")
    for at, value in points:
        seen = {s.get("worldSize", 0) for s in observed.statuses_around(at)}
        assert value in seen, (at, value, seen)
    values = [v for _t, v in points]
    assert {3, 2} <= set(values), values


@pytest.mark.timeout(300)
def test_samples_per_second_are_what_rank_0_logged(observed):
    """Each worker's gauge, scraped with its step, is the rate rank 0 logged for that step (rank 0 of that step is
    the node whose log has the line). Steps run twice (redone after the node loss) are left out: ambiguous."""
    redone = {step for step, runs in observed.run.executions().items() if len(runs) > 1}
    logged: dict[str, dict[int, set[str]]] = collections.defaultdict(lambda: collections.defaultdict(set))
    for path in observed.run.state.logs_dir.glob(f"{JOB}-worker-*.log"):
        for match in LOG_STEP.finditer(path.read_text(errors="replace")):
            logged[path.stem][int(match.group(1))].add(match.group(3))
    rates = observed.samples("disttrain_trainer_samples_per_second")
    steps = observed.samples("disttrain_trainer_step")
    assert rates and set(rates) == set(steps)
    matched = 0
    for labels, points in rates.items():
        pod = dict(labels)["pod"]
        step_at = dict(steps[labels])
        for at, rate in points:
            step = int(step_at[at])
            if step in redone or step not in logged[pod]:
                continue  # not rank 0 at this step, or no step yet
            shown = f"{rate:.0f}"
            # A scrape can fall between the step gauge's update and the rate's: the neighbouring step's rate.
            near = set().union(*(logged[pod].get(s, set()) for s in (step - 1, step, step + 1)))
            assert shown in near, (pod, step, shown, logged[pod][step])
            matched += 1
    assert matched >= 5, f"only {matched} scrapes of rank 0's rate"


@pytest.mark.timeout(300)
def test_every_dashboard_query_answers_with_data(observed):
    """Each panel query, with Grafana's variables filled in for this job, over the run: at least one number."""
    start = observed.ticks[0]
    values = dashboard.grafana_values(
        namespace=NAMESPACE, job=JOB, scrape_interval_s=1, range_s=observed.end - start, goodput_window="30s"
    )
    empty = []
    for query in dashboard.queries():
        result = observed.prometheus.query_range(dashboard.fill(query.expr, values), start, observed.end, 1)
        if not finite_points(result):
            empty.append(str(query))
    assert not empty, "queries without data:\n" + "\n".join(empty)
    for name, query in dashboard.variable_queries().items():
        selector, label = (part.strip() for part in query[len("label_values(") : -1].rsplit(",", 1))
        answer = observed.prometheus.label_values(label, dashboard.fill(selector, {"namespace": NAMESPACE}))
        assert answer == [{"namespace": NAMESPACE, "job": JOB}[label]], (name, answer)


@pytest.mark.timeout(300)
def test_goodput_over_the_run_counts_the_lost_node_and_the_reforms(observed):
    [goodput] = [q for q in dashboard.queries() if q.panel == "Goodput (time range)"]
    range_s = observed.end - observed.ticks[0]
    values = dashboard.grafana_values(
        namespace=NAMESPACE, job=JOB, scrape_interval_s=1, range_s=range_s, goodput_window="30s"
    )
    [series] = observed.prometheus.api("query", query=dashboard.fill(goodput.expr, values), time=f"{observed.end:.3f}")[
        "result"
    ]
    assert 0 < float(series["value"][1]) < 1, series


REFORM_CAUSES = {c.value for c in goodput_mod.REFORM_CAUSES} | {"reform"}


@pytest.mark.timeout(300)
def test_goodput_by_cause_accounts_for_the_whole_run(observed):
    """The final status.goodput: causes adding up to the wall time from the job's start to its completion, training
    most of it, the two reforms' seconds in their phases (at most their durations), the same in the summary."""
    final = observed.statuses[-1]
    account = final["goodput"]
    seconds = account["seconds"]
    start = cond.parse_time(account["since"])
    assert math.isclose(sum(seconds.values()), account["wallSeconds"], abs_tol=1e-3), account
    assert math.isclose(account["wallSeconds"], cond.parse_time(final["completionTime"]) - start, abs_tol=2e-3)
    assert seconds["training"] > 0 and account["ratio"] == round(seconds["training"] / account["wallSeconds"], 4)
    reforms = sum(seconds[c] for c in REFORM_CAUSES)
    durations = sum(r.duration_seconds for r in observed.run.summary.reforms)
    assert 0 < reforms <= durations + 1e-3, (seconds, durations)
    assert seconds["queued"] == seconds["suspended"] == 0, seconds
    summary = observed.run.summary
    assert summary.goodput_ratio == account["ratio"]
    assert dict(summary.goodput_seconds) == {c: s for c, s in seconds.items() if s}


@pytest.mark.timeout(300)
def test_the_goodput_counter_is_the_status_account(observed):
    """Every stored sample of each cause's counter is what the status account grew since the operator first saw
    the job (the series start at 0 there), and the last one is the final account."""
    first = observed.statuses[0]["goodput"]["seconds"]
    series = observed.samples("disttrain_job_goodput_seconds_total")
    assert {dict(labels)["cause"] for labels in series} == set(first), series.keys()
    for labels, points in series.items():
        cause = dict(labels)["cause"]
        for at, value in points:
            seen = [s["goodput"]["seconds"][cause] - first[cause] for s in observed.statuses_around(at)]
            assert any(math.isclose(value, v, abs_tol=1e-6) for v in seen), (cause, at, value, seen)
        assert math.isclose(
            points[-1][1], observed.statuses[-1]["goodput"]["seconds"][cause] - first[cause], abs_tol=1e-6
        )


@pytest.mark.timeout(300)
def test_the_goodput_by_cause_panel_shows_the_status_account(observed):
    """The panel's queries, run by Prometheus over the run: each cause's share is its share of what the counters
    grew between the first and the last scrape (whose samples are the status account: the test above), and the
    ratio over the job's life is status.goodput.ratio. increase() extrapolates each series by up to a scrape
    interval at either end of the range (less for one that starts at 0): the shares agree within that."""
    [shares, ratio] = [q for q in dashboard.queries() if q.panel == "Goodput ratio by cause (time range)"]
    values = dashboard.grafana_values(
        namespace=NAMESPACE,
        job=JOB,
        scrape_interval_s=1,
        range_s=observed.end - observed.ticks[0],
        goodput_window="30s",
    )
    at = f"{observed.end:.3f}"
    answer = observed.prometheus.api("query", query=dashboard.fill(shares.expr, values), time=at)["result"]
    got = {row["metric"]["cause"]: float(row["value"][1]) for row in answer}
    final = observed.statuses[-1]["goodput"]
    series = observed.samples("disttrain_job_goodput_seconds_total")
    grown = {dict(labels)["cause"]: points[-1][1] - points[0][1] for labels, points in series.items()}
    total = sum(grown.values())
    assert grown["training"] > 0 and sum(grown[c] for c in REFORM_CAUSES) > 0, grown
    assert set(got) == set(grown)
    assert math.isclose(sum(got.values()), 1.0, abs_tol=1e-9), got
    extrapolated = 2 * 1.0 / total  # two 1 s scrape intervals
    for cause, share in got.items():
        assert math.isclose(share, grown[cause] / total, abs_tol=extrapolated), (cause, share, grown[cause] / total)
    assert got["training"] > 0, got
    [row] = observed.prometheus.query_range(dashboard.fill(ratio.expr, values), observed.ticks[0], observed.end, 1)
    assert float(row["values"][-1][1]) == final["ratio"], row
