"""S3 requests that cannot hold a save for ever without a word.

s3fs's defaults let one request to an endpoint that accepts connections and never answers block a save for minutes,
and an upload for ever: botocore sends ``Expect: 100-continue`` on uploads and aiohttp waits for the interim answer
with no timeout at all. For ``s3://`` URLs Fabric therefore fills in, where ``storage_options`` leave them out:

- bounds on each request (:data:`DEFAULT_CONFIG`: 10 s to connect, 15 s without an answer, 2 attempts; s3fs tries a
  timed-out call up to 5 times), set with ``storage_options={"config_kwargs": {"connect_timeout": ...,
  "read_timeout": ..., "retries": {"max_attempts": ...}}}``;
- an aiobotocore session that sends uploads without ``Expect: 100-continue`` (so ``read_timeout`` bounds them too),
  and prints one line to stderr naming any request that has had no answer for :data:`NOTICE_AFTER_S` seconds
  (``FABRIC_STORAGE_NOTICE_AFTER``). A ``session`` of your own in ``storage_options`` is used as it is.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import time
from typing import Any

#: botocore settings each S3 request gets unless ``storage_options["config_kwargs"]`` sets them.
DEFAULT_CONFIG: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 15,
    "retries": {"max_attempts": 2, "mode": "standard"},
}

#: Seconds without an answer after which a request is named on stderr.
NOTICE_AFTER_S = float(os.environ.get("FABRIC_STORAGE_NOTICE_AFTER", "10"))

#: fsspec protocols served by s3fs.
S3_PROTOCOLS = frozenset({"s3", "s3a"})

#: The notice scheduled for the request each asyncio task is waiting on.
_WAITING: dict[asyncio.Task[Any], asyncio.TimerHandle] = {}


def bounded_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` for an ``s3://`` URL with :data:`DEFAULT_CONFIG` and the announcing session filled in
    where they are left out (a ``profile`` goes to that session, as s3fs would give it to its own)."""
    options = dict(storage_options)
    config = dict(options.get("config_kwargs") or {})
    for name, value in DEFAULT_CONFIG.items():
        config.setdefault(name, value)
    options["config_kwargs"] = config
    if "session" not in options:
        options["session"] = _announcing_session(options.pop("profile", None))
    return options


@functools.cache
def _announcing_session(profile: str | None) -> Any:
    from aiobotocore.session import AioSession

    session = AioSession(profile=profile)
    session.register("request-created.s3", _without_expect_continue)
    session.register("before-send.s3", _watch)
    session.register("needs-retry.s3", _answered)  # emitted after every attempt, answered or failed
    return session


def _without_expect_continue(request: Any, **_: Any) -> None:
    if "Expect" in request.headers:
        del request.headers["Expect"]


def _watch(request: Any, **_: Any) -> None:
    task = asyncio.current_task()
    if task is None:
        return
    _answered()
    since = time.monotonic()
    _WAITING[task] = asyncio.get_running_loop().call_later(
        NOTICE_AFTER_S, _announce, task, request.method, request.url, since
    )


def _answered(**_: Any) -> None:
    task = asyncio.current_task()
    handle = _WAITING.pop(task, None) if task is not None else None
    if handle is not None:
        handle.cancel()


def _announce(task: asyncio.Task[Any], method: str, url: str, since: float) -> None:
    _WAITING.pop(task, None)
    if task.done():
        return
    rank = os.environ.get("RANK")
    print(
        f"fabric{'' if rank is None else f' (rank {rank})'}: {method} {url} has had no answer for "
        f"{time.monotonic() - since:.0f} s; still waiting. It gives up after its read_timeout (Fabric's default "
        f"{DEFAULT_CONFIG['read_timeout']} s) and is tried again; storage_options={{'config_kwargs': "
        "{'read_timeout': ..., 'connect_timeout': ..., 'retries': {'max_attempts': ...}}} set the bounds.",
        file=sys.stderr,
        flush=True,
    )


def is_s3(url: str) -> bool:
    """Whether ``url`` is served by s3fs."""
    return url.split("://", 1)[0] in S3_PROTOCOLS if "://" in url else False
