"""The CUDA trainer image's recipe, read from the repository without building anything: its wheels are ~2.7 GB, more
than CI builds, so `make test` checks what decides its content instead. `make image-cuda` builds the Dockerfile's
trainer-cuda target with build arguments that select requirements/torch-cuda.txt; that lock pins PyPI's torch (the
CUDA build) with hashes, and together with requirements/trainer.txt it satisfies every requirement of torch's CUDA
wheel, as the wheel's METADATA states them (recorded in requirements/torch-cuda.in)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from tests.conftest import REPO_ROOT
from tests.images.test_locks import instructions, lock

Locked = dict[str, tuple[Version, list[str]]]

LOCKS = REPO_ROOT / "requirements"
CUDA_LOCK = "requirements/torch-cuda.txt"
# The image's platform: CPython 3.11 (the Dockerfile's base) on Linux x86-64, where PyPI's torch is the CUDA build.
IMAGE_PLATFORM = {
    "python_version": "3.11",
    "python_full_version": "3.11.2",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def stages() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """The Dockerfile's named stages: name -> (the image or stage it is FROM, its instructions)."""
    found: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    steps: list[tuple[str, str]] = []
    for word, rest in instructions((REPO_ROOT / "Dockerfile").read_text()):
        if word == "FROM":
            base, *alias = rest.split()
            steps = []
            if len(alias) == 2 and alias[0].upper() == "AS":
                found[alias[1]] = (base, steps)
        else:
            steps.append((word, rest))
    return found


def make_image_cuda() -> list[str]:
    """The build.sh command that `make image-cuda` runs, as its words."""
    # Not a parent make's flags (`make test` runs this): its jobserver or -k are no part of the recipe.
    env = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(
        ["make", "-n", "image-cuda"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if "scripts/images/build.sh" in line]
    words = shlex.split(line)
    return words[words.index("scripts/images/build.sh") :]


def build_args(words: list[str]) -> dict[str, str]:
    return dict(words[i + 1].partition("=")[::2] for i, word in enumerate(words) if word == "--build-arg")


def recorded_requirements() -> list[Requirement]:
    """torch's Requires-Dist for the image's platform, as torch-cuda.in records them from the wheel's METADATA."""
    lines = re.findall(r"(?m)^#\s+Requires-Dist: (.+)$", (LOCKS / "torch-cuda.in").read_text())
    requirements = [Requirement(line) for line in lines]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({**IMAGE_PLATFORM, "extra": ""})]


def required_by(name: str) -> dict[str, set[str]]:
    """A lock's `# via` comments: package -> what requires it (packages, `-r file`, `disttrain (pyproject.toml)`)."""
    parents: dict[str, set[str]] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", (LOCKS / name).read_text()):
        if not block[:1].isalnum():  # the header
            continue
        package = canonicalize_name(block.split("==", 1)[0])
        comments = [line.strip()[1:].strip() for line in block.splitlines() if line.strip().startswith("#")]
        # uv writes `# via X` for one, else `# via` and then `#   X` a line.
        assert comments and comments[0].startswith("via"), f"{name}: {package}: no `# via` comment"
        parents[package] = {c for c in [comments[0].removeprefix("via").strip(), *comments[1:]] if c}
    return parents


def unmet(locked: Locked, requirements: list[Requirement]) -> list[str]:
    """The requirements no locked version satisfies."""
    missing = []
    for requirement in requirements:
        pinned = locked.get(canonicalize_name(requirement.name))
        if pinned is None or not requirement.specifier.contains(pinned[0], prereleases=True):
            missing.append(f"{requirement} (locked: {pinned[0] if pinned else 'nothing'})")
    return missing


def inputs(name: str) -> list[str]:
    """The requirements of a lock's input file (comments left out)."""
    return [line.strip() for line in (LOCKS / name).read_text().splitlines() if line.strip() and line[0] != "#"]


def test_the_cuda_target_is_the_trainer_with_the_nvidia_runtime_hints_and_refuses_a_cpu_torch() -> None:
    base, steps = stages()["trainer-cuda"]
    assert base == "trainer"  # same user, working directory, examples and entry points as the trainer image
    env = " ".join(rest for word, rest in steps if word == "ENV").split()
    assert "NVIDIA_VISIBLE_DEVICES=all" in env and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env
    assert not [rest for word, rest in steps if word == "USER"], "the trainer's USER 65532 holds"
    [check] = [rest for word, rest in steps if word == "RUN"]
    assert '__import__("torch").version.cuda' in check and check.startswith("python -c 'assert ")


def test_make_image_cuda_builds_that_target_with_the_build_args_of_the_cuda_lock() -> None:
    words = make_image_cuda()
    assert words[1] == "trainer-cuda", words
    args = build_args(words)
    assert args == {"TORCH_LOCK": CUDA_LOCK, "TORCH_INDEX_URL": "https://pypi.org/simple"}, args
    # Each is a build argument of the stage that installs torch, which copies the lock it names.
    _, venv_steps = stages()["trainer-venv"]
    declared = {rest.partition("=")[0] for word, rest in venv_steps if word == "ARG"}
    assert set(args) <= declared and ("COPY", "${TORCH_LOCK} /requirements/torch.txt") in venv_steps
    assert (REPO_ROOT / CUDA_LOCK).is_file()


def test_the_cuda_lock_pins_pypis_torch_with_hashes_and_nccl() -> None:
    cuda = lock("torch-cuda.txt")
    version, hashes = cuda["torch"]
    assert version == Version("2.13.0") and hashes  # no local version: PyPI's wheel, the CUDA build
    assert version.public == lock("torch-cpu.txt")["torch"][0].public  # the CPU image's torch, and development's
    assert [str(Requirement(line).specifier) for line in inputs("torch-cuda.in")] == ["==2.13.0"]
    assert "nvidia-nccl-cu13" in cuda and "triton" in cuda


def test_the_cuda_lock_holds_only_what_the_trainer_lock_lacks() -> None:
    """The image installs both with --no-deps: a package in both would be installed twice, maybe at two versions."""
    assert not set(lock("torch-cuda.txt")) & set(lock("trainer.txt"))


def test_the_two_locks_satisfy_every_requirement_of_torchs_cuda_wheel() -> None:
    recorded = recorded_requirements()
    assert recorded
    assert not unmet({**lock("trainer.txt"), **lock("torch-cuda.txt")}, recorded)
    # The record is the wheel uv resolved: what the locks say torch requires is what torch-cuda.in records.
    via_torch = {
        name
        for lock_name in ("trainer.txt", "torch-cuda.txt")
        for name, parents in required_by(lock_name).items()
        if "torch" in parents
    }
    assert via_torch == {canonicalize_name(r.name) for r in recorded}


def test_every_package_of_the_cuda_lock_is_torch_or_needed_by_a_locked_one() -> None:
    """What torch's requirements need in turn (cuda-toolkit's nvidia-* libraries, cuda-bindings' cuda-pathfinder)
    is locked too: every `via` names torch's input or a locked package, and every chain of them leads to torch."""
    cuda, parents = lock("torch-cuda.txt"), required_by("torch-cuda.txt")
    assert set(parents) == set(cuda)
    assert "-r requirements/torch-cuda.in" in parents["torch"], parents["torch"]
    locked = set(cuda) | set(lock("trainer.txt"))
    for name, via in parents.items():
        if name != "torch":
            assert via and {canonicalize_name(p) for p in via} <= locked, f"{name}: required by {via}"
    leads_to_torch = {"torch"}
    while grown := {name for name, via in parents.items() if via & leads_to_torch} - leads_to_torch:
        leads_to_torch |= grown
    assert leads_to_torch == set(cuda), set(cuda) - leads_to_torch


@pytest.mark.parametrize("dropped", ["nvidia-nccl-cu13", "triton", "cuda-toolkit", "filelock"])
def test_the_coverage_check_fails_without_any_one_of_them(dropped: str) -> None:
    """The check above can fail: a lock that lacks one of torch's requirements is refused."""
    locked = {**lock("trainer.txt"), **lock("torch-cuda.txt")}
    del locked[dropped]
    assert unmet(locked, recorded_requirements()) == [
        next(f"{r} (locked: nothing)" for r in recorded_requirements() if r.name == dropped)
    ]


def test_every_input_a_lock_names_exists() -> None:
    """Each lock's ``# via -r <file>`` notes name the input a pin came from: an input that no longer exists means
    the lock was not made from the inputs in the repository (`make locks` would drop or move that pin)."""
    named = {
        (path.name, source)
        for path in LOCKS.glob("*.txt")
        for source in re.findall(r"#\s+(?:via\s+)?-r (\S+)", path.read_text())
    }
    assert named, "no lock names an input: the notes' form changed"
    missing = sorted((lock_name, source) for lock_name, source in named if not (REPO_ROOT / source).exists())
    assert not missing, f"locks name inputs that do not exist: {missing}"
