"""A real S3 server for tests: Ceph's RADOS Gateway on a throwaway one-node cluster (1 mon, 1 memstore OSD).

From Debian's packages (``ceph-mon ceph-osd radosgw ceph-common``, installed by ``make .venv/.installed``): no
mgr, no cephx, everything on 127.0.0.1 under a temp dir, about 12 s to the first answer. What it does not cover
against AWS S3 is in docs/trainer.md ("Checkpoints in an S3 bucket"); the conditional writes it has are
probed by the code under test, not assumed.

    with RadosGateway() as s3:  # s3.endpoint, s3.access_key, s3.secret_key
        ...
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Optional

BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")
ACCESS_KEY = "testaccess"
SECRET_KEY = "testsecret"


class Unavailable(RuntimeError):
    """The Ceph binaries are not installed, or the cluster did not come up."""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


CONF = """[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{mon2},v1:127.0.0.1:{mon1}]
public addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
mon data avail warn = 1
mon data avail crit = 0
run dir = {root}/run
admin socket = {root}/run/$name.asok
pid file = {root}/run/$name.pid
log file = {root}/log/$name.log
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
[mon]
mon data = {root}/mon.$id
[osd]
osd data = {root}/osd.$id
osd fast shutdown = false
osd objectstore = memstore
memstore device bytes = {memstore_bytes}
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:{rgw}
rgw data = {root}/rgw
rgw thread pool size = 32
rgw gc obj min wait = 5
rgw gc processor period = 5
"""


class RadosGateway:
    """Starts the cluster in ``__enter__`` and stops it (and removes its files) in ``__exit__``."""

    def __init__(self, timeout_s: float = 90.0, memstore_bytes: int = 2**30) -> None:
        missing = [b for b in BINARIES if shutil.which(b) is None]
        if missing:
            raise Unavailable(f"not installed: {', '.join(missing)} (apt-get install ceph-mon ceph-osd radosgw)")
        self.timeout_s = timeout_s
        self.root = Path(tempfile.mkdtemp(prefix="radosgw-"))
        mon2, mon1, rgw = _free_ports(3)
        self.endpoint = f"http://127.0.0.1:{rgw}"
        self.access_key, self.secret_key = ACCESS_KEY, SECRET_KEY
        self.fsid = str(uuid.uuid4())
        self._mon = f"[v2:127.0.0.1:{mon2},v1:127.0.0.1:{mon1}]"
        self.conf = self.root / "ceph.conf"
        self.conf.write_text(
            CONF.format(fsid=self.fsid, mon2=mon2, mon1=mon1, rgw=rgw, root=self.root, memstore_bytes=memstore_bytes)
        )

    def _run(self, *args: str, timeout: float = 60.0) -> str:
        done = subprocess.run(
            [*args, "-c", str(self.conf)], capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise Unavailable(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout

    def __enter__(self) -> RadosGateway:
        try:
            for d in ("run", "log", "mon.a", "osd.0", "rgw"):
                (self.root / d).mkdir()
            monmap = str(self.root / "monmap")
            subprocess.run(
                ["monmaptool", "--create", "--clobber", "--fsid", self.fsid, "--addv", "a", self._mon, monmap],
                capture_output=True,
                check=True,
            )
            self._run("ceph-mon", "-i", "a", "--mkfs", "--monmap", monmap)
            self._run("ceph-mon", "-i", "a")
            osd_uuid = str(uuid.uuid4())
            self._run("ceph", "osd", "new", osd_uuid)
            self._run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
            self._run("ceph-osd", "-i", "0")
            self._run("radosgw", "-n", "client.rgw.a")
            self._wait_http()
            self._run(
                "radosgw-admin",
                "user",
                "create",
                "--uid=test",
                "--display-name=test",
                f"--access-key={self.access_key}",
                f"--secret-key={self.secret_key}",
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_http(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    log = self.root / "log" / "client.rgw.a.log"
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    raise Unavailable(f"radosgw did not answer at {self.endpoint}: {exc}\n{tail}") from exc
                time.sleep(0.2)

    def stop_gateway(self) -> None:
        """Stop radosgw alone (the bucket becomes unreachable; the cluster and its data stay)."""
        pid = self._pid("client.rgw.a")
        if pid is not None:
            _terminate(pid)

    def start_gateway(self) -> None:
        """Start radosgw again after :meth:`stop_gateway` (about 0.2 s to serving, buckets and objects kept)."""
        self._run("radosgw", "-n", "client.rgw.a")
        self._wait_http()

    def client(self, **config: Any) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, **config),
        )

    def stop(self) -> None:
        """Stop radosgw, the OSD and the mon in that order, each waited for; then remove the files."""
        for name in ("client.rgw.a", "osd.0", "mon.a"):
            pid = self._pid(name)
            if pid is not None:
                _terminate(pid)
        shutil.rmtree(self.root, ignore_errors=True)

    def _pid(self, name: str) -> Optional[int]:
        try:
            return int((self.root / "run" / f"{name}.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(pid: int) -> None:
    """SIGTERM, then SIGKILL after 20 s; returns once the process is gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_or_skip() -> RadosGateway:
    """A started gateway; without the binaries a skip locally and a failure under CI (``CI=true``)."""
    import pytest

    try:
        return RadosGateway().__enter__()
    except Unavailable as error:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI needs the real S3 server: {error}")
        pytest.skip(str(error))
