"""Talking to a running job through its store: mailboxes for commands, and a client connection.

Layout of ftrun's keys that outlive attempts (all under ``ftrun/``):

- ``ftrun/job``                      JSON: run id, nodes, world size (written by the leader at start)
- ``ftrun/mail/<box>/n``             counter of messages posted to mailbox ``<box>``
- ``ftrun/mail/<box>/<i>``           message ``i`` (1-based), a JSON object
- ``ftrun/reply/<token>``            the answer to a command carrying ``reply_to = token``
- ``ftrun/status/job``               JSON: the job's live status, written by the leader about once a second
- ``ftrun/status/node/<node_rank>``  JSON: a node's live status (its workers, its last events), same rhythm

A mailbox has one reader (an agent, or the leader); any number of writers. Posting is two store calls
(``add`` then ``set``); the reader checks for the next index every few milliseconds.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ftrun.errors import NoSuchJob, UsageError
from ftrun.store_wire import StoreClient, StoreError

JOB_KEY = "ftrun/job"
POLL_INTERVAL = 0.01
"""Seconds between two looks for a mailbox's next message: a store round trip each, cheap."""
STATUS_JOB_KEY = "ftrun/status/job"
STORE_START_WAIT = 30.0
"""Seconds to wait for the store of a job that this machine's registry lists: a job is registered as it starts,
and its store is served once its agent has imported torch, seconds later on a busy machine."""


def status_node_key(node_rank: int) -> str:
    """The key of node ``node_rank``'s live status record."""
    return f"ftrun/status/node/{node_rank}"


def node_box(node_rank: int) -> str:
    """The mailbox of the agent of node ``node_rank`` (drills, commands from its leader)."""
    return f"node{node_rank}"


def post(store: Any, box: str, message: dict[str, Any]) -> int:
    """Append ``message`` to mailbox ``box``; returns its index."""
    index = store.add(f"ftrun/mail/{box}/n", 1)
    store.set(f"ftrun/mail/{box}/{index}", json.dumps(message))
    return index


class MailReader:
    """The reading end of a mailbox: a thread that looks for each next message every POLL_INTERVAL.

    It uses a store connection of its own (so the agent's calls never queue behind it), queues what
    arrives and writes a byte to ``wake_fd`` so that an event loop can select on it; :meth:`take`
    returns the queued messages.
    """

    def __init__(self, connect_store: Callable[[], Any], box: str, wake_fd: int) -> None:
        self.box = box
        self.wake_fd = wake_fd
        self._connect = connect_store
        self._queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ftrun-mail-{box}", daemon=True)

    def start(self) -> None:
        """Start waiting for messages."""
        self._thread.start()

    def stop(self) -> None:
        """Stop at the next wake-up (at most a second later); messages not yet read stay in the store."""
        self._stop.set()

    def take(self) -> list[dict[str, Any]]:
        """The messages that arrived since the last call, in order."""
        messages = []
        while not self._queue.empty():
            messages.append(self._queue.get())
        return messages

    def _run(self) -> None:
        store = None
        index = 1
        while not self._stop.wait(0 if store is not None else 1):
            key = f"ftrun/mail/{self.box}/{index}"
            try:
                store = store or self._connect()
                while not store.check([key]):  # check, not wait: a wait that times out logs a warning
                    if self._stop.wait(POLL_INTERVAL):
                        return
                message = json.loads(store.get(key))
                store.delete_key(key)
            except RuntimeError:  # the store went away: connect again
                store = None
                continue
            index += 1
            self._queue.put(message)
            try:
                os.write(self.wake_fd, b"m")
            except BlockingIOError:
                pass  # the loop has not read the earlier wake-ups yet: it will see this message too


def request(store: Any, box: str, message: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """Post a command and wait for its reply (the reader answers with :func:`reply`)."""
    token = uuid.uuid4().hex
    post(store, box, {**message, "reply_to": token})
    key = f"ftrun/reply/{token}"
    try:
        store.wait([key], timedelta(seconds=timeout))
    except RuntimeError:  # torch raises a DistStoreError (a RuntimeError) on timeout
        raise UsageError(f"the job did not answer within {timeout:.0f} s (is it still running?)") from None
    answer = json.loads(store.get(key))
    store.delete_key(key)
    return answer


def reply(store: Any, message: dict[str, Any], answer: dict[str, Any]) -> None:
    """Answer a command posted with :func:`request` (nothing to do for one without ``reply_to``)."""
    token = message.get("reply_to")
    if token:
        store.set(f"ftrun/reply/{token}", json.dumps(answer))


def connect(endpoint: str, timeout: float = 5.0, connect_timeout: float | None = None) -> StoreClient:
    """A client connection to the store of the job at HOST:PORT, without torch (see ftrun.store_wire); a clear
    NoSuchJob when nothing there answers as a TCPStore within ``connect_timeout`` (default ``timeout``) seconds.

    Pass STORE_START_WAIT for a job found in this machine's registry.
    """
    host, _, port_text = endpoint.rpartition(":")
    if not host or not port_text.isdigit():
        raise UsageError(f"--endpoint {endpoint!r}: expected HOST:PORT, e.g. node0:29500")
    try:
        return StoreClient(host, int(port_text), timeout, connect_timeout)
    except StoreError as exc:
        raise NoSuchJob(f"cannot reach a job at {host}:{port_text}: {exc}") from None


def open_store(host: str, port: int, timeout: float) -> Any:
    """A client connection to the TCPStore at ``host:port``; each call waits at most ``timeout`` seconds."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout),
                    use_libuv=True)


def open_store_retrying(host: str, port: int, call_timeout: float, total: float) -> Any:
    """A connection whose calls wait at most ``call_timeout`` s (a short socket timeout is set when connecting),
    retried for ``total`` s: the store may be served later than this process starts."""
    deadline = time.monotonic() + total
    while True:
        try:
            return open_store(host, port, call_timeout)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
