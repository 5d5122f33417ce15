"""The images' supply chain, read from the repository without building anything (so `make test` runs it): the
Dockerfile installs every package from a hash-pinned lock with one index per pip call, never an extra one; its
base is pinned by digest; the locks pin every package exactly, with hashes, and cover what pyproject.toml
declares. The image tier (test_hygiene.py) checks the built images: `pip check` passes with --no-deps installs
and the images sit on the base handed over by digest."""

from __future__ import annotations

import re
import shlex

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"
LOCKS = REPO_ROOT / "requirements"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined and comments dropped."""
    joined, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            joined.append((word.upper(), rest.strip()))
        current = ""
    return joined


def pip_commands(run: str) -> list[list[str]]:
    """The `pip install` / `pip wheel` commands of a RUN line, each as its words."""
    found = []
    for part in re.split(r"&&|;|\|\||\bthen\b|\belse\b|\bfi\b", run):
        words = shlex.split(part.strip(), posix=True) if part.strip() else []
        if len(words) >= 2 and words[0] == "pip" and words[1] in ("install", "wheel", "download"):
            found.append(words)
    return found


def lock(name: str) -> dict[str, tuple[Version, list[str]]]:
    """A lock file: package -> (pinned version, hashes). Fails on any line that is not an exact pin with hashes."""
    entries: dict[str, tuple[Version, list[str]]] = {}
    text = (LOCKS / name).read_text()
    for block in re.split(r"\n(?=[A-Za-z0-9])", re.sub(r"(?m)^\s*#.*\n?", "", text)):
        if not block.strip():
            continue
        spec, *options = block.replace("\\\n", " ").split()
        requirement = Requirement(spec)
        [pin] = list(requirement.specifier)  # exactly one specifier
        assert pin.operator == "==" and "*" not in pin.version, f"{name}: {spec}: not pinned to one version"
        hashes = [o.removeprefix("--hash=sha256:") for o in options if o.startswith("--hash=sha256:")]
        assert hashes and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), f"{name}: {spec}: no SHA-256"
        assert len(hashes) == len(options), f"{name}: {spec}: options other than --hash: {options}"
        entries[canonicalize_name(requirement.name)] = (Version(pin.version), hashes)
    return entries


def covers(locked: dict[str, tuple[Version, list[str]]], declared: list[str], where: str) -> None:
    """Every declared requirement has a locked version that satisfies it."""
    for text in declared:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"python_version": "3.11"}):
            continue
        name = canonicalize_name(requirement.name)
        if name == "disttrain":  # the project itself: built from the tree, installed without its dependencies
            continue
        assert name in locked, f"{where}: {text} is declared but not locked"
        version = locked[name][0]
        assert requirement.specifier.contains(version, prereleases=True), f"{where}: {text}: locked {version}"


def inputs(name: str) -> list[str]:
    return [line.strip() for line in (LOCKS / name).read_text().splitlines() if line.strip() and line[0] != "#"]


STEPS = instructions(DOCKERFILE.read_text())


def test_every_pip_step_is_hash_checked_or_offline_and_never_resolves_dependencies() -> None:
    commands = [cmd for word, rest in STEPS if word == "RUN" for cmd in pip_commands(rest)]
    assert len(commands) >= 6, commands  # build backend, wheel, 2 x (lock + project), torch
    for cmd in commands:
        assert "--no-deps" in cmd, f"{' '.join(cmd)}: resolves dependencies (an unpinned version could come in)"
        if cmd[1] == "wheel":
            assert "--no-build-isolation" in cmd, f"{' '.join(cmd)}: build isolation fetches setuptools unhashed"
        elif "--require-hashes" not in cmd:
            # Only the project's own wheel, built in the previous stage from this tree, goes in without a hash.
            assert "--no-index" in cmd and cmd[-1] == "/wheels/disttrain-*.whl", f"{' '.join(cmd)}: no hashes"
        else:
            assert "-r" in cmd, cmd
            assert "--index-url" in cmd or "${torch_from}" in cmd, f"{' '.join(cmd)}: no explicit single index"
    # torch's source is one index, or a wheel folder and no index at all.
    [torch_run] = [rest for word, rest in STEPS if word == "RUN" and "${torch_from}" in rest]
    sources = re.findall(r'torch_from="([^"]*)"', torch_run)
    assert sorted(sources) == ["--index-url ${TORCH_INDEX_URL}", "--no-index --find-links ${TORCH_FIND_LINKS}"]


def test_no_extra_index_anywhere_in_the_build() -> None:
    for path in [DOCKERFILE, *sorted((REPO_ROOT / "scripts" / "images").iterdir())]:
        text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        assert "extra-index-url" not in text and "EXTRA_INDEX_URL" not in text, path
    # No pip configuration file of the base's can bring one in either.
    assert ("ENV", "PIP_CONFIG_FILE=/dev/null") in STEPS


def test_every_from_is_pinned_by_digest() -> None:
    args: dict[str, str] = {}
    stages: set[str] = set()
    froms = 0
    for word, rest in STEPS:
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args.setdefault(key, value.strip('"'))
        if word != "FROM":
            continue
        froms += 1
        image, *alias = rest.split()
        if image not in stages:  # a stage of this Dockerfile is built on a pinned image itself
            resolved = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), image)
            assert DIGEST.search(resolved), f"FROM {image} (= {resolved!r}): not pinned by digest (NAME@sha256:...)"
        if len(alias) == 2 and alias[0].upper() == "AS":
            stages.add(alias[1])
    assert froms >= 2


def test_locks_pin_every_package_with_hashes_and_cover_pyproject() -> None:
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    operator, trainer, torch = lock("operator.txt"), lock("trainer.txt"), lock("torch-cpu.txt")
    covers(operator, [*project["dependencies"], *extras["operator"]], "requirements/operator.txt")
    covers(
        {**trainer, **torch},
        [*project["dependencies"], *extras["trainer"], *extras["agent"]],
        "requirements/trainer.txt + torch-cpu.txt",
    )
    covers(lock("build.txt"), PYPROJECT["build-system"]["requires"], "requirements/build.txt")
    assert inputs("build.in") == PYPROJECT["build-system"]["requires"]
    # torch comes from its own index in a pip call of its own: in that lock alone, and nothing else there.
    assert list(torch) == ["torch"] and "torch" not in trainer
    assert "kopf" not in trainer  # the trainer image runs no operator


def test_the_torch_lock_is_the_version_development_pins() -> None:
    [pin] = [Requirement(line) for line in inputs("../constraints-dev.txt") if line.startswith("torch")]
    version, _ = lock("torch-cpu.txt")["torch"]
    assert pin.specifier.contains(version) and version.local == "cpu", version
    assert [str(Requirement(r).specifier) for r in inputs("torch-cpu.in")] == [f"=={version}"]


def test_every_lock_and_input_the_dockerfile_copies_exists() -> None:
    default_torch_lock = next(rest for word, rest in STEPS if word == "ARG" and rest.startswith("TORCH_LOCK="))
    for word, rest in STEPS:
        if word == "COPY" and "requirements/" in rest:
            for source in rest.split()[:-1]:
                source = source.replace("${TORCH_LOCK}", default_torch_lock.partition("=")[2])
                assert (REPO_ROOT / source).is_file(), source
    for name in ("build.txt", "operator.txt", "trainer.txt", "torch-cpu.txt", "uv.txt"):
        assert "make locks" in (LOCKS / name).read_text(), f"{name}: not made by `make locks`"


@pytest.mark.parametrize(
    "bad",
    [
        "FROM python:3.11-slim AS python",
        "ARG PYTHON_IMAGE=python:3.11-slim\nFROM ${PYTHON_IMAGE} AS python",
        "FROM localhost/disttrain-base:bookworm-abc",
        "FROM python@sha256:1234",
    ],
)
def test_the_digest_check_refuses_a_tag(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: each of these is refused."""
    monkeypatch.setitem(globals(), "STEPS", instructions(bad))
    with pytest.raises(AssertionError, match="not pinned by digest"):
        test_every_from_is_pinned_by_digest()
