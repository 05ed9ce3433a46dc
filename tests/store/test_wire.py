"""ftrun's torch-free TCPStore client against real torch TCPStore servers (libuv and classic backends)."""

from __future__ import annotations

import http.server
import resource
import select
import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from ftrun.store import wire
from ftrun.store.client import open_client_retrying
from ftrun.store.wire import Query, StoreClient, StoreError, StoreTimeout

pytestmark = pytest.mark.fast


PATIENT = 30.0
"""Seconds the tests' own clients give each call, as the torch clients beside them (a loaded machine's handshake
can take more than the default 5 s); the tests of deadlines give their own."""


@pytest.fixture(params=[True, False], ids=["libuv", "classic"])
def server(request):
    """A real TCPStore server on a free port of 127.0.0.1, and a torch client of it.

    The server is given an IPv4 socket of its own, as ftrun's store host gives it: on a socket of its own
    (both address families) the classic server names each client it accepts by a reverse lookup of
    ``::ffff:127.0.0.1``, which no hosts file holds, so it asks DNS first, and a resolver that drops one
    of several queries at once held that server for 5 s (glibc's retry timeout): the test's client, given
    5 s, timed out in its handshake. 127.0.0.1 is found in the hosts file.
    """
    listening = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = listening.getsockname()[1]
    try:
        master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=request.param,
                          master_listen_fd=listening.fileno(), timeout=timedelta(seconds=30))
    except NotImplementedError:  # a libuv server that takes no listening socket (torch 2.6)
        listening.close()
        pytest.skip("this torch's libuv server takes no listening socket")
    listening.detach()  # the server closes it
    client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, use_libuv=request.param,
                      timeout=timedelta(seconds=30))
    yield master, client
    del client, master


def test_what_torch_writes_ftrun_reads_and_back(server):
    master, torch_client = server
    with StoreClient("127.0.0.1", master.port, PATIENT) as ours:
        torch_client.set("ftrun/job", '{"run_id": "r"}')
        assert ours.get("ftrun/job") == b'{"run_id": "r"}'
        assert ours.check(["ftrun/job"]) and not ours.check(["ftrun/job", "missing"])
        ours.set("from/ftrun", b"\x00\xffbytes")
        assert torch_client.get("from/ftrun") == b"\x00\xffbytes"
        assert ours.set("text", "é") is None and torch_client.get("text") == "é".encode()
        assert torch_client.add("counter", 3) == 3 and ours.add("counter", 4) == 7 and torch_client.add("counter", 0) == 7
        assert ours.multi_get(["text", "counter"]) == ["é".encode(), b"7"]
        assert ours.compare_set("cas", "", "first") == b"first"
        assert ours.compare_set("cas", "wrong", "second") == b"first"
        assert torch_client.compare_set("cas", "first", "third") == b"third" and ours.get("cas") == b"third"
        assert ours.num_keys() == torch_client.num_keys()
        assert ours.delete_key("cas") and not ours.delete_key("cas") and not torch_client.check(["cas"])


def test_wait_returns_once_another_client_sets_the_key(server):
    master, torch_client = server
    with StoreClient("127.0.0.1", master.port, PATIENT) as ours:
        outcome = []
        waiter = threading.Thread(target=lambda: outcome.append(ours.get("late", timeout=60)))
        waiter.start()
        torch_client.set("late", "here")
        waiter.join(timeout=60)
        assert outcome == [b"here"]


def test_a_wait_past_its_deadline_times_out_and_the_connection_stays_usable(server):
    master, torch_client = server
    # the calls' deadline is under test, not the handshake's: on a loaded machine the server's thread may take
    # longer than 0.3 s to answer the handshake (seen once in a suite of three at a time on two cores)
    with StoreClient("127.0.0.1", master.port, timeout=0.3, connect_timeout=30) as ours:
        for call in (lambda: ours.wait(["never"]), lambda: ours.get("never"),
                     lambda: ours.wait(["never"], timedelta(seconds=0.2)), lambda: ours.multi_get(["never"])):
            with pytest.raises(StoreTimeout, match="never not set"):
                call()
        torch_client.set("after", "1")
        assert ours.get("after") == b"1" and ours.add("n", 1) == 1


def test_a_store_that_goes_away_fails_the_next_call_at_once():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    ours = StoreClient("127.0.0.1", master.port, timeout=30)
    ours.set("k", "v")
    del master
    with pytest.raises(StoreError):
        ours.get("k")
        ours.get("k")  # the first call may still find the socket open
    with pytest.raises(StoreError, match="closed"):
        ours.check(["k"])


class _Relay:
    """A TCP relay to the store at ``port`` that records what each client connection sends it, in order."""

    def __init__(self, port: int) -> None:
        self.listening = socket.create_server(("127.0.0.1", 0))
        self.port = self.listening.getsockname()[1]
        self.sent: list[bytearray] = []  # per connection, in the order they came
        self.ended: list[threading.Event] = []  # set once the client closed its side
        threading.Thread(target=self._accept, args=(port,), daemon=True).start()

    def _accept(self, port: int) -> None:
        while True:
            try:
                client, _ = self.listening.accept()
            except OSError:  # closed: the test is over
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            sent, ended = bytearray(), threading.Event()
            self.sent.append(sent)
            self.ended.append(ended)
            threading.Thread(target=_pump, args=(client, upstream, sent, ended), daemon=True).start()
            threading.Thread(target=_pump, args=(upstream, client, bytearray(), threading.Event()),
                             daemon=True).start()

    def close(self) -> None:
        self.listening.close()


def _pump(source: socket.socket, sink: socket.socket, record: bytearray, ended: threading.Event) -> None:
    """Copy ``source`` to ``sink`` (recording it) until it ends, then end ``sink``'s sending side."""
    try:
        while data := source.recv(65536):
            record += data
            sink.sendall(data)
    except OSError:
        pass
    finally:
        ended.set()
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


def test_a_listener_that_never_answers_is_not_a_store_within_the_timeout():
    with _listener() as silent:  # connections are queued by the kernel and never served
        started = time.monotonic()
        with pytest.raises(StoreTimeout, match=r"no TCPStore answered within 0\.5 s"):
            StoreClient("127.0.0.1", silent.getsockname()[1], timeout=0.5)
        assert time.monotonic() - started >= 0.5


def test_a_client_trying_until_the_store_is_served_keeps_its_first_connection():
    """The store's socket listens before it is served (StoreHost binds it first, then imports torch): a client
    that tries for ``total`` s waits on its first connection rather than leave it at each call's timeout and
    connect again; the server answered each connection left behind in vain ("Write to client failed")."""
    with _listener() as listening:
        got: list[StoreClient] = []
        told: list[str] = []  # its progress line, once its calls' timeout passed without an answer
        port = listening.getsockname()[1]
        thread = threading.Thread(target=lambda: got.append(open_client_retrying(
            "127.0.0.1", port, 0.05, PATIENT, lambda: told.append("waiting"))), daemon=True)
        thread.start()
        assert select.select([listening], [], [], PATIENT)[0]  # its first connection is queued
        thread.join(0.5)  # ten times its calls' timeout: one that gave up would have connected again by now
        listening.setblocking(False)
        queued = []
        while True:
            try:
                queued.append(listening.accept()[0])
            except BlockingIOError:
                break
        assert len(queued) == 1
        (conn,) = queued
        conn.setblocking(True)
        handshake = b""
        while len(handshake) < 10:  # VALIDATE, the magic number, PING, a nonce: answered with the nonce
            handshake += conn.recv(10 - len(handshake))
        conn.sendall(handshake[6:])
        thread.join(PATIENT)
        assert len(got) == 1 and got[0].timeout == 0.05 and told == ["waiting"]
        got[0].close()
        conn.close()


def test_an_http_server_or_a_closing_listener_is_not_a_store():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(StoreError, match="TCPStore"):
            StoreClient("127.0.0.1", httpd.server_address[1], timeout=1.0)
    finally:
        httpd.shutdown()
        httpd.server_close()
    with _listener() as closing:
        def close_each() -> None:
            conn, _ = closing.accept()
            conn.close()

        threading.Thread(target=close_each, daemon=True).start()
        with pytest.raises(StoreError, match="not a TCPStore: "):
            StoreClient("127.0.0.1", closing.getsockname()[1], timeout=30)


def test_a_port_nobody_listens_on_is_refused(free_port):
    with pytest.raises(StoreError, match="refused"):
        StoreClient("127.0.0.1", free_port(), timeout=5)


@pytest.mark.parametrize("host", ["x" * 100, "a..b"])
def test_a_host_name_the_idna_codec_refuses_is_a_store_error_not_a_unicode_error(host):
    """A label over 63 characters (or an empty one) is refused by the codec that looks a name up, with a
    UnicodeError: ``ftrun status --endpoint`` showed it as a traceback."""
    with pytest.raises(StoreError, match=r"not a host name that can be looked up \(.*label"):
        StoreClient(host, 29500, timeout=5)


@pytest.mark.fast
def test_read_many_deletes_first_then_reads_each_key_or_none(server):
    master, torch_client = server
    torch_client.set("a", b"1")
    torch_client.set("gone", b"x")
    with StoreClient("127.0.0.1", master.port, 5.0) as client:
        assert client.read_many(["a", "gone", "never"], deleting=["gone"]) == [b"1", None, None]
        assert client.read_many(["never"]) == [None]
        assert not torch_client.check(["never"])  # reading creates nothing


@pytest.mark.fast
def test_wait_any_returns_the_key_that_came_with_its_value_and_keeps_the_other_wait(server):
    master, torch_client = server
    with StoreClient("127.0.0.1", master.port, 5.0) as client:
        assert client.wait_any(["bell", "news"], 0.2, fetch=["news"]) == {}
        torch_client.set("news", b"hello")
        assert client.wait_any(["bell", "news"], 5.0, fetch=["news"]) == {"news": b"hello"}
        torch_client.set("bell", b"")
        assert client.wait_any(["bell", "later"], 5.0, fetch=["later"]) == {"bell": None}
        assert client.set("k", b"v") is None and client.get("k") == b"v"  # the main connection stayed free


@pytest.mark.fast
def test_the_wait_for_a_fetched_keys_successor_goes_out_with_the_read(server):
    master, torch_client = server
    with StoreClient("127.0.0.1", master.port, 5.0) as client:
        torch_client.set("news/1", b"first")
        assert client.wait_any(["bell", "news/1"], 5.0, fetch=["news/1"], then={"news/1": "news/2"}) == {
            "news/1": b"first"}
        torch_client.set("news/2", b"second")
        news_connection = client._waiters[1].client._sock
        assert select.select([news_connection], [], [], 5.0)[0]  # its WAIT for news/2 was out already: it answered
        assert client.wait_any(["bell", "news/2"], 5.0, fetch=["news/2"]) == {"news/2": b"second"}
        torch_client.set("bell", b"")
        assert client.wait_any(["bell", "news/3"], 5.0, fetch=["news/3"]) == {"bell": None}  # another key: re-armed


@pytest.mark.fast
@pytest.mark.parametrize("ending", ["close", "interrupt", "failed call"])
def test_the_waits_armed_when_a_client_ends_are_withdrawn_before_their_connections_close(server, ending):
    """A WAIT left armed on a closed connection is answered into it once its key is set, and torch logs that as
    a failed write (EPIPE): a mailbox reader stopped at an agent's end did so. Closing the client, interrupting
    its wait from another thread, or a call of its that fails (which closes it) withdraws each armed WAIT
    (CANCEL_WAIT) before it closes."""
    master, torch_client = server
    relay = _Relay(master.port)
    try:
        # a call's own timeout (1 ns) passes before its answer can come: it fails, and its client closes
        client = StoreClient("127.0.0.1", relay.port, 1e-9 if ending == "failed call" else PATIENT,
                             connect_timeout=PATIENT)
        assert client.wait_any(["bell", "news"], 0.2) == {}  # both WAITs stay armed on their connections
        if ending == "close":
            client.close()
        elif ending == "failed call":
            with pytest.raises(StoreTimeout):
                client.check(["bell"])
        else:
            outcome: list[str] = []
            waiting = threading.Thread(target=lambda: outcome.append(_ended_by(client)))
            waiting.start()
            client.interrupt()  # before that wait or during it: either way it ends, interrupted
            waiting.join(PATIENT)
            assert outcome == ["interrupted"]
        assert len(relay.sent) == 3 and all(ended.wait(PATIENT) for ended in relay.ended)
        main, *waits = relay.sent
        assert not main.endswith(bytes([Query.CANCEL_WAIT]))
        for sent in waits:  # the handshake, the WAIT for its key (which ends the stream without the fix), then
            assert sent.endswith(bytes([Query.CANCEL_WAIT])), sent  # the withdrawal
        torch_client.set("bell", b"")  # nobody waits for it now
        assert torch_client.get("bell") == b""
    finally:
        relay.close()


@pytest.mark.fast
def test_an_interrupted_wait_on_the_main_connection_withdraws_its_wait(server):
    """A mailbox reader waits for its bell on its main connection, and its agent interrupts that wait at stop:
    the WAIT is withdrawn before the connection closes (if it went out at all), and the wait ends, interrupted."""
    master, torch_client = server
    relay = _Relay(master.port)
    try:
        client = StoreClient("127.0.0.1", relay.port, PATIENT)
        outcome: list[str] = []
        waiting = threading.Thread(target=lambda: outcome.append(_wait_ended_by(client)))
        waiting.start()
        client.interrupt()  # before that wait or during it
        waiting.join(PATIENT)
        assert outcome == ["interrupted"]
        assert relay.ended[0].wait(PATIENT)  # the connection was closed, interrupted
        (main,) = relay.sent
        wait = bytes([Query.WAIT]) + (1).to_bytes(8, "little") + (5).to_bytes(8, "little") + b"/bell"
        assert main.endswith(wait + bytes([Query.CANCEL_WAIT])) or wait not in main, main
        with pytest.raises(StoreError, match="interrupted"):
            client.check(["bell"])
    finally:
        relay.close()


@pytest.mark.fast
def test_an_interrupt_lets_an_answer_on_its_way_arrive_and_ends_the_calls_after_it(monkeypatch):
    """A mailbox reader interrupted while its read's answers were on their way shut its connection down under
    them; the store's writes of them then failed, and torch logged each ("Write to client failed", EPIPE). Now
    the call reads its answer (WITHDRAW_TIMEOUT s at most, long here) and returns it, the connection stays open
    until the client is closed, and only the calls after the interrupt fail."""
    monkeypatch.setattr(wire, "WITHDRAW_TIMEOUT", PATIENT)
    with _listener() as listening:
        answers: list[bool] = []
        connecting = threading.Thread(target=lambda: answers.append(
            StoreClient("127.0.0.1", listening.getsockname()[1], PATIENT)))
        connecting.start()
        conn, _ = listening.accept()
        with conn:
            handshake = _received(conn, 10)  # VALIDATE, the magic number, PING, a nonce: answered with the nonce
            conn.sendall(handshake[6:])
            connecting.join(PATIENT)
            (client,) = answers
            answers.clear()
            asking = threading.Thread(target=lambda: answers.append(client.check(["k"])))
            asking.start()
            check = bytes([Query.CHECK]) + (1).to_bytes(8, "little") + (2).to_bytes(8, "little") + b"/k"
            assert _received(conn, len(check)) == check
            client.interrupt()  # the answer is not sent yet
            conn.sendall(bytes([wire.CHECK_READY]))
            asking.join(PATIENT)
            assert answers == [True]
            conn.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing sent, not closed: the client reads on
                conn.recv(1)
            with pytest.raises(StoreError, match="interrupted"):
                client.check(["k"])
            client.close()
            conn.setblocking(True)
            assert conn.recv(1) == b""


def _received(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        assert chunk, data
        data += chunk
    return data


def _wait_ended_by(client: StoreClient) -> str:
    try:
        client.wait(["bell"], PATIENT)
    except StoreError as exc:
        return str(exc)
    return "returned"


def _ended_by(client: StoreClient) -> str:
    try:
        client.wait_any(["bell", "news"], PATIENT)
    except StoreError as exc:
        return str(exc)
    return "returned"


@pytest.mark.fast
def test_waits_and_calls_work_with_descriptors_past_selects_limit(server):
    master, torch_client = server
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        if hard != resource.RLIM_INFINITY and hard < 1200:
            pytest.skip(f"this process may open {hard} descriptors at most")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200 if hard == resource.RLIM_INFINITY else min(hard, 4096), hard))
    filler = [socket.socket() for _ in range(1100)]  # the connections below get descriptors past 1,023
    try:
        with StoreClient("127.0.0.1", master.port, 5.0) as client:
            assert client._sock.fileno() > 1023
            torch_client.set("news", b"hello")
            assert client.wait_any(["bell", "news"], 5.0, fetch=["news"]) == {"news": b"hello"}
            assert client.get("news") == b"hello" and client.read_many(["news", "none"]) == [b"hello", None]
    finally:
        for sock in filler:
            sock.close()


@pytest.mark.fast
def test_a_read_does_not_wake_a_wait_for_the_key_it_reads(server):
    master, _ = server
    with StoreClient("127.0.0.1", master.port, 5.0) as waiting, StoreClient("127.0.0.1", master.port, 5.0) as reader:
        assert waiting.wait_any(["next"], 0.1) == {}  # its wait for "next" stays armed
        assert reader.read_many(["next"]) == [None]
        assert waiting.wait_any(["next"], 0.3) == {}  # still nothing: it was not woken
