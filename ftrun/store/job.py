"""A job's store as ftrun uses it: records, mailboxes, leases and plans over any :class:`KeyValue` backend."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

from ftrun.errors import UsageError
from ftrun.protocol import Plan
from ftrun.store import keys
from ftrun.store.kv import KeyValue


class MalformedValue(ValueError):
    """A value in the store that is not what ftrun wrote there (not JSON, not an object)."""


def decode_object(raw: bytes | str) -> dict[str, Any]:
    """A JSON object read from the store; :class:`MalformedValue` for anything else."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedValue(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise MalformedValue(f"not a JSON object but {type(value).__name__}")
    return value


class JobStore:
    """The one interface the agent, the workers' launcher side, ``ftrun status`` and ``ftrun inject`` use.

    Every key comes from :mod:`ftrun.store.keys`; every value ftrun writes is JSON. A store backend plugs in
    below as the :class:`KeyValue` it wraps. Calls raise ``RuntimeError`` when the store does not answer.
    """

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    # ------------------------------------------------------------ records
    def write_job(self, info: dict[str, Any]) -> None:
        """The job's description (run id, nodes, world size, run directory): written by the leader at start."""
        self.kv.set(keys.JOB, json.dumps(info))

    def read_job(self, wait: float) -> dict[str, Any] | None:
        """The job's description, waiting up to ``wait`` s for a job that has just started; None if absent."""
        return self._read_waiting(keys.JOB, wait)

    def write_status(self, node_rank: int, record: dict[str, Any]) -> None:
        """Node ``node_rank``'s live status record."""
        self.kv.set(keys.status_node(node_rank), json.dumps(record))

    def write_job_status(self, record: dict[str, Any]) -> None:
        """The job's live status record (the leader's)."""
        self.kv.set(keys.STATUS_JOB, json.dumps(record))

    def read_job_status(self, wait: float = 0.0) -> dict[str, Any] | None:
        """The job's live status record, waiting up to ``wait`` s for the first; None if there is none."""
        return self._read_waiting(keys.STATUS_JOB, wait)

    def read_node_status(self, node_rank: int) -> dict[str, Any] | None:
        """Node ``node_rank``'s live status record, None until it published one."""
        return self._read_waiting(keys.status_node(node_rank), 0.0)

    def _read_waiting(self, key: str, wait: float) -> dict[str, Any] | None:
        if wait > 0:
            try:
                self.kv.wait([key], timedelta(seconds=wait))
            except RuntimeError:  # torch raises DistStoreError (a RuntimeError) on timeout
                return None
        elif not self.kv.check([key]):
            return None
        return decode_object(self.kv.get(key))

    # ------------------------------------------------------------ mailboxes
    def post(self, box: str, message: dict[str, Any]) -> int:
        """Append ``message`` to mailbox ``box`` (any number of writers, one reader); returns its index."""
        index = self.kv.add(keys.mail_count(box), 1)
        self.kv.set(keys.mail_item(box, index), json.dumps(message))
        return index

    def has_mail(self, box: str, index: int) -> bool:
        """Whether message ``index`` of ``box`` has arrived."""
        return self.kv.check([keys.mail_item(box, index)])

    def take_mail(self, box: str, index: int) -> dict[str, Any]:
        """Read and delete message ``index`` of ``box`` (it has arrived); MalformedValue if it is not ftrun's."""
        key = keys.mail_item(box, index)
        raw = self.kv.get(key)
        self.kv.delete_key(key)
        return decode_object(raw)

    def request(self, box: str, message: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """Post a command to ``box`` and wait for the reader's answer (UsageError when none comes)."""
        token = uuid.uuid4().hex
        self.post(box, {**message, "reply_to": token})
        key = keys.reply(token)
        try:
            self.kv.wait([key], timedelta(seconds=timeout))
        except RuntimeError:
            raise UsageError(f"the job did not answer within {timeout:.0f} s (is it still running?)") from None
        answer = self.kv.get(key)
        self.kv.delete_key(key)
        try:
            return decode_object(answer)
        except MalformedValue as exc:
            raise UsageError(f"the job's answer was not understood ({exc})") from None

    def reply(self, message: dict[str, Any], answer: dict[str, Any]) -> None:
        """Answer a command posted with :meth:`request` (nothing to do for one without ``reply_to``)."""
        token = message.get("reply_to")
        if isinstance(token, str) and token:
            self.kv.set(keys.reply(token), json.dumps(answer))

    # ------------------------------------------------------------ leases
    def renew_lease(self, node_rank: int) -> bool:
        """Renew node ``node_rank``'s lease; returns whether the leader has evicted that node."""
        self.kv.add(keys.lease(node_rank), 1)
        return self.kv.check([keys.evicted(node_rank)])

    def lease_count(self, node_rank: int) -> int:
        """How often node ``node_rank`` has renewed its lease."""
        return self.kv.add(keys.lease(node_rank), 0)

    def evict(self, node_rank: int) -> None:
        """Mark node ``node_rank`` lost: should it come back, it learns it must stop."""
        self.kv.set(keys.evicted(node_rank), "1")

    def is_evicted(self, node_rank: int) -> bool:
        """Whether the leader declared node ``node_rank`` lost."""
        return self.kv.check([keys.evicted(node_rank)])

    # ------------------------------------------------------------ attempts
    def clear_worker_keys(self) -> None:
        """Delete what the workers of an ended attempt wrote (process group addresses, barrier counters).

        Call it once they are all gone: the next group's ``init_process_group`` would otherwise read the
        dead workers' addresses and fail to connect (pytorch#135712). ftrun's own keys are namespaced per
        attempt, and stay. A backend that cannot list its keys (older torch) leaves everything.
        """
        list_keys = getattr(self.kv, "list_keys", None)
        for key in list_keys() if list_keys is not None else []:
            if not key.startswith(keys.OWN_PREFIX):
                self.kv.delete_key(key)

    # ------------------------------------------------------------ plans
    def publish_plan(self, attempt: int, plan: Plan) -> None:
        """Record ``plan`` as the current generation of ``attempt``."""
        self.kv.set(keys.plan(attempt, plan.gen), json.dumps(plan.message()))
        self.kv.set(keys.current_gen(attempt), str(plan.gen))

