"""The security tier's summary: every attacked run leaves one line (delay, restarts, agent memory), printed at the
end of the session whatever ``-s`` says, and kept as JSON under the session's base temp dir."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

RESULTS = pytest.StashKey[list[dict[str, Any]]]()


@pytest.fixture(scope="session")
def security_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[dict[str, Any]]]:
    """Where the tests put their measurements; written to ``security-results.json`` as they come."""
    results: list[dict[str, Any]] = []
    request.config.stash[RESULTS] = results
    yield results
    path = tmp_path_factory.getbasetemp() / "security-results.json"
    path.write_text(json.dumps(results, indent=1))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    results = config.stash.get(RESULTS, None)
    if not results:
        return
    terminalreporter.section("outsider attacks: what each cost the job")
    for result in results:
        terminalreporter.write_line(result["line"])
