"""Run the test tiers (pytest markers given by tests/conftest.py) as `make test` does, lanes side by side, and print
each tier's time, counts and result at the end.

A lane runs its tiers one after the other; lanes run at once. The two longest tiers (trainer, e2e) and the security
tier run as two shards each, split by file on the wall times in tests/tier_costs.json (`--save-costs` rewrites it
from the last run), so that three lanes of about the same length keep both cores busy: the lanes' processes wait
on timeouts, rendezvous and the control plane much of the time. Each tier's (shard's) output goes to
build/test-logs/<tier>.log (<tier>-<i>.log); a failing tier's summary is printed at the end.

Each test's wall and CPU seconds go to build/test-logs/<tier>.costs.jsonl (tests/plugins/costs.py):
`python scripts/code_figures.py` names the most expensive ones.

A failed test fails its tier: nothing is run a second time.

    python scripts/test_tiers.py                  # every tier of `make test`
    python scripts/test_tiers.py unit chart       # these tiers only, one lane each
    python scripts/test_tiers.py --serial         # one tier at a time
    python scripts/test_tiers.py --save-costs     # tests/tier_costs.json from the last run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.conftest import TIER_OF_FOLDER  # noqa: E402 (the repository root on the path first)
from tests.plugins.costs import COSTS_ENV  # noqa: E402

LOGS = REPO / "build" / "test-logs"

LANES: tuple[tuple[str, ...], ...] = (
    ("trainer/1", "e2e/1", "security/2"),
    ("trainer/2", "e2e/2", "security/1"),
    ("unit", "operator", "chart", "cluster"),
)
"""What `make test` runs (every tier but images, which `make test-images` builds and checks). ``tier/i`` is the
i-th of a tier's shards (:func:`shard_files`)."""
SHARDS = 2
"""How many shards a sharded tier has (every ``tier/i`` of :data:`LANES` names one of them)."""
COST_TABLE = REPO / "tests" / "tier_costs.json"
"""Wall seconds per test file from a full run (``--save-costs``), for :func:`shard_files`; a file missing from it
counts as the median."""

SUMMARY = re.compile(r"^=+ (?P<counts>.*?) in (?P<seconds>[\d.]+)s", re.MULTILINE)


@dataclass
class TierResult:
    tier: str
    returncode: int = -1
    seconds: float = 0.0
    counts: str = "not run"
    log: Path = field(default_factory=Path)

    @property
    def passed(self) -> bool:
        return self.returncode in (0, 5)  # 5: no test in the tier was selected


def tier_folders(tier: str) -> list[str]:
    return [f"tests/{folder}" for folder, of in TIER_OF_FOLDER.items() if of == tier]


def shard_files(tier: str, count: int) -> list[list[str]]:
    """The tier's test files in ``count`` shards of about the same wall time by :data:`COST_TABLE` (longest file
    first into the lightest shard); deterministic, so every shard of one run sees the same split."""
    paths = [path for folder in tier_folders(tier) for path in (REPO / folder).rglob("test_*.py")]
    files = sorted(str(path.relative_to(REPO)) for path in paths)
    table = json.loads(COST_TABLE.read_text()) if COST_TABLE.exists() else {}
    known = sorted(table[f] for f in files if f in table)
    default = known[len(known) // 2] if known else 1.0
    shards: list[list[str]] = [[] for _ in range(count)]
    loads = [0.0] * count
    for file in sorted(files, key=lambda f: (-table.get(f, default), f)):
        lightest = loads.index(min(loads))
        shards[lightest].append(file)
        loads[lightest] += table.get(file, default)
    return [sorted(shard) for shard in shards]


def log_name(name: str) -> str:
    """``trainer/1`` -> ``trainer-1``: a shard's logs beside the tiers'."""
    return name.replace("/", "-")


def run_tier(name: str, pytest_args: list[str]) -> TierResult:
    """Run the tier (or shard, ``tier/i``) ``name``."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{log_name(name)}.log"
    start = time.monotonic()
    tier, _, shard = name.partition("/")
    folders = shard_files(tier, SHARDS)[int(shard) - 1] if shard else tier_folders(tier)  # collects only these
    command = [sys.executable, "-m", "pytest", "-m", tier, "-p", "no:cacheprovider", "-p", "tests.plugins.costs"]
    command += [*pytest_args, *folders]
    costs = LOGS / f"{log_name(name)}.costs.jsonl"
    costs.unlink(missing_ok=True)
    environ = {**os.environ, COSTS_ENV: str(costs)}
    with open(log, "w") as out:
        returncode = subprocess.call(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=environ)
    counts = _counts(log, returncode)
    seconds = time.monotonic() - start
    print(f"[tiers] {name}: {counts} in {seconds:.0f} s", flush=True)
    return TierResult(name, returncode, seconds, counts, log)


def _counts(log: Path, returncode: int) -> str:
    summaries = list(SUMMARY.finditer(log.read_text(errors="replace")))
    return summaries[-1].group("counts") if summaries else f"no summary (exit {returncode})"


def costs_of(name: str) -> list[dict]:
    """The per-test cost rows of tier or shard ``name`` (tests/plugins/costs.py)."""
    costs = LOGS / f"{log_name(name)}.costs.jsonl"
    if not costs.exists():
        return []
    return [json.loads(line) for line in costs.read_text().splitlines() if line.strip()]


def tier_cpu_seconds(name: str) -> float:
    """CPU seconds the tier's tests spent, their processes included."""
    return sum(row["cpu_s"] for row in costs_of(name))


def save_costs() -> None:
    """Update :data:`COST_TABLE` from the last runs' per-test costs: wall seconds per file, each test counted once
    (the newest costs file that has it: a tier run alone and as shards writes two), averaged with the table's."""
    by_test: dict[str, float] = {}
    for costs in sorted(LOGS.glob("*.costs.jsonl"), key=lambda path: path.stat().st_mtime):
        for row in (json.loads(line) for line in costs.read_text().splitlines() if line.strip()):
            by_test[row["test"]] = row["wall_s"]
    measured: dict[str, float] = {}
    for test, wall_s in by_test.items():
        file = test.split("::")[0]
        measured[file] = measured.get(file, 0.0) + wall_s
    # A file's wall time moves by half from run to run with what the other lanes do: the mean of this run and
    # the table's, so one run does not reshuffle the shards.
    old = json.loads(COST_TABLE.read_text()) if COST_TABLE.exists() else {}
    table = {file: round((wall_s + old.get(file, wall_s)) / 2, 1) for file, wall_s in measured.items()}
    COST_TABLE.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    print(f"[tiers] wrote {COST_TABLE.relative_to(REPO)}: {len(table)} files")


def run_lanes(lanes: list[tuple[str, ...]], pytest_args: list[str]) -> list[TierResult]:
    results: list[TierResult] = []
    lock = threading.Lock()

    def lane(tiers: tuple[str, ...]) -> None:
        for tier in tiers:
            result = run_tier(tier, pytest_args)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=lane, args=(tiers,)) for tiers in lanes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def report(results: list[TierResult], wall_s: float) -> int:
    for result in results:
        if not result.passed:
            text = result.log.read_text(errors="replace")
            start = text.find("short test summary info")
            print(f"\n[tiers] {result.tier} FAILED (log: {result.log.relative_to(REPO)}):")
            print(text[start - 40 :] if start >= 0 else text[-6000:])
    print("\n[tiers] tier       seconds  cpu s  result")
    order = [tier for lane in LANES for tier in lane]
    for result in sorted(results, key=lambda r: order.index(r.tier) if r.tier in order else len(order)):
        verdict = "ok  " if result.passed else "FAIL"
        cpu = tier_cpu_seconds(result.tier)
        print(f"[tiers] {result.tier:<10} {result.seconds:7.0f} {cpu:6.0f}  {verdict} {result.counts}")
    print(f"[tiers] wall clock {wall_s:.0f} s ({wall_s / 60:.1f} min)")
    times = {result.tier: round(result.seconds, 1) for result in results}
    (LOGS / "times.json").write_text(json.dumps({"wall_s": round(wall_s, 1), "tiers": times}, indent=2) + "\n")
    return 0 if all(result.passed for result in results) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tiers", nargs="*", help="tiers to run (default: every tier of `make test`)")
    parser.add_argument("--serial", action="store_true", help="one tier at a time")
    parser.add_argument("--save-costs", action="store_true", help=f"write {COST_TABLE.name} from the last run")
    args, pytest_args = parser.parse_known_args()
    if args.save_costs:
        save_costs()
        return 0
    lanes = [(tier,) for tier in args.tiers] if args.tiers else list(LANES)
    if args.serial:
        lanes = [tuple(tier for lane in lanes for tier in lane)]
    start = time.monotonic()
    results = run_lanes(lanes, pytest_args)
    return report(results, time.monotonic() - start)


if __name__ == "__main__":
    sys.exit(main())
