"""A real Kubernetes control plane for tests, envtest-style: etcd + kube-apiserver (+ controller-manager, scheduler).

Why our own: only the real API server decides whether a CRD, a CEL rule, an RBAC rule or a status write is
right (the emulator accepted a CRD the real server refuses). Nothing here runs a kubelet: tests play it by
creating Node objects, renewing their Leases and patching pod status.

Binaries come from ``$KUBEBUILDER_ASSETS`` (envtest's convention: plain executables) or
``$DISTTRAIN_K8S_ASSETS`` (default ``../shared/k8s`` next to the repository: ``NAME.xz`` files), decompressed
once into a cache keyed by the checksum file. Every process runs in its own process group and is stopped by
pid on :meth:`ControlPlane.stop`; ports are chosen at run time; PKI and tokens are throwaway.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import hashlib
import ipaddress
import json
import lzma
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from disttrain.common.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ASSETS = REPO_ROOT.parent / "shared" / "k8s"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
KUBECTL = os.environ.get("DISTTRAIN_KUBECTL", "kubectl")


class ControlPlaneUnavailable(RuntimeError):
    """The binaries are missing (a skip locally, a failure under CI)."""


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "disttrain" / "k8s"


def resolve_binaries() -> dict[str, Path]:
    """Path of each binary: envtest's KUBEBUILDER_ASSETS, else the xz files decompressed into our cache."""
    envtest = os.environ.get("KUBEBUILDER_ASSETS")
    if envtest:
        found = {name: Path(envtest) / name for name in BINARIES}
        missing = [str(p) for p in found.values() if not os.access(p, os.X_OK)]
        if missing:
            raise ControlPlaneUnavailable(f"KUBEBUILDER_ASSETS={envtest} lacks executables: {', '.join(missing)}")
        return found
    assets = Path(os.environ.get("DISTTRAIN_K8S_ASSETS", DEFAULT_ASSETS))
    sums = assets / "SHA256SUMS"
    missing = [str(assets / f"{name}.xz") for name in BINARIES if not (assets / f"{name}.xz").is_file()]
    if missing:
        raise ControlPlaneUnavailable(
            f"control-plane binaries not found: {', '.join(missing)} (set DISTTRAIN_K8S_ASSETS or KUBEBUILDER_ASSETS)"
        )
    expected = {}
    if sums.is_file():
        for line in sums.read_text().splitlines():
            digest, _, name = line.strip().partition("  ")
            expected[name.strip()] = digest
    key = hashlib.sha256(sums.read_bytes()).hexdigest()[:16] if sums.is_file() else "unversioned"
    cache = _cache_root() / key
    cache.mkdir(parents=True, exist_ok=True)
    found = {}
    for name in BINARIES:
        target = cache / name
        if not os.access(target, os.X_OK):
            partial = cache / f".{name}.{os.getpid()}.part"
            with lzma.open(assets / f"{name}.xz") as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            if name in expected:
                digest = hashlib.sha256(partial.read_bytes()).hexdigest()
                if digest != expected[name]:
                    partial.unlink()
                    raise ControlPlaneUnavailable(f"{name}: checksum {digest} does not match {sums}")
            partial.chmod(0o755)
            partial.replace(target)  # atomic: a concurrent run sees the whole file or none
        found[name] = target
    return found


class _Pki:
    """A throwaway CA, a serving certificate for 127.0.0.1/localhost and a ServiceAccount signing key."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        now = datetime.datetime.now(datetime.timezone.utc)
        ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "disttrain-test-ca")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        server_cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name)
            .public_key(server_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.DNSName("kubernetes"),
                        x509.DNSName("kubernetes.default.svc"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
                    ]
                ),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ca_crt = self._write("ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM))
        self.ca_key = self._write("ca.key", self._key_bytes(ca_key))
        self.server_crt = self._write("apiserver.crt", server_cert.public_bytes(serialization.Encoding.PEM))
        self.server_key = self._write("apiserver.key", self._key_bytes(server_key))
        self.sa_key = self._write("sa.key", self._key_bytes(sa_key))
        self.sa_pub = self._write(
            "sa.pub",
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        )

    @staticmethod
    def _key_bytes(key: rsa.RSAPrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )

    def _write(self, name: str, data: bytes) -> Path:
        path = self.dir / name
        path.write_bytes(data)
        path.chmod(0o600)
        return path


class ControlPlane:
    """etcd + kube-apiserver started at construction; controller-manager and scheduler on demand.

    ``toleration_seconds`` sets the API server's default not-ready/unreachable tolerations, so taint-based
    eviction after a node loss happens within a test's patience. ``service_cidr`` bounds the Services (one
    ClusterIP each): a /24 holds about 250, enough for tests; the API-load benchmark needs one per job.
    """

    def __init__(
        self, *, toleration_seconds: int = 10, node_monitor_grace_seconds: int = 20, service_cidr: str = "10.0.0.0/24"
    ) -> None:
        self.binaries = resolve_binaries()
        self.dir = Path(tempfile.mkdtemp(prefix="disttrain-k8s-"))
        self.logs = self.dir / "logs"
        self.logs.mkdir()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.toleration_seconds = toleration_seconds
        self.node_monitor_grace_seconds = node_monitor_grace_seconds
        self.service_cidr = service_cidr
        self.pki = _Pki(self.dir)
        self.admin_token = secrets.token_hex(16)
        self.tokens = {
            "admin": (self.admin_token, "disttrain-admin", "system:masters"),
            "kcm": (secrets.token_hex(16), "system:kube-controller-manager", ""),
            "scheduler": (secrets.token_hex(16), "system:kube-scheduler", ""),
        }
        (self.dir / "tokens.csv").write_text(
            "".join(f'{token},{user},{user},"{groups}"\n' for token, user, groups in self.tokens.values())
        )
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        try:
            self._start_etcd()
            self._start_apiserver()
        except BaseException:
            self.stop()
            raise
        self.kubeconfig = self.write_kubeconfig("admin", self.admin_token)

    # --- processes -------------------------------------------------------------------------------------

    def _spawn(self, name: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                [str(self.binaries[name]), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.dir,
            )
        self.processes[name] = process
        return process

    def _wait(self, name: str, check: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            process = self.processes[name]
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; log:\n{self.log_tail(name)}")
            with contextlib.suppress(OSError, urllib.error.URLError, ssl.SSLError):
                if check():
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{name} not ready after {timeout:.0f} s; log:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._spawn(
            "etcd",
            [
                f"--data-dir={self.dir / 'etcd-data'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                "--name=default",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._wait("etcd", lambda: b"true" in urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2).read())

    def _start_apiserver(self) -> None:
        pki = self.pki
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--tls-cert-file={pki.server_crt}",
                f"--tls-private-key-file={pki.server_key}",
                f"--client-ca-file={pki.ca_crt}",
                f"--token-auth-file={self.dir / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                f"--service-cluster-ip-range={self.service_cidr}",
                f"--default-not-ready-toleration-seconds={self.toleration_seconds}",
                f"--default-unreachable-toleration-seconds={self.toleration_seconds}",
                "--v=1",
            ],
        )  # API Priority and Fairness on, as in every real cluster (the chart ships a FlowSchema)
        self._wait("kube-apiserver", lambda: self.request("GET", "/readyz", raw=True) == b"ok", timeout=90)

    def start_controllers(self) -> None:
        """kube-controller-manager (GC, node lifecycle, taint eviction, tokens) and kube-scheduler; idempotent."""
        if "kube-controller-manager" not in self.processes:
            kcm_config = self.write_kubeconfig("kcm", self.tokens["kcm"][0])
            port = free_port()
            self._spawn(
                "kube-controller-manager",
                [
                    f"--kubeconfig={kcm_config}",
                    f"--authentication-kubeconfig={kcm_config}",
                    f"--authorization-kubeconfig={kcm_config}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={port}",
                    "--leader-elect=false",
                    "--use-service-account-credentials=true",
                    f"--service-account-private-key-file={self.pki.sa_key}",
                    f"--root-ca-file={self.pki.ca_crt}",
                    f"--cluster-signing-cert-file={self.pki.ca_crt}",
                    f"--cluster-signing-key-file={self.pki.ca_key}",
                    "--controllers=*",
                    f"--node-monitor-grace-period={self.node_monitor_grace_seconds}s",
                    "--node-monitor-period=2s",
                    "--node-startup-grace-period=30s",
                    "--v=1",
                ],
            )
            self._wait("kube-controller-manager", lambda: _https_ok(f"https://127.0.0.1:{port}/healthz"))
        if "kube-scheduler" not in self.processes:
            sched_config = self.write_kubeconfig("scheduler", self.tokens["scheduler"][0])
            config_file = self.dir / "scheduler.yaml"
            config_file.write_text(
                json.dumps(
                    {
                        "apiVersion": "kubescheduler.config.k8s.io/v1",
                        "kind": "KubeSchedulerConfiguration",
                        "clientConnection": {"kubeconfig": str(sched_config)},
                        "leaderElection": {"leaderElect": False},
                    }
                )
            )
            port = free_port()
            self._spawn(
                "kube-scheduler",
                [
                    f"--config={config_file}",
                    f"--authentication-kubeconfig={sched_config}",
                    f"--authorization-kubeconfig={sched_config}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={port}",
                    "--v=1",
                ],
            )
            self._wait("kube-scheduler", lambda: _https_ok(f"https://127.0.0.1:{port}/healthz"))

    def stop(self) -> None:
        """Stop every process we started (its whole process group), then remove the throwaway directory."""
        for name in reversed(list(self.processes)):
            process = self.processes[name]
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=10)
        self.processes.clear()
        if os.environ.get("DISTTRAIN_KEEP_K8S_LOGS"):
            return
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- clients -----------------------------------------------------------------------------------------

    def write_kubeconfig(self, name: str, token: str) -> Path:
        """A kubeconfig for ``token`` against this API server (verifying its certificate with our CA)."""
        ca = base64.b64encode(self.pki.ca_crt.read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": name,
            "clusters": [{"name": "test", "cluster": {"server": self.server, "certificate-authority-data": ca}}],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": name, "context": {"cluster": "test", "user": name}}],
        }
        path = self.dir / f"kubeconfig-{name}"
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    @functools.cached_property
    def tls_context(self) -> ssl.SSLContext:
        """One client context for every request (loading the CA each time cost the kubelets' loops CPU)."""
        return ssl.create_default_context(cafile=str(self.pki.ca_crt))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
        raw: bool = False,
    ) -> Any:
        """One HTTPS request as admin (or ``token``); JSON in and out. HTTP errors raise ``urllib.error.HTTPError``."""
        context = self.tls_context
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {token or self.admin_token}",
                "Content-Type": content_type,
                "Accept": "application/json",
            },
        )
        with urllib.request.urlopen(req, context=context, timeout=30) as response:
            payload = response.read()
        return payload if raw else (json.loads(payload) if payload else None)

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this control plane."""
        result = subprocess.run(
            [KUBECTL, f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def api_client(self, kubeconfig: Path | None = None) -> Any:
        """A ``kubernetes`` ApiClient for the admin (or another kubeconfig)."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig or self.kubeconfig), client_configuration=configuration)
        return client.ApiClient(configuration)

    def wait_established(self, crd_name: str, timeout: float = 60) -> None:
        """Until the CRD is Established and its resource is served (discovery lags Established a little)."""
        deadline = time.monotonic() + timeout
        while True:
            crd = self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd_name}")
            conditions = {c["type"]: c["status"] for c in (crd.get("status") or {}).get("conditions") or []}
            if conditions.get("Established") == "True":
                group, version = crd["spec"]["group"], crd["spec"]["versions"][0]["name"]
                with contextlib.suppress(urllib.error.HTTPError):
                    self.request("GET", f"/apis/{group}/{version}/{crd['spec']['names']['plural']}")
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {crd_name} not established: {conditions}")
            time.sleep(0.2)

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        self.request(
            "POST",
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}},
        )
        return name

    def service_account_kubeconfig(self, namespace: str, name: str, seconds: int = 3600) -> Path:
        """A kubeconfig holding a token for ServiceAccount ``namespace/name`` (TokenRequest API)."""
        answer = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": seconds}},
        )
        return self.write_kubeconfig(f"sa-{namespace}-{name}", answer["status"]["token"])

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _https_ok(url: str) -> bool:
    context = ssl._create_unverified_context()  # the component's self-signed serving certificate
    with urllib.request.urlopen(url, context=context, timeout=2) as response:
        return bool(response.status == 200)


def start_or_skip(**kwargs: Any) -> ControlPlane:
    """A started control plane; without the binaries a skip locally and a failure under CI (``CI=true``)."""
    import pytest

    try:
        return ControlPlane(**kwargs)
    except ControlPlaneUnavailable as error:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI needs the real control plane: {error}")
        pytest.skip(str(error))
