"""``helm lint --strict`` accepts the chart with its defaults and with every value changed."""

from __future__ import annotations

import pytest
from tests.chart.helm import CHART, NON_DEFAULT_VALUES, helm


@pytest.mark.parametrize("values", [None, NON_DEFAULT_VALUES], ids=["default", "non-default"])
def test_helm_lint_strict(values):
    done = helm("lint", "--strict", str(CHART), values=values)
    assert "0 chart(s) failed" in done.stdout, done.stdout


def test_notes_tell_how_to_run_and_scale_the_example():
    """NOTES.txt is only rendered by install; a client-side dry run needs no cluster."""
    done = helm(
        "install",
        "disttrain",
        str(CHART),
        "--namespace",
        "disttrain-system",
        "--dry-run=client",
        values={"watchNamespaces": ["team-a"]},
    )
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "kubectl -n team-a apply -f examples/jobs/tinylm.yaml" in notes
    assert "kubectl -n team-a get dtj" in notes
    assert "kubectl -n team-a scale dtj/tinylm --replicas=" in notes
