"""An etcd cluster as a job's store: the :class:`~ftrun.store.kv.KeyValue` operations over etcd's v3 API.

ftrun speaks etcd's HTTP/JSON gateway, which every etcd since 3.3 serves on its client port, through urllib3
(:mod:`ftrun.store.etcd_http`): it needs neither gRPC nor generated protobuf code, and the few v3 calls ftrun
makes (range, put, delete, a transaction, the lease calls, a watch) are posted as they are, with the header
revision a watch must start from and the mod revision a compare-and-swap compares.

- Every key of a job lives under ``/ftrun/<run id>/``: jobs that share a cluster never see each other's keys.
- ``get`` and ``wait`` read the key and, when it is absent, watch it from the revision they read at: a value
  written between the read and the watch is not missed, and nothing polls. ``wait_any`` (a mailbox reader's
  wait for its bell and the next broadcast) keeps its watches open from one wait to the next, and takes the
  values from their events (:mod:`ftrun.store.etcd_watch`).
- An election's claim is a create that only one caller can make (a transaction on the key's create revision).
- ``add`` is a compare-and-swap on the key's mod revision, retried while another writer wins.
- Several endpoints (``h1:2379,h2:2379,h3:2379``) are tried in turn, from a member drawn at random (the
  clients of a job spread over the cluster): a member that stops answering is left for the next, so losing
  one member of three is not noticed by the job (:mod:`ftrun.store.etcd_cluster`).
- Leases are etcd's own (``lease/grant``, ``lease/keepalive``): a key written on a lease is deleted by etcd
  once nobody has kept the lease alive for its TTL, on etcd's clock, so that whether a node is lost is
  decided once, in the cluster, not by each reader's clock.
- Reads go as plain ranges (several at one revision), never as a transaction of reads only: etcd 3.5.0 to
  3.5.4 panics when the client of a read-only transaction goes away before its answer (etcd-io/etcd#14110,
  fixed in 3.5.5), which a SIGKILLed agent's client, the very fault ftrun recovers from, does.
- With a user name, ftrun authenticates (``/v3/auth/authenticate``) and sends the token with each call,
  authenticating again when etcd refuses an expired one.

Every failure to reach the cluster raises :class:`EtcdUnavailable`, a ``RuntimeError`` as the seam asks.
"""

from __future__ import annotations

import base64
import math
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from ftrun.store.etcd_config import EtcdOptions, EtcdUnavailable, EtcdUnreachable
from ftrun.store.etcd_watch import KeyRange, OpenWatch, Watches, b64, prefix_end, range_for

TXN_PUTS = 128
"""Writes per transaction: etcd's default limit (--max-txn-ops)."""
SPAN_LIMIT = 64
"""Keys one range over a span returns at most (:meth:`EtcdKeyValue.read_many`): a mailbox holds its unread
messages and a counter; one that holds this many or more is read key by key (a writer flooding it gets each
look no more than this many values, and the reader no fewer answers)."""
CAS_TRIES = 100
"""Compare-and-swap attempts before ``add`` gives up (each loses only to another writer's success)."""


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def span_reads(keys: Sequence[str], spans: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The reads that answer each of ``keys``, as (what to read, the keys it answers), in the order of
    ``keys``: the keys under one prefix in ``spans`` (a mailbox's) by one read of that prefix where more than
    one of them is there, every other key by a read of its own. A key named twice is read once."""
    unique = list(dict.fromkeys(keys))
    under = {key: next((prefix for prefix in spans if key.startswith(prefix)), None) for key in unique}
    held = Counter(under.values())
    reads: dict[str, list[str]] = {}
    for key, span in under.items():
        reads.setdefault(span if span is not None and held[span] > 1 else key, []).append(key)
    return list(reads.items())


def _counter(text: bytes | None) -> int:
    """The number a counter holds (0 when absent); EtcdUnavailable for anything else, as TCPStore refuses to
    add to a value that is not a number."""
    if text is None:
        return 0
    if not text.isdigit() or len(text) > 19:
        raise EtcdUnavailable("etcd: the counter holds something that is not a number")
    return int(text)


UNREACHABLE_PAUSE = 0.05
"""Seconds a wait pauses before it reads again when no member could be reached; doubled up to the next."""
UNREACHABLE_PAUSE_MAX = 1.0


class EtcdKeyValue:
    """A job's key-value store in an etcd cluster (see the module's description).

    ``timeout`` bounds each HTTP call; waits are bounded by their own timeout, always on the monotonic clock.
    """

    def __init__(self, options: EtcdOptions, timeout: float = 10.0) -> None:
        from ftrun.store.etcd_cluster import EtcdCluster  # only a job with the etcd backend needs urllib3

        self.options = options
        self.timeout = timeout
        self._prefix = options.prefix.encode()
        self._cluster = EtcdCluster(options, timeout)
        self._interrupted = threading.Event()
        self._watches = Watches()
        self._kept = Watches()  # read_watched's: watches that keep a few keys known (a leader's lease)

    @property
    def member_in_use(self) -> int:
        """Which of the endpoints (an index into ``options.endpoints``) the next call goes to first."""
        return self._cluster.current

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def _range(self, key: str) -> tuple[bytes | None, int, int]:
        """The key's value (None when absent), its mod revision (0 then), and the revision the read was made at;
        EtcdUnavailable for an answer that is not etcd's."""
        answer = self._cluster.call("kv/range", {"key": b64(self._key(key))})
        try:
            kvs = answer.get("kvs") or []
            revision = int(answer["header"]["revision"])
            if not kvs:
                return None, 0, revision
            return _unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"]), revision
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            raise EtcdUnavailable(f"etcd: the answer to a read of {key} is not etcd's") from None

    # ------------------------------------------------------------------ KeyValue
    def set(self, key: str, value: str | bytes) -> None:
        """Write ``value`` under ``key``."""
        self._cluster.call("kv/put", {"key": b64(self._key(key)), "value": b64(value)})

    def set_many(self, items: list[tuple[str, str | bytes]]) -> None:
        """Write every ``(key, value)``, in order, up to TXN_PUTS in one transaction (one write, one fsync)."""
        for start in range(0, len(items), TXN_PUTS):
            puts = [{"request_put": {"key": b64(self._key(key)), "value": b64(value)}}
                    for key, value in items[start:start + TXN_PUTS]]
            self._cluster.call("kv/txn", {"success": puts})

    def read_many(self, keys: Sequence[str], deleting: Sequence[str] = (),
                  spans: Sequence[str] = ()) -> list[bytes | None]:
        """Delete the keys in ``deleting``, then the value of each of ``keys`` (None where absent), in one
        transaction (up to TXN_PUTS operations; a longer list takes more; reads past the deletes go as plain
        ranges, see the module's docstring). Keys under a prefix in ``spans`` are read together, by one range
        over the prefix (:func:`span_reads`). What it learns (a key deleted, a key's value) is noted for the
        open watches, so that a wait right after it does not take its own delete for news."""
        reads = span_reads(keys, spans)
        ops = [{"request_delete_range": {"key": b64(self._key(key))}} for key in deleting]
        ops += [{"request_range": self._read_request(start, answers != [start])}
                for start, answers in reads]
        responses: list[tuple[Any, int]] = []
        try:
            for begin in range(0, len(ops), TXN_PUTS):
                chunk = ops[begin:begin + TXN_PUTS]
                if "request_delete_range" not in chunk[0]:  # reads only: no transaction of them
                    found, revision = self._ranges([op["request_range"] for op in chunk])
                    responses += [({"response_range": {"kvs": kvs}}, revision) for kvs in found]
                    continue
                answer = self._cluster.call("kv/txn", {"success": chunk})
                revision = int(answer["header"]["revision"])
                responses += [(response, revision) for response in answer.get("responses") or []]
            learnt = [(key, None, at) for key, (_, at) in zip(deleting, responses)]
            for (start, answers), (response, at) in zip(reads, responses[len(deleting):]):
                kvs = response["response_range"].get("kvs") or []
                if len(kvs) >= SPAN_LIMIT:  # more than a look's worth there: each key on its own
                    found, at = self._ranges([self._read_request(key, False) for key in answers])
                    kvs = [kv for listed in found for kv in listed]
                held = {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in kvs}
                learnt += [(key, held.get(self._key(key)), at) for key in answers]
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            learnt = []
        values = {key: value for key, value, _ in learnt[len(deleting):]}
        if len(learnt) != len(deleting) + len(set(keys)):
            raise EtcdUnavailable("etcd: the answer to a transaction of reads is not etcd's")
        for key, value, at in learnt:
            self._watches.note(key, value, at)
            self._kept.note(key, value, at)
        return [values[key] for key in keys]

    def _read_request(self, start: str, prefix: bool) -> dict[str, Any]:
        """A range request for the key ``start``, or (``prefix``) for the first SPAN_LIMIT keys under it."""
        if not prefix:
            return {"key": b64(self._key(start))}
        key = self._key(start)
        return {"key": b64(key), "range_end": b64(prefix_end(key)), "limit": str(SPAN_LIMIT)}

    def read_watched(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each of ``keys`` (None where absent) as a watch on it keeps it known: the first call reads
        them (one transaction) and opens a watch on each from just after that read; later calls cost no request
        while the watches stay open, and a watch that ended is opened again after a fresh read (a member that lost
        etcd's leader ends its watches). A watch whose connection was cut without a word hears of no change while
        it stays open: a caller reads with :meth:`read_many` now and then, which these watches learn from too."""
        ranges = {key: KeyRange(key) for key in keys}
        self._kept.keep(ranges.values())
        read: dict[str, bytes | None] = {}
        unknown = self._kept.unknown(ranges)
        if unknown:
            opening = self._kept.missing(ranges.values())
            values, _, revision = self._snapshot(unknown, [])
            read = dict(zip(unknown, values))
            self._open(self._kept, opening, revision)  # else the next call opens them on another member
            for key, value in read.items():
                self._kept.note(key, value, revision)
        known = self._kept.values(ranges)
        return [read[key] if key in read else known.get(key) for key in keys]

    def wait_any(self, keys: Sequence[str], timeout: float, fetch: Sequence[str] = (),
                 then: Mapping[str, str] | None = None) -> dict[str, bytes | None]:
        """Return once one of ``keys`` exists, or after ``timeout`` s: the keys seen set (none: empty), with their
        values. The watches it waits on stay open for the next call (:mod:`ftrun.store.etcd_watch`): a key
        and its successor in ``then`` (a sender's next broadcast) share one, whose events carry the values."""
        successors = then or {}
        ranges = {key: range_for(key, successors.get(key)) for key in keys}
        return self._watch(self._watches, ranges, time.monotonic() + timeout)

    def _watch(self, watches: Watches, ranges: dict[str, KeyRange], deadline: float) -> dict[str, bytes | None]:
        """Wait on ``watches`` until one of the keys of ``ranges`` (key to the range to watch it in) exists, or
        the monotonic ``deadline`` passes (empty): the keys that came, with their values. Keys no open watch
        knows are read first, and the ranges with no watch open get one from just after that read."""
        while True:
            if self._interrupted.is_set():
                raise EtcdUnavailable("etcd: the wait was interrupted")
            watches.keep(ranges.values())
            unknown = watches.unknown(ranges)
            if unknown:
                opening = watches.missing(ranges.values())
                prefixes = [key_range.start for key_range in opening if key_range.prefix]
                values, listed, revision = self._snapshot(unknown, prefixes)
                there = {key: value for key, value in zip(unknown, values) if value is not None}
                if there:
                    return there
                if not self._open(watches, opening, revision, listed):  # the next read goes to another member
                    if time.monotonic() >= deadline:
                        return {}
                    continue
                for key in unknown:
                    watches.note(key, None, revision)
            came = watches.await_any(ranges, deadline, self._interrupted.is_set, time.monotonic)
            if came is not None:
                if self._interrupted.is_set():
                    raise EtcdUnavailable("etcd: the wait was interrupted")
                return came
            self._cluster.move_on()  # a watch ended: its member went away

    def _open(self, watches: Watches, ranges: set[KeyRange], revision: int,
              listed: dict[str, list[str]] | None = None) -> bool:
        """Open a watch on each of ``ranges`` from just after the read made at ``revision`` (a prefix's from the
        names that read ``listed`` under it); False when the member went away since the read (the next call
        goes to another)."""
        try:
            for key_range in ranges:
                watches.add(OpenWatch(self._cluster.member, key_range, revision + 1, self._prefix,
                                      watches.changed,
                                      (listed or {}).get(key_range.start) if key_range.prefix else None))
        except OSError:
            self._cluster.move_on()
            return False
        return True

    def _snapshot(self, keys: Sequence[str], prefixes: Sequence[str]) -> tuple[list[bytes | None], dict[str, list[str]],
                                                                               int]:
        """At one revision: the value of each of ``keys`` (None where absent), the names of the keys under each
        of ``prefixes`` (not their values), and that revision."""
        ops = [{"key": b64(self._key(key))} for key in keys]
        ops += [{"key": b64(self._key(prefix)), "range_end": b64(prefix_end(self._key(prefix))), "keys_only": True}
                for prefix in prefixes]
        found, revision = self._ranges(ops)
        try:
            values = [_unb64(kvs[0].get("value", "")) if kvs else None for kvs in found[:len(keys)]]
            listed = {prefix: [_unb64(kv["key"])[len(self._prefix):].decode(errors="replace") for kv in kvs]
                      for prefix, kvs in zip(prefixes, found[len(keys):])}
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            raise EtcdUnavailable("etcd: the answer to a read is not etcd's") from None
        return values, listed, revision

    def _ranges(self, requests: Sequence[dict[str, Any]]) -> tuple[list[list[Any]], int]:
        """Each range request's key-values, every one read at the revision of the first (a plain range each, not a
        transaction of reads: see the module's docstring), and that revision."""
        found: list[list[Any]] = []
        revision = 0
        for request in requests:
            answer = self._cluster.call("kv/range", {**request, "revision": str(revision)} if found else request)
            try:
                kvs = answer.get("kvs") or []
                for kv in kvs:  # etcd's key-values each carry their mod revision, as a read of one is checked
                    int(kv["mod_revision"])
                revision = revision or int(answer["header"]["revision"])
            except (AttributeError, KeyError, TypeError, ValueError):
                raise EtcdUnavailable("etcd: the answer to a read is not etcd's") from None
            found.append(kvs)
        return found, revision

    def get(self, key: str) -> bytes:
        """The value under ``key``, waiting for it up to the client's timeout."""
        return self._await(key, time.monotonic() + self.timeout)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 if absent): compare-and-swap on its mod revision."""
        encoded = b64(self._key(key))
        for _ in range(CAS_TRIES):
            value, mod_revision, _ = self._range(key)
            current = _counter(value)
            compare = ({"key": encoded, "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}
                       if value is not None
                       else {"key": encoded, "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
            new = current + amount
            answer = self._cluster.call("kv/txn", {"compare": [compare],
                                           "success": [{"request_put": {"key": encoded, "value": b64(str(new))}}]})
            if answer.get("succeeded"):
                return new
        raise EtcdUnavailable(f"etcd: {key} changed under {CAS_TRIES} attempts to add to it")

    def create(self, key: str, value: str | bytes) -> bool:
        """Write ``value`` under ``key`` unless it exists (a transaction on its create revision); whether this
        call wrote it."""
        encoded = b64(self._key(key))
        compare = {"key": encoded, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        answer = self._cluster.call("kv/txn", {"compare": [compare],
                                       "success": [{"request_put": {"key": encoded, "value": b64(value)}}]})
        return bool(answer.get("succeeded"))

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` exists (one read per key, none waits)."""
        return all(self._range(key)[0] is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Return once every one of ``keys`` exists; EtcdUnavailable after ``timeout``."""
        deadline = time.monotonic() + timeout.total_seconds()
        for key in keys:
            self._await(key, deadline)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        answer = self._cluster.call("kv/deleterange", {"key": b64(self._key(key))})
        return str(answer.get("deleted", "0")) != "0"

    def read_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key that starts with ``prefix`` and its value, in one read that does not wait."""
        start = self._key(prefix)
        answer = self._cluster.call("kv/range", {"key": b64(start), "range_end": b64(prefix_end(start))})
        try:
            return {_unb64(kv["key"])[len(self._prefix):].decode(errors="replace"): _unb64(kv.get("value", ""))
                    for kv in answer.get("kvs") or []}
        except (KeyError, TypeError, ValueError, AttributeError):
            raise EtcdUnavailable("etcd: the answer to a listing is not etcd's") from None

    # ------------------------------------------------------------------ leases
    def grant_lease(self, ttl: float) -> int:
        """A new lease that etcd ends ``ttl`` seconds after its last keep-alive (rounded up to whole seconds,
        etcd's unit; etcd raises a shorter one to its minimum, 1.5 election timeouts: 2 s by default)."""
        answer = self._cluster.call("lease/grant", {"TTL": math.ceil(ttl), "ID": 0})
        try:
            return int(answer["ID"])
        except (KeyError, TypeError, ValueError):
            raise EtcdUnavailable("etcd: the answer to a lease grant is not etcd's") from None

    def set_leased(self, key: str, value: str | bytes, lease: int) -> None:
        """Write ``value`` under ``key`` on ``lease``: etcd deletes it when the lease ends."""
        self._cluster.call("kv/put", {"key": b64(self._key(key)), "value": b64(value), "lease": str(lease)})

    def keep_alive(self, lease: int) -> bool:
        """Renew ``lease`` for its TTL; False once etcd has ended it (and deleted its keys)."""
        ttl = self._cluster.call("lease/keepalive", {"ID": str(lease)}).get("TTL")
        try:
            return ttl is not None and int(ttl) > 0
        except (TypeError, ValueError):
            raise EtcdUnavailable("etcd: the answer to a keep-alive is not etcd's") from None

    def end_lease_of(self, key: str) -> None:
        """End the lease ``key`` is written on (etcd deletes its keys and refuses its next keep-alive);
        nothing when the key is gone or on no lease."""
        answer = self._cluster.call("kv/range", {"key": b64(self._key(key))})
        try:
            lease = int((answer.get("kvs") or [{}])[0].get("lease", 0))
        except (AttributeError, TypeError, ValueError, IndexError):
            raise EtcdUnavailable(f"etcd: the answer to a read of {key} is not etcd's") from None
        if lease:
            try:
                self._cluster.call("lease/revoke", {"ID": str(lease)})
            except EtcdUnavailable as exc:
                if "not found" not in str(exc):
                    raise  # ended already otherwise: what was asked

    # ------------------------------------------------------------------ watches
    def _await(self, key: str, deadline: float) -> bytes:
        """The value under ``key``: read, and while it is absent, watched from the revision of the read (a write
        in between is not missed) on a watch of its own, closed when it comes; EtcdUnavailable once the
        monotonic ``deadline`` passes."""
        watches = Watches(self._watches.changed)  # one condition: interrupt() wakes this wait too
        pause = UNREACHABLE_PAUSE
        try:
            while True:
                try:
                    came = self._watch(watches, {key: KeyRange(key)}, deadline)
                except EtcdUnreachable:  # every member at once, as when the one watched died and the others elect
                    if self._interrupted.wait(min(pause, max(0.0, deadline - time.monotonic()))) \
                            or time.monotonic() >= deadline:
                        raise
                    pause = min(2 * pause, UNREACHABLE_PAUSE_MAX)
                    continue
                if key in came and came[key] is not None:
                    return came[key]
                raise EtcdUnavailable(f"etcd: {key} did not appear in time")
        finally:
            watches.close()

    def interrupt(self) -> None:
        """End the wait in progress, and every later one, at once (EtcdUnavailable): for a reader that stops."""
        self._interrupted.set()
        self._watches.wake()

    def close(self) -> None:
        """Close the watches kept open for :meth:`wait_any` and :meth:`read_watched`."""
        self._watches.close()
        self._kept.close()
