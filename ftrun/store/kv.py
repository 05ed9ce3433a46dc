"""The key-value operations ftrun needs from a store: the seam a store backend plugs into.

torch's ``TCPStore`` (the embedded default) has them all; another backend implements this protocol and the
rest of ftrun (mailboxes, leases, plans, records) works on it unchanged. Every failure to reach the store is
raised as a ``RuntimeError`` (torch's ``DistStoreError`` is one), which callers treat as "the store is not
answering now".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Protocol, runtime_checkable


class KeyValue(Protocol):
    """A job's key-value store, shared by every agent and worker of the job."""

    def set(self, key: str, value: str | bytes) -> None:
        """Write ``value`` under ``key``."""

    def get(self, key: str) -> bytes:
        """The value under ``key`` (waits for it, up to the client's timeout)."""

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 if absent) and return the new value."""

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` exists, without waiting."""

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Return once every one of ``keys`` exists; RuntimeError after ``timeout``."""

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""


@runtime_checkable
class BatchingKeyValue(KeyValue, Protocol):
    """A store that takes several calls in one round trip and waits for whichever of several keys comes first
    (the torch-free TCPStore client, etcd): the mailbox reader's look at all its lanes costs one request then,
    however many lanes it has, and it waits for its bell and the next broadcast at once."""

    def read_many(self, keys: Sequence[str], deleting: Sequence[str] = (),
                  spans: Sequence[str] = ()) -> list[bytes | None]:
        """Delete the keys in ``deleting``, then the value of each of ``keys`` (None where absent). ``spans``
        are prefixes under which few keys live besides those read (a mailbox's): a backend that reads key by key
        may read the keys under one of them with one read of the prefix."""

    def wait_any(self, keys: Sequence[str], timeout: float, fetch: Sequence[str] = (),
                 then: Mapping[str, str] | None = None) -> dict[str, bytes | None]:
        """Return once one of ``keys`` exists, or after ``timeout`` s: the keys seen set (none: empty), with the
        values of those in ``fetch`` (the others' may be None). ``then`` names, for a key to fetch, the key
        the next wait will likely want in its place (a backend may start that wait now)."""


@runtime_checkable
class LeasingKeyValue(KeyValue, Protocol):
    """A store that keeps leases itself (etcd): keys on a lease go when nobody keeps it alive, on the store's
    clock. Node leases use them where the backend has them (:mod:`ftrun.store.leases`). It also creates a key
    only where none is (one request each, however many try at once: an election's claims)."""

    def create(self, key: str, value: str | bytes) -> bool:
        """Write ``value`` under ``key`` unless the key exists; whether this call wrote it."""

    def grant_lease(self, ttl: float) -> int:
        """A new lease, ended ``ttl`` seconds after its last keep-alive; its id."""

    def set_leased(self, key: str, value: str | bytes, lease: int) -> None:
        """Write ``value`` under ``key``, deleted when ``lease`` ends."""

    def keep_alive(self, lease: int) -> bool:
        """Renew ``lease``; False once it has ended."""

    def end_lease_of(self, key: str) -> None:
        """End the lease ``key`` is written on now (its keys go with it); nothing when no such key is there."""

    def read_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key that starts with ``prefix``, and its value, in one read that does not wait."""

    def read_watched(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each of ``keys`` (None where absent) as watches opened at the first call keep them known:
        no request per call while they stay open."""
