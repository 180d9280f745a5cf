"""The subcommands' ``msc://`` arguments: each staged as a local mirror for what the command reads (metadata for a
verdict, every byte for a reshard or a diff), a destination written locally then published; what the command prints
names the URLs, never the mirror's temp paths; what was fetched is said on stderr."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.remote.store import is_msc  # (the client itself loads only where a URL is met)

# command -> argument -> what a run reads of it ("metadata", "all") or "publish" (a destination)
NEEDS: dict[str, dict[str, str]] = {
    "inspect": {"path": "metadata"}, "check": {"path": "metadata"}, "plan": {"path": "metadata"},
    "flags": {"path": "metadata"}, "diff": {"a": "all", "b": "all"}, "fingerprint": {"path": "all"},
    "reshard": {"src": "all", "dst": "publish"},
}


WRITES_BESIDE = ("fingerprint",)  # commands whose purpose is a file beside the checkpoint: uploaded next to it


def _need(ns: argparse.Namespace, arg: str) -> str:
    need = NEEDS[ns.command][arg]
    if ns.command == "inspect" and getattr(ns, "verify_content", False):
        return "all"
    if ns.command == "reshard" and arg == "src" and (getattr(ns, "dry_run", False)):
        return "metadata"
    return need


class _Shown:
    """A text stream whose writes name the URLs instead of the mirrors' local paths."""

    def __init__(self, stream: Any, shown: Any) -> None:
        self._stream, self._shown = stream, shown

    def write(self, text: str) -> int:
        self._stream.write(self._shown(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def staged_args(ns: argparse.Namespace) -> Iterator[None]:
    """Run the command of ``ns`` with its ``msc://`` arguments staged (a no-op when it has none)."""
    urls = {arg: getattr(ns, arg) for arg in NEEDS.get(ns.command, {}) if is_msc(getattr(ns, arg, None))}
    if not urls:
        yield
        return
    ns.remote_args = dict(urls)
    import tempfile  # (a verdict on a local path need not pay for it)

    # object storage: loaded only for a command given an msc:// URL
    from megatron_preflight.remote.mirror import staged
    from megatron_preflight.remote.publish import publish, require_empty
    from megatron_preflight.remote.store import Store

    with contextlib.ExitStack() as stack:
        mirrors: list[Any] = []
        locals_: dict[str, str] = {}
        publish_to: tuple[Any, str] | None = None

        def shown(text: str) -> str:
            for m in mirrors:
                text = m.shown(text)
            for url, local in locals_.items():
                text = text.replace(local, url)
            return text

        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Shown(out, shown), _Shown(err, shown)
        stack.callback(setattr, sys, "stdout", out)
        stack.callback(setattr, sys, "stderr", err)
        try:
            for arg, url in urls.items():
                need = _need(ns, arg)
                if need == "publish":
                    store = Store(url)
                    require_empty(store)
                    tmp = tempfile.mkdtemp(prefix="preflight-msc-out-")
                    stack.callback(shutil.rmtree, tmp, True)
                    local = os.path.join(tmp, "checkpoint")
                    locals_[url] = local
                    publish_to = (store, local)
                    setattr(ns, arg, local)
                    continue
                mirror = stack.enter_context(staged(url, need, getattr(ns, "iteration", None)))
                mirrors.append(mirror)
                setattr(ns, arg, mirror.local)
            yield
            if publish_to is not None and not getattr(ns, "dry_run", False) and os.path.isdir(publish_to[1]):
                n = publish(publish_to[1], publish_to[0])
                print(f"published {n} object(s) to {publish_to[0].url} (the tracker last)", file=sys.stderr)
            for m in mirrors:
                if ns.command in WRITES_BESIDE:
                    for rel in m.new_files():
                        m.store.upload(rel, m.path(rel))
                        print(f"uploaded {m.store.url_of(rel)}", file=sys.stderr)
                print(f"megatron-preflight: {m.summary()}", file=sys.stderr)
        except PreflightError as exc:
            exc.message = shown(exc.message)
            exc.path = shown(exc.path) if exc.path else exc.path
            exc.fix = shown(exc.fix) if exc.fix else exc.fix
            raise
