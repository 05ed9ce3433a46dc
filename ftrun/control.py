"""Talking to a running job through its store: mailboxes for commands, and a client connection.

Layout of ftrun's keys that outlive attempts (all under ``ftrun/``):

- ``ftrun/job``                      JSON: run id, nodes, world size (written by the leader at start)
- ``ftrun/mail/<box>/n``             counter of messages posted to mailbox ``<box>``
- ``ftrun/mail/<box>/<i>``           message ``i`` (1-based), a JSON object
- ``ftrun/reply/<token>``            the answer to a command carrying ``reply_to = token``
- ``ftrun/status/job``               JSON: the job's live status, written by the leader about once a second
- ``ftrun/status/node/<node_rank>``  JSON: a node's live status (its workers, its last events), same rhythm

A mailbox has one reader (an agent, or the leader); any number of writers. Posting is two store calls
(``add`` then ``set``); reading is a ``check`` per poll, cheap enough for a few polls a second.
"""

from __future__ import annotations

import json
import socket
import uuid
from datetime import timedelta
from typing import Any

from ftrun.errors import NoSuchJob, UsageError

JOB_KEY = "ftrun/job"
STATUS_JOB_KEY = "ftrun/status/job"


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


class Mailbox:
    """The reading end of a mailbox: :meth:`poll` returns the messages posted since the last call."""

    def __init__(self, store: Any, box: str) -> None:
        self.store = store
        self.box = box
        self.next = 1

    def poll(self) -> list[dict[str, Any]]:
        """Messages that arrived, in order (never blocks)."""
        messages = []
        while self.store.check([f"ftrun/mail/{self.box}/{self.next}"]):
            key = f"ftrun/mail/{self.box}/{self.next}"
            messages.append(json.loads(self.store.get(key)))
            self.store.delete_key(key)
            self.next += 1
        return messages


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


def connect(endpoint: str, timeout: float = 5.0) -> Any:
    """A client connection to the store of the job at HOST:PORT; a clear UsageError when it is not there."""
    host, _, port_text = endpoint.rpartition(":")
    if not host or not port_text.isdigit():
        raise UsageError(f"--endpoint {endpoint!r}: expected HOST:PORT, e.g. node0:29500")
    port = int(port_text)
    try:  # a plain connect first: a refused or unreachable endpoint is one line, at once
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise NoSuchJob(f"cannot reach a job at {host}:{port}: {exc.strerror or exc}") from None
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout),
                        use_libuv=True)
    except RuntimeError as exc:
        raise NoSuchJob(f"cannot reach a job at {host}:{port}: {str(exc).splitlines()[0]}") from None
