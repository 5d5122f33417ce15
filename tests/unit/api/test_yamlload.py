"""Hostile manifests: every one is refused in one line, quickly, without a traceback, by the one loader that
`disttrain validate`, `convert` and `local run`/`scale`/`status` share.

The bounds on time and memory are functional (a bomb is refused, not expanded), loose enough for a loaded CI box:
before the loader, the 549-byte bomb below ran past 120 s and 1.2 GB.
"""

from __future__ import annotations

import pathlib
import resource
import subprocess
import sys
import time

import pytest
import yaml
from tests.conftest import REPO_ROOT, JobBuilder

from disttrain.api import validation, yamlload
from disttrain.operator import names
from disttrain.operator.local import cli as local_cli

HEADER = "apiVersion: disttrain.dev/v1alpha1\nkind: DistTrainJob\nmetadata: {name: bomb}\n"


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """``width``**``levels`` leaves from a few hundred bytes (the "billion laughs")."""
    lines = [HEADER + "x:", "  a0: &a0 [" + ",".join(['"lol"'] * width) + "]"]
    lines += [f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join([*lines, f"spec: {{nodes: *a{levels - 1}}}"]) + "\n"


def error_bomb() -> str:
    """Under the expansion limit, but thousands of invalid items: the output must stay short."""
    lines = [
        HEADER + "spec:",
        "  nodes: {min: 1, max: 1, replicas: 1}",
        "  e0: &e0 [" + ",".join(["{bad: 1}"] * 9) + "]",
    ]
    lines += [f"  e{i}: &e{i} [" + ",".join([f"*e{i - 1}"] * 9) + "]" for i in range(1, 4)]
    return "\n".join(lines) + "\n  template: {spec: {containers: *e3, volumes: *e3}}\n"


HOSTILE: list[tuple[str, bytes, str]] = [
    ("alias-bomb", alias_bomb().encode(), "YAML nodes once aliases are expanded"),
    ("recursive-alias", (HEADER + "spec: &s {nodes: *s}\n").encode(), "refers to its own anchor"),
    ("deep-flow-nesting", (HEADER + "spec: " + "[" * 400_000 + "]" * 400_000 + "\n").encode(), "nesting"),
    ("deep-block-nesting", (HEADER + "spec:\n" + "- " * 400_000 + "x\n").encode(), "nesting"),
    ("nesting-101", (HEADER + "spec: " + "[" * 101 + "]" * 101 + "\n").encode(), "nesting deeper than 100"),
    ("not-utf8", HEADER.encode() + b"spec: {name: \xff\xfe}\n", "not UTF-8 text: byte 0xff at offset"),
    ("too-big", HEADER.encode() + b"spec: " + b"x" * (1 << 20) + b"\n", "larger than 1048576 bytes"),
    ("too-many-documents", b"---\n{}\n" * 1500, "more than 1000 YAML documents"),
    ("bad-timestamp", (HEADER + "spec: {at: 2024-13-45}\n").encode(), "month must be in 1..12"),
    ("python-tag", (HEADER + "spec: !!python/object/apply:os.system [id]\n").encode(), "could not determine"),
]


@pytest.mark.parametrize(("data", "text"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_hostile_file_is_refused_in_one_line_quickly(tmp_path, data, text):
    path = tmp_path / "job.yaml"
    path.write_bytes(data)
    started = time.perf_counter()
    with pytest.raises(validation.ManifestError) as caught:
        list(validation.load_documents(path))
    elapsed = time.perf_counter() - started
    message = str(caught.value)
    assert elapsed < 2.0, f"took {elapsed:.1f} s"
    assert "\n" not in message and text in message and message.startswith(f"{path}: <")


@pytest.mark.parametrize(("data", "text"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_the_pure_python_loader_refuses_the_same_files(tmp_path, monkeypatch, data, text):
    """Where PyYAML has no libyaml, the pure-Python scanner is used: the same limits hold, as fast."""
    monkeypatch.setattr(yamlload, "_Loader", yamlload._PureLoader)
    path = tmp_path / "job.yaml"
    path.write_bytes(data)
    started = time.perf_counter()
    with pytest.raises(validation.ManifestError) as caught:
        list(validation.load_documents(path))
    assert time.perf_counter() - started < 2.0
    assert "\n" not in str(caught.value) and text in str(caught.value)


def test_a_long_scalar_is_read_quickly(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text(HEADER.replace("name: bomb", "name: " + "x" * 900_000))
    started = time.perf_counter()
    [(_, obj)] = validation.load_documents(path)
    assert time.perf_counter() - started < 2.0 and len(obj["metadata"]["name"]) == 900_000


@pytest.mark.parametrize(("data", "text"), [h[1:] for h in HOSTILE[:5]], ids=[h[0] for h in HOSTILE[:5]])
def test_cli_validate_refuses_a_hostile_file_without_a_traceback(tmp_path, data, text):
    path = tmp_path / "job.yaml"
    path.write_bytes(data)
    run = _validate(path)
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and text in run.stderr and "Traceback" not in run.stderr


def test_the_alias_bomb_costs_little_time_and_memory(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(path.read_bytes()) < 600
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    with pytest.raises(validation.ManifestError):
        list(validation.load_documents(path))
    assert time.perf_counter() - started < 2.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024  # KiB: under 50 MB more


def test_thousands_of_errors_print_a_bounded_report(tmp_path):
    path = tmp_path / "errors.yaml"
    path.write_text(error_bomb())
    run = _validate(path)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) <= validation.MAX_PRINTED_PROBLEMS + 1, len(lines)
    assert all(len(line) <= validation.MAX_LINE_CHARS + len(str(path)) + 2 for line in lines)
    assert len(run.stderr) < 64 * 1024


def test_many_problems_are_cut_with_a_count(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump(JobBuilder().set("spec.extra", {f"k{i}": i for i in range(80)}).build()))
    obj = yaml.safe_load(path.read_text())
    obj["spec"].update({f"unknown{i}": i for i in range(80)})
    path.write_text(yaml.safe_dump(obj))
    run = _validate(path)
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1].endswith("more problems")
    assert len(run.stderr.splitlines()) == validation.MAX_PRINTED_PROBLEMS + 1


def test_a_long_value_is_quoted_short():
    obj = JobBuilder().set("spec.nodes.replicas", "x" * 100_000).build()
    [problem] = [p for p in validation.validate_object(obj) if p.path == "spec.nodes.replicas"]
    assert len(str(problem)) <= validation.MAX_LINE_CHARS and "..." in str(problem)


def test_anchors_and_merge_keys_that_stay_small_still_load():
    text = "env: &env [{name: A, value: '1'}]\nbase: &b {k: v}\nc: *env\nd: {<<: *b, e: 1}\n"
    [doc] = yamlload.load_all(text)
    assert doc["c"] == [{"name": "A", "value": "1"}] and doc["d"] == {"k": "v", "e": 1}


def test_examples_load_through_the_bounded_loader():
    for path in sorted((REPO_ROOT / "examples" / "jobs").glob("*.yaml")):
        assert [d for d in yamlload.load_file(path) if d is not None]


def test_local_commands_resolve_a_hostile_manifest_to_its_file_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    escape = tmp_path / "escape.yaml"
    escape.write_text(HEADER.replace("name: bomb", "name: ../../etc"))
    started = time.perf_counter()
    assert local_cli.resolve_state(str(bomb), None).path.name == "bomb"
    assert time.perf_counter() - started < 2.0
    assert local_cli.resolve_state(str(escape), None).path.name == "escape"


def test_the_agent_service_account_name_is_what_the_rule_reserves():
    """The rule cannot see the job's name, so it refuses the suffix: every agent account must carry it."""
    for job in ("train", "a", "x" * 45):
        name = names.service_account_name(job)
        assert name.endswith("-agent")
        obj = JobBuilder().set("spec.template.spec.serviceAccountName", name).build()
        [problem] = validation.validate_object(obj)
        assert problem.path == "spec.template.spec.serviceAccountName" and name in problem.message


@pytest.mark.parametrize("account", ["trainer", "agent", "agents", "my-agent-sa", "default"])
def test_other_service_accounts_are_allowed(account):
    obj = JobBuilder().set("spec.template.spec.serviceAccountName", account).build()
    assert validation.validate_object(obj) == []


def _validate(path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "disttrain.operator.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
