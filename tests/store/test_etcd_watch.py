"""The watches :meth:`EtcdKeyValue.wait_any` keeps open: which range a wait watches, what a client knows of a
key and from when, and the events read off a watch stream (pure), then against a real etcd member: a sender's
next broadcast comes in its watch's event with no request, and a watch whose member went away is opened again."""

from __future__ import annotations

import base64
import http.server
import json
import threading

import pytest

from etcd_members import Cluster
from http_answers import answering
from runs import until
from ftrun.store.etcd import EtcdKeyValue
from ftrun.store.etcd_config import EtcdOptions, parse_endpoints
from ftrun.store import etcd_http
from ftrun.store.etcd_watch import KeyRange, Known, OpenWatch, parse_events, range_for


def client(cluster: Cluster, run_id: str) -> EtcdKeyValue:
    return EtcdKeyValue(EtcdOptions(parse_endpoints(cluster.endpoints), run_id), 5.0)


def counting(kv: EtcdKeyValue) -> list[str]:
    """The paths of every call ``kv`` makes from now on (reads, writes; not a watch's stream)."""
    calls: list[str] = []
    call = kv._cluster.call
    kv._cluster.call = lambda path, body: (calls.append(path), call(path, body))[1]  # type: ignore[method-assign]
    return calls


@pytest.mark.fast
@pytest.mark.parametrize("key, successor, watched", [
    ("ftrun/mail/all/node0/7", "ftrun/mail/all/node0/8", KeyRange("ftrun/mail/all/node0/", prefix=True)),
    ("ftrun/bell/node3", None, KeyRange("ftrun/bell/node3")),  # every node's bells share a parent: not watched
    ("ftrun/mail/all/node0/7", "ftrun/mail/all/node1/1", KeyRange("ftrun/mail/all/node0/7")),
    ("ftrun/mail/all/node0/7", "ftrun/mail/all/node0/8/x", KeyRange("ftrun/mail/all/node0/7")),
    ("bell", "news", KeyRange("bell")),
])
def test_a_wait_watches_the_parent_its_key_shares_with_its_successor_else_the_key(key, successor, watched):
    assert range_for(key, successor) == watched
    assert watched.covers(key) and not KeyRange("a/b").covers("a/bc") and KeyRange("a/", True).covers("a/bc")


@pytest.mark.fast
def test_what_is_known_of_a_key_is_its_latest_revision_and_a_listing_makes_the_rest_absent():
    known = Known()
    known.note("k", b"v2", 7)
    known.note("k", b"v1", 5)  # an older read, arriving later, changes nothing
    assert "k" in known and known.value("k") == b"v2" and "other" not in known
    known.note("k", None, 9)  # deleted
    assert "k" in known and known.value("k") is None

    listed = Known(listed=["present"], limit=4)
    assert "absent" in listed and listed.value("absent") is None  # not listed: absent until an event says
    assert "present" not in listed  # listed, value never read: unknown
    for revision, key in enumerate("abcde", start=1):
        listed.note(key, key.encode(), revision)
    # past the limit the oldest half is forgotten: unknown again, never taken for absent
    assert "a" not in listed and "b" not in listed and listed.value("e") == b"e"


@pytest.mark.fast
def test_a_watch_streams_lines_are_read_as_events_and_anything_else_ends_it():
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    line = json.dumps({"result": {"header": {"revision": "12"}, "events": [
        {"kv": {"key": b64("/ftrun/j/k"), "value": b64("v"), "mod_revision": "11"}},
        {"type": "DELETE", "kv": {"key": b64("/ftrun/j/gone"), "mod_revision": "12"}},
        {"kv": {"key": b64("/ftrun/other/k"), "value": b64("x"), "mod_revision": "12"}},
    ]}}).encode()
    assert parse_events(line, b"/ftrun/j/") == ([("k", b"v", 11), ("gone", None, 12)], False)
    assert parse_events(b'{"result": {"created": true}}', b"/ftrun/j/") == ([], False)
    assert parse_events(b'{"result": {"canceled": true, "compact_revision": "3"}}', b"/") == ([], True)
    assert parse_events(b'{"error": {"grpc_code": 14, "message": "etcdserver: no leader"}}', b"/") == ([], True)
    for junk in [b"<html>", b"[1]", b'{"error": "x"}', b'{"result": {"events": [{"kv": 1}]}}']:
        with pytest.raises(ValueError):
            parse_events(junk, b"/")


def event_line(key: str, value: str, revision: int) -> bytes:
    """One line of a watch stream, as etcd's gateway sends it: an event setting ``key`` to ``value``."""
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return json.dumps({"result": {"events": [{"kv": {"key": b64(key), "value": b64(value),
                                                     "mod_revision": str(revision)}}]}}).encode() + b"\n"


@pytest.mark.fast
@pytest.mark.parametrize("chunking", ["split", "joined", "endless"])
def test_a_watch_reads_lines_across_and_within_chunks_and_ends_at_a_line_with_no_end(chunking, monkeypatch):
    """A real HTTP server streams a watch's answers in chunks that cut a line in two, or carry two lines and a
    blank one: each event is noted as its line completes. A line that never ends (past MAX_LINE) ends the
    watch instead of growing without bound."""
    first, second = event_line("/ftrun/j/a", "1", 5), event_line("/ftrun/j/b", "2", 6)
    chunks = {"split": [first[:7], first[7:] + second[:3], second[3:]], "joined": [first + b"\n" + second],
              "endless": [b'{"result": ' + b"x" * 40] * 5}[chunking]
    monkeypatch.setattr(etcd_http, "MAX_LINE", 150)
    sent = threading.Event()

    def stream(handler: http.server.BaseHTTPRequestHandler, _body: bytes) -> None:
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        for chunk in chunks:
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            handler.wfile.flush()
        sent.wait(10)  # the stream stays open, as a watch's does

    changed = threading.Condition()
    with answering(stream) as port:
        watch = OpenWatch(etcd_http.Member("127.0.0.1", port, None, 5.0), KeyRange("", prefix=True), 5,
                          b"/ftrun/j/", changed)
        try:
            with changed:
                if chunking == "endless":
                    assert changed.wait_for(lambda: watch.ended, timeout=10)
                    assert watch.known.value("a") is None
                else:
                    assert changed.wait_for(lambda: watch.known.value("b") is not None, timeout=10)
                    assert (watch.known.value("a"), watch.known.value("b"), watch.ended) == (b"1", b"2", False)
        finally:
            sent.set()
            watch.close()


def test_a_senders_next_broadcast_comes_in_its_watchs_event_with_no_request(etcd_cluster):
    reader, sender = client(etcd_cluster, "watch"), client(etcd_cluster, "watch")
    sender.set("all/s/1", b"one")
    assert reader.wait_any(["bell", "all/s/1"], 5, ["all/s/1"], {"all/s/1": "all/s/2"}) == {"all/s/1": b"one"}
    assert reader.wait_any(["bell", "all/s/2"], 0.2, ["all/s/2"], {"all/s/2": "all/s/3"}) == {}  # opens them
    calls = counting(reader)
    for index in range(2, 6):
        sent = threading.Timer(0.05, sender.set, (f"all/s/{index}", f"m{index}"))
        sent.start()
        came = reader.wait_any(["bell", f"all/s/{index}"], 10, [f"all/s/{index}"],
                               {f"all/s/{index}": f"all/s/{index + 1}"})
        sent.join()
        assert came == {f"all/s/{index}": f"m{index}".encode()}
    assert calls == []  # each value came with its event: no read, no new watch
    sender.set("bell", b"")
    assert reader.wait_any(["bell", "all/s/6"], 10, ["all/s/6"], {"all/s/6": "all/s/7"}) == {"bell": b""}
    reader.read_many([], deleting=["bell"])  # the reader's own delete is known at once: not news
    assert reader.wait_any(["bell", "all/s/6"], 0.2, ["all/s/6"], {"all/s/6": "all/s/7"}) == {}
    assert calls == ["kv/txn"]
    reader.close()


class CountingCondition(threading.Condition):
    """A condition that counts its ``notify_all`` calls."""

    notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def test_a_watch_wakes_its_waiters_for_a_key_set_and_not_for_a_delete(etcd_cluster):
    # each reader deletes its own bell after it rang, and a sender its oldest broadcast: no wait ends there
    kv = client(etcd_cluster, "deletes")
    changed = CountingCondition()
    member = etcd_http.Member(*parse_endpoints(etcd_cluster.endpoints)[0], None, 5.0)
    watch = OpenWatch(member, KeyRange("w/", prefix=True), kv._range("w/a")[2] + 1, kv.options.prefix.encode(),
                      changed)
    try:
        kv.set("w/a", b"1")
        with changed:
            assert changed.wait_for(lambda: watch.known.value("w/a") == b"1", timeout=10)
        kv.delete_key("w/a")

        def deleted() -> bool:
            with changed:
                return watch.known.value("w/a") is None

        until(deleted, what="the watch noting the delete")
        assert changed.notified == 1
    finally:
        watch.close()


def test_a_watched_read_costs_one_read_per_key_then_none_and_sees_a_lease_end(etcd_cluster):
    # a follower's looks at its leader's lease: the watch answers them, and etcd's delete at the lease's end
    # reaches it with no request
    reader, holder = client(etcd_cluster, "leases"), client(etcd_cluster, "leases")
    holder.set_leased("lease/0", b"held", holder.grant_lease(2))  # etcd's shortest TTL; never kept alive
    calls = counting(reader)
    assert reader.read_watched(["lease/0", "lease/9"]) == [b"held", None]
    assert calls == ["kv/range", "kv/range"]  # plain ranges at one revision: no transaction of reads only
    until(lambda: reader.read_watched(["lease/0", "lease/9"]) == [None, None], timeout=30)
    holder.set("lease/9", b"set")
    until(lambda: reader.read_watched(["lease/0", "lease/9"]) == [None, b"set"], timeout=30)
    assert calls == ["kv/range", "kv/range"]
    reader.close()


def test_no_read_goes_as_a_transaction_of_reads_only(etcd_cluster):
    # etcd 3.5.0-3.5.4 panics when the client of a read-only transaction goes away before its answer
    # (etcd-io/etcd#14110): a SIGKILLed agent's would, and the member it talked to would be gone. Every read
    # path posts plain ranges, or a transaction with a write in it
    reader, writer = client(etcd_cluster, "reads"), client(etcd_cluster, "reads")
    writer.set_many([("a", b"1"), ("b", b"2")])
    bodies: list[tuple[str, dict]] = []
    call = reader._cluster.call
    reader._cluster.call = lambda path, body: (bodies.append((path, body)), call(path, body))[1]  # type: ignore[method-assign]
    assert reader.read_many(["a", "b", "c"]) == [b"1", b"2", None]
    assert reader.read_many(["a"], deleting=["b"]) == [b"1"]
    assert reader.read_watched(["a", "c"]) == [b"1", None]
    assert reader.wait_any(["c", "a"], 5) == {"a": b"1"}
    assert reader.get("a") == b"1"
    assert len(bodies) >= 5
    for path, body in bodies:
        if path == "kv/txn":
            ops = [op for branch in ("success", "failure") for op in body.get(branch, [])]
            assert any("request_range" not in op for op in ops), body
    reader.close()
    writer.close()


def test_a_watch_whose_member_went_away_is_opened_again_with_a_fresh_read(tmp_path):
    cluster = Cluster(tmp_path, size=1)
    try:
        reader, sender = client(cluster, "j"), client(cluster, "j")
        assert reader.wait_any(["bell", "news"], 0.2, ["news"]) == {}  # its watches are open
        cluster.members[0].kill()
        cluster.restart(0)
        sender.set("news", b"after")
        assert reader.wait_any(["bell", "news"], 30, ["news"]) == {"news": b"after"}
        reader.close()
    finally:
        cluster.stop()
