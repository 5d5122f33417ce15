"""Per-test cost: wall seconds and CPU seconds (this process and its reaped descendants), one JSON line per test.

Why CPU too: on 2 cores the multi-process tiers are bound by CPU (each worker process imports torch and the
trainer, seconds of CPU), so wall time alone hides which scenario to make leaner. ``scripts/test_tiers.py`` turns
it on (``-p tests.plugins.costs``) and names the file in ``DISTTRAIN_TEST_COSTS``; ``scripts/code_figures.py``
prints the most expensive tests.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Generator

import pytest

COSTS_ENV = "DISTTRAIN_TEST_COSTS"


def cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Generator[None, None, None]:
    path = os.environ.get(COSTS_ENV)
    start, cpu = time.monotonic(), cpu_seconds()
    yield
    if path:
        wall_s, cpu_s = time.monotonic() - start, cpu_seconds() - cpu
        row = {"test": item.nodeid, "wall_s": round(wall_s, 2), "cpu_s": round(cpu_s, 2)}
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")
