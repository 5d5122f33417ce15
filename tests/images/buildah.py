"""buildah as the image tests use it: working containers made from the built images, commands run in them and
their filesystems opened on the host. No daemon and no registry: ``--isolation chroot`` runs a command as the
image's USER, in its WORKDIR and environment, on the host's network (podman/crun cannot run containers here)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

Volumes = Mapping[Path, str]  # host path -> path in the container


def buildah(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"buildah {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def image_config(image: str) -> dict[str, Any]:
    """The image's OCI config (User, Entrypoint, Cmd, Env, WorkingDir, ...)."""
    document: dict[str, Any] = json.loads(buildah("inspect", "--type", "image", image))
    config: dict[str, Any] = document["OCIv1"]["config"]
    return config


class Container:
    """A buildah working container: a fresh copy of the image's filesystem, removed at the end."""

    def __init__(self, image: str, hostname: Optional[str] = None) -> None:
        self.name = f"disttrain-test-{uuid.uuid4().hex[:10]}"
        self.hostname = hostname
        # A pod's hostname resolves in the pod (the kubelet writes it into /etc/hosts); torchrun publishes it as
        # the workers' MASTER_ADDR. Here the pods share the host's network, so it is 127.0.0.1.
        hosts = ["--add-host", f"{hostname}:127.0.0.1"] if hostname else []
        buildah("from", "--pull=never", *hosts, "--name", self.name, image)
        self._mounted: Optional[Path] = None

    def argv(
        self, command: Sequence[str], env: Optional[Mapping[str, str]] = None, volumes: Optional[Volumes] = None
    ) -> list[str]:
        argv = ["buildah", "run", "--isolation", "chroot"]
        if self.hostname:
            argv += ["--hostname", self.hostname]
        for key, value in (env or {}).items():
            argv += ["--env", f"{key}={value}"]
        for host, inside in (volumes or {}).items():
            argv += ["--volume", f"{host}:{inside}"]
        return [*argv, self.name, "--", *command]

    def run(
        self,
        *command: str,
        env: Optional[Mapping[str, str]] = None,
        volumes: Optional[Volumes] = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(command, env, volumes), capture_output=True, text=True, timeout=timeout)

    def check(self, *command: str, env: Optional[Mapping[str, str]] = None, timeout: float = 120) -> str:
        """stdout of a command that must succeed."""
        proc = self.run(*command, env=env, timeout=timeout)
        assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        return proc.stdout

    def start(
        self,
        command: Sequence[str],
        log: Path,
        env: Optional[Mapping[str, str]] = None,
        volumes: Optional[Volumes] = None,
    ) -> subprocess.Popen[bytes]:
        """A command left running in the background (a second pod), its output in ``log``."""
        with log.open("wb") as out:
            return subprocess.Popen(self.argv(command, env, volumes), stdout=out, stderr=subprocess.STDOUT)

    def mount(self) -> Path:
        """The container's root filesystem, opened on the host."""
        if self._mounted is None:
            self._mounted = Path(buildah("mount", self.name).strip())
        return self._mounted

    def remove(self) -> None:
        if self._mounted is not None:
            buildah("umount", self.name)
        buildah("rm", self.name)


@contextlib.contextmanager
def container(image: str, hostname: Optional[str] = None) -> Iterator[Container]:
    c = Container(image, hostname)
    try:
        yield c
    finally:
        c.remove()


def stop(proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    """End a background ``buildah run`` and everything below it (it may not pass signals on to its command)."""
    if proc.poll() is None:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    proc.wait(timeout)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def available() -> Optional[str]:
    """Why the image tests cannot run here, or None when they can."""
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install buildah debootstrap; `make test-images` does it)"
    if os.geteuid() != 0:
        return "buildah's chroot isolation and `buildah mount` need root here"
    return None
