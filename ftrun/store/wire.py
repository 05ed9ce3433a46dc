"""A client of torch's TCPStore that speaks its wire protocol itself, so that it needs no torch.

`ftrun status` and `ftrun inject` read and post a few keys of a running job's store; importing torch for
that would cost seconds. This is the subset of the protocol they use, as torch's own client speaks it
(torch/csrc/distributed/c10d/TCPStore.cpp; the servers are TCPStoreBackend.cpp and
TCPStoreLibUvBackend.cpp), checked against both server backends by tests/store/test_wire.py:

- A query is one byte, its query type, then its arguments. A string or a value is a u64 length and its
  bytes; a list of keys is a u64 count and the keys; numbers are little-endian (torch sends them in host
  order, and every platform torch ships for is little-endian).
- On connecting, the client sends VALIDATE with the magic number 0x3C85F7CE, then PING with a u32 nonce
  that the server echoes. A peer that does not echo it within the deadline is not a TCPStore.
- torch's client puts "/" before every key, and so does this one: both see the same keys.
- The server answers GET only for a key that exists, so :meth:`StoreClient.get` first WAITs for the key,
  as torch's client does.
- A WAIT still pending at its deadline is withdrawn with CANCEL_WAIT; the server acknowledges it with
  WAIT_CANCELED (preceded by STOP_WAITING when the keys arrived meanwhile), so the connection stays usable.
  Closing a client withdraws the WAITs still armed the same way: the server would otherwise answer into the
  closed connection once the key came, and torch logs each such answer as a failed write.
- For the same reason :meth:`StoreClient.interrupt` never closes or shuts down a connection under a query:
  it wakes the call through a pipe, and the call withdraws its WAIT, or reads the answer already on its way.

Every call has a monotonic deadline and raises :class:`StoreTimeout` once it passes; any other failure is a
:class:`StoreError` (both are RuntimeErrors, as torch's store errors are). A call that fails half-way
through leaves the byte stream in an unknown state, so the connection is closed.
"""

from __future__ import annotations

import os
import random
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from enum import IntEnum
from typing import TypeVar

MAGIC = 0x3C85F7CE
"""The number a client sends with VALIDATE (``validationMagicNumber`` in torch)."""
KEY_PREFIX = "/"
"""What torch's TCPStore client puts before each key on the wire."""
KEY_ERRORS = "surrogateescape"
"""How a key's bytes that are not UTF-8 (anyone may set such a key) become its name and back: a key listed
is one that can be deleted."""
DEFAULT_TIMEOUT = 5.0
"""Seconds a call may take unless told otherwise."""
WITHDRAW_TIMEOUT = 0.5
"""Seconds a close gives its WAITs' withdrawals in all (a store that does not answer costs no more)."""
RECV_SIZE = 1 << 16
"""Bytes asked of the socket per read."""

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")
_T = TypeVar("_T")


class Query(IntEnum):
    """torch's ``QueryType``: the first byte of each query (only the ones used here are sent)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    MULTI_GET = 10
    CANCEL_WAIT = 12
    PING = 13


CHECK_READY = 0
"""CHECK's answer when every key exists (``CheckResponseType::READY``)."""
STOP_WAITING = 0
"""WAIT's answer once every key exists (``WaitResponseType::STOP_WAITING``)."""
WAIT_CANCELED = 1
"""CANCEL_WAIT's acknowledgement (``WaitResponseType::WAIT_CANCELED``)."""


class StoreError(RuntimeError):
    """A store call failed: the store could not be reached, went away, or is not a TCPStore."""


class StoreTimeout(StoreError):
    """A store call ran past its deadline (a key waited for was not set in time, or no answer came)."""


class _Woken(StoreError):
    """:meth:`StoreClient.interrupt` woke a wait for a WAIT's answer (the WAIT is still armed)."""


def _blob(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _value(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout: float | timedelta | None, default: float) -> float:
    if timeout is None:
        return default
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class StoreClient:
    """One connection to a TCPStore server at ``host:port``, validated on connecting.

    The methods are those of torch's ``TCPStore`` that ftrun's command line uses, with the same names and
    meanings; each waits at most ``timeout`` seconds unless given its own. Connecting waits at most
    ``connect_timeout`` seconds (default ``timeout``) for the server to answer, and so do the connections it
    opens besides: more for a store known to be about to be served on a socket that already listens.
    ``first_connect_timeout`` (default ``connect_timeout``) bounds this connection's own: a client that keeps
    trying until the store is served waits that long, rather than leave a connection the server then answers
    in vain (torch's server logs each such answer as a failed write); ``slow`` is called if no answer came
    within ``timeout``, so that it can say what it waits for. ``wakeable`` makes the pipe through which
    :meth:`interrupt` ends a call blocked in this client (two descriptors more).
    """

    def __init__(self, host: str, port: int, timeout: float = DEFAULT_TIMEOUT,
                 connect_timeout: float | None = None, first_connect_timeout: float | None = None,
                 slow: Callable[[], None] | None = None, wakeable: bool = True) -> None:
        self.endpoint = f"{host}:{port}"
        self._address = (host, port)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._received = bytearray()  # answers read from the socket and not yet taken
        self._asked = False  # a query went out since the last read: its answer is a round trip away
        self._waiters: list[_Waiter] = []  # the connections wait_any waits on, one per key it waits for
        self._wake: tuple[int, int] | None = None  # a pipe interrupt() writes to, polled by every wait (wakeable)
        self._wake_lock = threading.Lock()  # an interrupt() never writes to the pipe's numbers once closed
        self._interrupted = False
        patience = timeout if connect_timeout is None else connect_timeout
        self._patience = patience  # for the connections wait_any opens
        if first_connect_timeout is not None:
            patience = first_connect_timeout
        deadline = time.monotonic() + patience
        try:
            self._sock: socket.socket | None = socket.create_connection((host, port), timeout=patience)
        except socket.timeout:
            raise StoreTimeout(f"no connection within {patience:g} s") from None
        except OSError as exc:
            raise StoreError(exc.strerror or str(exc)) from None
        except UnicodeError as exc:  # a name the idna codec refuses to look up: a label over 63 characters
            raise StoreError(f"not a host name that can be looked up ({exc})") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setblocking(False)  # each call tries its read or write at once, and waits only when it must
        nonce = random.getrandbits(32)
        try:
            self._send(bytes([Query.VALIDATE]) + _U32.pack(MAGIC) + bytes([Query.PING]) + _U32.pack(nonce), deadline)
            if slow is not None:
                echoed = select.poll()  # not select: it takes no descriptor past 1,023
                echoed.register(self._sock, select.POLLIN)
                if not echoed.poll(max(0, round(min(timeout, deadline - time.monotonic()) * 1000))):
                    slow()
            echo = _U32.unpack(self._recv(_U32.size, deadline))[0]
        except StoreTimeout:
            self.close()
            raise StoreTimeout(f"no TCPStore answered within {patience:g} s (is another service listening there?)"
                               ) from None
        except StoreError as exc:
            self.close()
            raise StoreError(f"not a TCPStore: {exc}") from None
        if echo != nonce:
            self.close()
            raise StoreError("not a TCPStore: it answered the handshake with something else")
        if wakeable:
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._wake = (read, write)

    # ------------------------------------------------------------------ the calls
    def set(self, key: str, value: str | bytes) -> None:
        """Set ``key`` to ``value``."""
        self._call(bytes([Query.SET]) + self._key(key) + _blob(_value(value)), None, lambda deadline: None)

    def set_many(self, items: Sequence[tuple[str, str | bytes]]) -> None:
        """Set each ``(key, value)``, in order, in one write (SET has no answer)."""
        self._call(b"".join(bytes([Query.SET]) + self._key(key) + _blob(_value(value)) for key, value in items),
                   None, lambda deadline: None)

    def get(self, key: str, timeout: float | timedelta | None = None) -> bytes:
        """The value of ``key``, once it is set (StoreTimeout if it is not within the timeout)."""
        deadline = self._deadline(timeout)
        self._wait([key], deadline)
        return self._call(bytes([Query.GET]) + self._key(key), deadline, self._recv_blob)

    def multi_get(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> list[bytes]:
        """The values of ``keys``, once they are all set."""
        deadline = self._deadline(timeout)
        self._wait(keys, deadline)
        return self._call(bytes([Query.MULTI_GET]) + self._keys(keys), deadline,
                          lambda d: [self._recv_blob(d) for _ in keys])

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 when unset); returns the new value."""
        return self._call(bytes([Query.ADD]) + self._key(key) + _I64.pack(amount), None, self._recv_i64)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is unset and ``expected`` is empty);
        returns the value it holds afterwards."""
        query = bytes([Query.COMPARE_SET]) + self._key(key) + _blob(_value(expected)) + _blob(_value(desired))
        return self._call(query, None, self._recv_blob)

    def read_many(self, keys: Sequence[str], deleting: Sequence[str] = (),
                  spans: Sequence[str] = ()) -> list[bytes | None]:
        """Delete the keys in ``deleting``, then the value of each of ``keys`` (None where none is set), in two
        round trips at most: the deletes and a CHECK of each key written at once and answered in order, then
        a GET of each key that is set (none when none is). Nothing here touches a key it reads (a COMPARE_SET
        would: torch's libuv server wakes the key's waiters even when it sets nothing). TCPStore reads no
        prefix: ``spans`` changes nothing (every key's query goes in the same round trip anyway).
        """
        queries = [bytes([Query.DELETE_KEY]) + self._key(key) for key in deleting]
        queries += [bytes([Query.CHECK]) + self._keys([key]) for key in keys]

        def answers(deadline: float) -> list[bool]:
            for _ in deleting:
                self._recv_i64(deadline)
            return [self._recv_byte(deadline) == CHECK_READY for _ in keys]

        present = self._call(b"".join(queries), None, answers)
        found = [key for key, there in zip(keys, present) if there]
        if not found:
            return [None] * len(keys)
        values = iter(self._call(b"".join(bytes([Query.GET]) + self._key(key) for key in found), None,
                                 lambda deadline: [self._recv_blob(deadline) for _ in found]))
        return [next(values) if there else None for there in present]

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every one of ``keys`` is set, without waiting."""
        return self._call(bytes([Query.CHECK]) + self._keys(keys), None, self._recv_byte) == CHECK_READY

    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        """Return once every one of ``keys`` is set; StoreTimeout if they are not within the timeout."""
        self._wait(keys, self._deadline(timeout))

    def wait_any(self, keys: Sequence[str], timeout: float, fetch: Sequence[str] = (),
                 then: Mapping[str, str] | None = None) -> dict[str, bytes | None]:
        """Return once one of ``keys`` is set, or after ``timeout`` s: the keys seen set (none: empty), each
        with its value where it is in ``fetch`` (None for the others).

        Each key is waited for on a connection of its own (a TCPStore WAIT waits for all its keys, and a
        connection holds one WAIT), opened at the first call and kept: a WAIT still pending when this returns
        stays armed, and a later call for the same key finds it there, so waiting again for a key that did not
        come (a mailbox's bell, while a broadcast came) costs the store nothing. A key to fetch is read on its
        own connection as soon as its WAIT answers, and the WAIT for its successor in ``then`` (the next
        broadcast) goes in the same write: the next call finds it armed. The main connection stays free.
        """
        deadline = self._deadline(timeout)
        successors = then or {}
        with self._lock:
            try:
                self._refuse_if_interrupted()
                waiters = [self._waiter(slot, key, deadline) for slot, key in enumerate(keys)]
                while not any(waiter.fired for waiter in waiters):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return {}
                    poller, wake = self._woken_by()  # not select: it takes no descriptor past 1,023
                    for waiter in waiters:
                        poller.register(waiter.sock, select.POLLIN)
                    ready = {fd for fd, _ in poller.poll(left * 1000)}
                    if wake in ready:
                        raise StoreError("interrupted")
                    for waiter in waiters:
                        if waiter.sock.fileno() in ready:
                            waiter.take_answer(deadline)
                came: dict[str, bytes | None] = {}
                for key, waiter in zip(keys, waiters):
                    if waiter.fired and key in fetch:
                        came[key] = waiter.fetch(key, successors.get(key), deadline)  # armed for the successor
                    elif waiter.fired:
                        came[key], waiter.key = None, None  # armed again at the next wait for it
                return came
            except (StoreError, OSError, ValueError) as exc:  # a connection went away, or interrupt()
                self._close(withdraw=True)
                raise exc if isinstance(exc, StoreError) else StoreError(f"the store went away ({exc})") from None

    def _woken_by(self) -> tuple[select.poll, int | None]:
        """A poll object that wakes when :meth:`interrupt` is called (at once if it was: the pipe stays
        readable), for a wait to register its sockets in, and the descriptor that wakes it (None: not wakeable)."""
        poller = select.poll()
        wake = self._wake
        if wake is not None:
            poller.register(wake[0], select.POLLIN)
        return poller, wake[0] if wake is not None else None

    def _refuse_if_interrupted(self) -> None:
        if self._interrupted:
            raise StoreError("interrupted")

    def _waiter(self, slot: int, key: str, deadline: float) -> _Waiter:
        """The connection for the ``slot``-th key of :meth:`wait_any`, waiting for ``key`` (the lock is held)."""
        if self._sock is None:
            raise StoreError("the connection is closed")
        while len(self._waiters) <= slot:
            self._waiters.append(_Waiter(StoreClient(*self._address, self.timeout, self._patience, wakeable=False)))
        waiter = self._waiters[slot]
        if waiter.key != key:
            waiter.arm(key, deadline)
        return waiter

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        return self._call(bytes([Query.DELETE_KEY]) + self._key(key), None, self._recv_i64) == 1

    def num_keys(self) -> int:
        """How many keys the store holds (torch counts some of its own)."""
        return self._call(bytes([Query.GETNUMKEYS]), None, self._recv_i64)

    def close(self) -> None:
        """Close the connection (calls after this raise StoreError), and those :meth:`wait_any` opened: each
        WAIT still armed on them is withdrawn first, unless another thread's call is under way."""
        if self._lock.acquire(blocking=False):
            try:
                self._close(withdraw=True)
            finally:
                self._lock.release()
        else:
            self._close(withdraw=False)

    def _close(self, withdraw: bool) -> None:
        """Close every connection; with ``withdraw``, the armed WAITs are withdrawn first, within
        WITHDRAW_TIMEOUT s in all: the server would otherwise answer the closed connection once the key came
        (torch logs that as a failed write)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        deadline = time.monotonic() + WITHDRAW_TIMEOUT
        for waiter in self._waiters:
            if withdraw:
                waiter.withdraw(deadline)
            waiter.client.close()
        with self._wake_lock:
            if self._wake is not None:
                for fd in self._wake:
                    os.close(fd)
                self._wake = None

    def interrupt(self) -> None:
        """End, from another thread, the call this (wakeable) client is blocked in, and every later one: they
        raise StoreError. The call is woken through a pipe, never by shutting its connection down under it: a
        wait withdraws its WAIT, and any other call reads the answer already on its way (WITHDRAW_TIMEOUT s at
        most) and returns it. A connection closed with answers on their way is reset, and the server logs each
        answer it then writes into it as a failed write (a mailbox reader stopped mid-read did so)."""
        self._interrupted = True
        with self._wake_lock:
            if self._wake is not None:
                try:
                    os.write(self._wake[1], b"\0")
                except BlockingIOError:  # full: woken already
                    pass

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the protocol
    def _wait(self, keys: Sequence[str], deadline: float) -> None:
        with self._lock:
            try:
                self._refuse_if_interrupted()
                self._send(bytes([Query.WAIT]) + self._keys(keys), deadline)
                self._await_socket(select.POLLIN, deadline, "", waiting=True)
                answer = self._recv_byte(deadline)
            except StoreTimeout:
                self._cancel_wait()
                raise StoreTimeout(f"{', '.join(keys)} not set within the timeout") from None
            except _Woken:
                self._cancel_wait(time.monotonic() + WITHDRAW_TIMEOUT)
                self._close(withdraw=True)
                raise StoreError("interrupted") from None
            except StoreError:
                self._close(withdraw=True)  # the lock is held: close() would not withdraw
                raise
        if answer != STOP_WAITING:
            self.close()
            raise StoreError(f"unexpected answer {answer} to WAIT")

    def _cancel_wait(self, deadline: float | None = None) -> None:
        """Withdraw the pending WAIT and read the acknowledgement by ``deadline`` (default: the call timeout's);
        the connection is closed where it does not come."""
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout
        try:
            self._send(bytes([Query.CANCEL_WAIT]), deadline)
            answer = self._recv_byte(deadline)
            if answer == STOP_WAITING:  # the keys were set just before the cancel arrived
                answer = self._recv_byte(deadline)
        except StoreError:
            answer = None
        if answer != WAIT_CANCELED:
            self._close(withdraw=True)

    def _call(self, query: bytes, deadline: float | None, read: Callable[[float], _T]) -> _T:
        """Send one query and read its answer with ``read``, all before the deadline."""
        deadline = deadline if deadline is not None else self._deadline(None)
        with self._lock:
            try:
                self._refuse_if_interrupted()
                self._send(query, deadline)
                return read(deadline)
            except StoreError:
                self._close(withdraw=True)  # the lock is held: close() would not withdraw
                raise

    def _deadline(self, timeout: float | timedelta | None) -> float:
        return time.monotonic() + _seconds(timeout, self.timeout)

    @staticmethod
    def _key(key: str) -> bytes:
        return _blob((KEY_PREFIX + key).encode(errors=KEY_ERRORS))

    def _keys(self, keys: Sequence[str]) -> bytes:
        return _U64.pack(len(keys)) + b"".join(self._key(k) for k in keys)

    def _send(self, data: bytes, deadline: float) -> None:
        """Write ``data`` before the deadline: at once where the socket takes it (a query always fits), else as
        the socket drains."""
        view = memoryview(data)
        while view:
            sock = self._socket()
            try:
                view = view[sock.send(view):]
                self._asked = True
            except BlockingIOError:
                self._await_socket(select.POLLOUT, deadline, "the store did not take the query in time")
            except OSError as exc:
                raise StoreError(f"the store went away ({exc.strerror or exc})") from None

    def _recv(self, size: int, deadline: float) -> bytes:
        """The next ``size`` bytes of the server's answers: from what an earlier read took in beyond its own
        answer, then from the socket, in reads as large as the socket has (few system calls for a batch; none
        spent waiting when the answer is there already)."""
        while len(self._received) < size:
            sock = self._socket()
            if self._asked:  # no answer yet to read: wait for it before reading, not after a read that finds none
                self._await_socket(select.POLLIN, deadline, "no answer in time")
                self._asked = False
            try:
                chunk = sock.recv(RECV_SIZE)
            except BlockingIOError:
                self._asked = True
                continue
            except OSError as exc:
                raise StoreError(f"the store went away ({exc.strerror or exc})") from None
            if not chunk:
                raise StoreError("the connection was closed")
            self._received += chunk
        data = bytes(self._received[:size])
        del self._received[:size]
        return data

    def _socket(self) -> socket.socket:
        if self._sock is None:
            raise StoreError("the connection is closed")
        return self._sock

    def _await_socket(self, event: int, deadline: float, late: str, waiting: bool = False) -> None:
        """Wait until the socket is ready for ``event`` (or hung up: the next call says how), StoreTimeout with
        ``late`` once the deadline passes. When :meth:`interrupt` wakes it, a wait for a WAIT's answer
        (``waiting``) raises _Woken at once; any other wait goes on for the answer on its way, WITHDRAW_TIMEOUT
        s at most, then raises StoreError. A poll, not a select: a process with many connections has
        descriptors past select's limit."""
        fd = self._socket().fileno()
        poller, wake = self._woken_by()
        poller.register(fd, event)
        interrupted = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError("interrupted") if interrupted else StoreTimeout(late)
            ready = [ready_fd for ready_fd, _ in poller.poll(left * 1000)]
            if fd in ready:
                return
            if wake not in ready:
                continue  # the deadline passed
            if waiting:
                raise _Woken()
            poller.unregister(wake)
            interrupted = True
            deadline = min(deadline, time.monotonic() + WITHDRAW_TIMEOUT)

    def _recv_byte(self, deadline: float) -> int:
        return self._recv(1, deadline)[0]

    def _recv_i64(self, deadline: float) -> int:
        return _I64.unpack(self._recv(_I64.size, deadline))[0]

    def _recv_blob(self, deadline: float) -> bytes:
        return self._recv(_U64.unpack(self._recv(_U64.size, deadline))[0], deadline)


class _Waiter:
    """A connection of :meth:`StoreClient.wait_any`'s and the key its pending WAIT is for (None: none pending)."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client
        self.key: str | None = None
        self.fired = False

    @property
    def sock(self) -> socket.socket:
        if self.client._sock is None:
            raise StoreError("the connection is closed")
        return self.client._sock

    def arm(self, key: str, deadline: float) -> None:
        """Wait for ``key`` (withdrawing the WAIT pending for another key, unless it came meanwhile)."""
        client = self.client
        if self.key is not None:
            client._cancel_wait()  # closes the connection when it fails: the WAIT below then raises
        client._send(bytes([Query.WAIT]) + client._keys([key]), deadline)
        self.key, self.fired = key, False

    def withdraw(self, deadline: float) -> None:
        """Withdraw the WAIT pending on this connection, if one is (before it is closed)."""
        if self.key is not None and not self.fired and self.client._sock is not None:
            self.client._cancel_wait(deadline)
            self.key = None

    def take_answer(self, deadline: float) -> None:
        """Read the answer of the pending WAIT (the socket is readable): its key is set."""
        self.client._asked = False  # the answer is there: read it without waiting first
        if self.client._recv_byte(deadline) != STOP_WAITING:
            raise StoreError("unexpected answer to WAIT")
        self.fired = True

    def fetch(self, key: str, successor: str | None, deadline: float) -> bytes:
        """The value of ``key``, whose WAIT answered; the WAIT for ``successor`` is sent with the read."""
        client = self.client
        query = bytes([Query.GET]) + client._key(key)
        self.key = successor
        if successor is not None:
            query += bytes([Query.WAIT]) + client._keys([successor])
            self.fired = False
        return client._call(query, deadline, client._recv_blob)
