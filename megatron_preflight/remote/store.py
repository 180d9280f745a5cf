"""One ``msc://PROFILE/prefix`` location, through multi-storage-client: listing, ranged reads, uploads — each failure
one clear error naming the object and the fix, and every byte fetched counted.

The client is imported only here and only when a URL is met: local paths never need it. Retries are the client's
(the profile's ``retry``: attempts, delay, backoff; 3 attempts by default), and the count is said when they run out;
an object returned shorter than asked is read again up to :data:`SHORT_READ_ATTEMPTS` times, then refused."""

from __future__ import annotations

import logging
import os
import posixpath
import re
import threading
from dataclasses import dataclass
from typing import Any

from megatron_preflight.errors import PreflightError

SCHEME = "msc://"
NO_OBJECTS = "usage"  # the error code of an empty prefix (a usage error: the URL names no checkpoint; told apart
# from a malformed URL's by the error's path, the URL)
SHORT_READ_ATTEMPTS = 3
MAX_OBJECTS = 1_000_000  # a listing longer than this is not one checkpoint
INSTALL = "pip install 'multi-storage-client[boto3]' (the S3 provider; [google-cloud-storage], [azure-storage-blob] ... " \
          "for the others)"
_URL = re.compile(r"^msc://([^/]+)(/.*)?$")


def is_msc(path: Any) -> bool:
    """Whether ``path`` is an ``msc://`` URL."""
    return isinstance(path, str) and path.startswith(SCHEME)


def join(url: str, rel: str) -> str:
    """The URL of ``rel`` under ``url``."""
    return url.rstrip("/") + "/" + rel if rel else url.rstrip("/")


def _client_module() -> Any:
    try:
        import multistorageclient  # the client: only where an msc:// URL is met
    except ImportError as exc:
        raise PreflightError("reading or writing msc:// paths needs NVIDIA's multi-storage-client, which this "
                             f"environment does not have ({exc})", path=None, fix=INSTALL, code="usage") from None
    # the client logs each failed attempt; the error this module raises says how many there were (--debug shows them)
    client_log = logging.getLogger("multistorageclient")
    if not logging.getLogger("megatron_preflight").isEnabledFor(logging.DEBUG):
        client_log.setLevel(logging.CRITICAL)
    return multistorageclient


@dataclass
class Counters:
    """What a store did: requests made, bytes fetched, bytes uploaded."""

    requests: int = 0
    fetched: int = 0
    uploaded: int = 0


class Store:
    """The objects under one ``msc://PROFILE/prefix`` URL."""

    def __init__(self, url: str) -> None:
        m = _URL.match(url)
        if m is None or any(part in ("..", ".") for part in (m.group(2) or "").split("/")):
            raise PreflightError(f"{url!r} is not an msc:// URL of the form msc://PROFILE/path", path=None,
                                 fix="write it as Megatron-LM's --load takes it: msc://PROFILE/path/to/checkpoint",
                                 code="usage")
        self.url = url.rstrip("/")
        self.profile = m.group(1)
        msc = _client_module()
        try:
            self._client, self._base = msc.resolve_storage_client(self.url)
        except Exception as exc:  # noqa: BLE001 - the client's errors, classified below
            raise self._error(exc, self.url) from None
        self._base = self._base.rstrip("/")
        self.counters = Counters()
        self._lock = threading.Lock()

    # -- naming --------------------------------------------------------------------------------------------------
    def _key(self, rel: str) -> str:
        return f"{self._base}/{rel}" if self._base else rel

    def url_of(self, rel: str) -> str:
        return join(self.url, rel)

    def _count(self, requests: int = 1, fetched: int = 0, uploaded: int = 0) -> None:
        with self._lock:
            self.counters.requests += requests
            self.counters.fetched += fetched
            self.counters.uploaded += uploaded

    # -- reading -------------------------------------------------------------------------------------------------
    def list(self) -> dict[str, int]:
        """Every object under the URL: its path relative to the URL -> its size in bytes."""
        out: dict[str, int] = {}
        prefix = self._base + "/" if self._base else ""
        try:
            for obj in self._client.list(path=prefix):
                if getattr(obj, "type", "file") != "file":
                    continue
                key = obj.key[len(prefix):] if obj.key.startswith(prefix) else obj.key
                if not key or key.endswith("/"):
                    continue
                parts = key.split("/")
                if any(p in ("", ".", "..") for p in parts) or posixpath.isabs(key):
                    raise PreflightError(f"the store lists an object named {obj.key!r}, which no file of a "
                                         "checkpoint is called", path=self.url,
                                         fix="remove that object, or copy the checkpoint to a clean prefix",
                                         code="format")
                out[key] = int(obj.content_length)
                if len(out) > MAX_OBJECTS:
                    raise PreflightError(f"more than {MAX_OBJECTS:,} objects under this prefix: not one checkpoint",
                                         path=self.url, fix="pass the checkpoint's own prefix (the --load dir)",
                                         code="usage")
        except PreflightError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, self.url) from None
        self._count(1)
        return out

    def read(self, rel: str, offset: int = 0, size: int | None = None) -> bytes:
        """Bytes ``[offset, offset + size)`` of the object ``rel`` (the whole object when ``size`` is None)."""
        from multistorageclient.types import Range  # (the client: loaded by the constructor)

        key = self._key(rel)
        for _attempt in range(SHORT_READ_ATTEMPTS):
            try:
                data = self._client.read(key, byte_range=None if size is None else Range(offset=offset, size=size))
            except Exception as exc:  # noqa: BLE001
                raise self._error(exc, self.url_of(rel)) from None
            self._count(fetched=len(data))
            if size is None or len(data) == size:
                return data
        raise PreflightError(f"the store returned {len(data):,} bytes where {size:,} were asked (at offset "
                             f"{offset:,}), {SHORT_READ_ATTEMPTS} times: the object is shorter than its listing or "
                             "the connection cut the response", path=self.url_of(rel),
                             fix="check that nothing is rewriting the checkpoint, then retry; restore the object from "
                                 "a good copy if it stays short", code="remote")

    # -- writing -------------------------------------------------------------------------------------------------
    def upload(self, rel: str, local_path: str) -> None:
        """Upload the local file ``local_path`` as ``rel`` (the client splits large files into a multipart upload)."""
        try:
            self._client.upload_file(self._key(rel), local_path)
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, self.url_of(rel)) from None
        self._count(uploaded=os.path.getsize(local_path))

    def delete(self, rel: str) -> None:
        try:
            self._client.delete(self._key(rel))
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, self.url_of(rel)) from None
        self._count()

    # -- errors --------------------------------------------------------------------------------------------------
    def _attempts(self) -> int | None:
        try:
            return int(self._client._config.retry_config.attempts)  # the profile's retry.attempts
        except Exception:  # noqa: BLE001 - another client version: the count is then not said
            return None

    def _error(self, exc: BaseException, where: str) -> PreflightError:
        """The client's ``exc`` as one clear error naming ``where``."""
        text = f"{type(exc).__name__}: {exc}"
        response = getattr(exc, "response", None)  # botocore's ClientError: the store's own error code
        code = str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
        attempts = self._attempts() if hasattr(self, "_client") else None
        tried = f" (after the client's {attempts} attempts: the profile's retry.attempts)" if attempts else ""
        config = os.environ.get("MSC_CONFIG", "the default MSC config file (~/.msc_config.yaml, /etc/msc_config.yaml)")
        if isinstance(exc, ValueError) and "Profile" in str(exc):
            return PreflightError(f"the msc profile {self.profile!r} is not defined ({exc})", path=where,
                                  fix=f"define it under profiles: in {config}, or set MSC_CONFIG to the file that "
                                      "does", code="remote")
        if code == "NoSuchBucket" or "NoSuchBucket" in text or "bucket does not exist" in text:
            return PreflightError(f"the bucket of profile {self.profile!r} does not exist ({text})", path=where,
                                  fix=f"check the profile's base_path in {config}, or create the bucket",
                                  code="remote")
        if isinstance(exc, PermissionError) or code in ("AccessDenied", "InvalidAccessKeyId",
                                                        "SignatureDoesNotMatch") or "status_code: 403" in text:
            return PreflightError(f"the store refused the request: wrong or missing credentials ({text})",
                                  path=where, fix=f"check the profile's credentials_provider in {config} (access key "
                                                  "and secret), or the key's permissions on the bucket",
                                  code="remote")
        if isinstance(exc, FileNotFoundError):
            return PreflightError("no such object on the store", path=where,
                                  fix="check the path after msc://PROFILE/ (it is relative to the profile's "
                                      "base_path), e.g. with `msc ls`", code="usage")
        if "connect" in text.lower() or "EndpointConnectionError" in text:
            return PreflightError(f"could not connect to the store{tried} ({text})", path=where,
                                  fix=f"check the profile's endpoint_url in {config} and that the server is up",
                                  code="remote")
        if any(k in text for k in ("ResponseStreamingError", "IncompleteRead", "incomplete read")) and \
                "ReadTimeout" not in text:
            return PreflightError(f"the store's response was cut short{tried} ({text})", path=where,
                                  fix="retry; if it persists, the object may be shorter than its listing (restore it "
                                      "from a good copy) or a proxy on the way drops long responses", code="remote")
        if "timeout" in text.lower() or "timed out" in text.lower():
            return PreflightError(f"the store did not answer in time{tried} ({text})", path=where,
                                  fix="retry when the store is reachable; raise the profile's read_timeout if it is "
                                      "slow but working", code="remote")
        return PreflightError(f"the store failed the request{tried} ({text})", path=where,
                              fix="retry; if it persists, check the store's health and the profile in " + config,
                              code="remote")
