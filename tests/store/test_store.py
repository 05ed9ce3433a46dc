"""The store package over a real TCPStore: sealed records, mailboxes, leases, plans; reaching a running job."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from ftrun import registry
from ftrun.agent.failover import Election, elect, stands_at_once
from ftrun.errors import NoSuchJob, UsageError
from ftrun.protocol import Plan
from ftrun.store import keys
from ftrun.store.auth import Seal, new_secret
from ftrun.store.client import STORE_START_WAIT, connect, open_client, parse_endpoint
from ftrun.store.job import JobStore, MalformedValue
from ftrun.store import leases as lease_module
from ftrun.store.leases import (FENCE_FRACTION, KEEPALIVES_PER_TTL, LEADER_LOOKS_PER_TIMEOUT, RENEWALS_PER_TIMEOUT,
                                 RETRY_AFTER, START_GRACE, LeaseKeeper, NodeLeases, first_renewal_delay,
                                 next_renewal, renewal_interval, retry_at, watch_leader_lease)
from ftrun.store.mailbox import IDLE_WAIT, MailReader, Outbox, idle_wait
from ftrun.store.wire import StoreClient
from runs import until

SECRET = new_secret()


@pytest.fixture(params=["tcpstore", "etcd"])
def served(request):
    """A store for one job: a TCPStore served in this process, or a run id of its own on a real etcd member;
    returns a function making client JobStores on it (with SECRET, or the secret given; ``wire``: torch-free
    TCPStore client)."""
    if request.param == "etcd":
        from ftrun.store.etcd import EtcdKeyValue
        from ftrun.store.etcd_config import EtcdOptions, parse_endpoints

        cluster, run_id = request.getfixturevalue("etcd_cluster"), new_secret()[:16]
        return lambda secret=SECRET, wire=False: JobStore(
            EtcdKeyValue(EtcdOptions(parse_endpoints(cluster.endpoints), run_id), 30), Seal(secret))

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))

    def client(secret: str = SECRET, wire: bool = False) -> JobStore:
        kv = StoreClient("127.0.0.1", server.port, 30) if wire else open_client("127.0.0.1", server.port, 30)
        return JobStore(kv, Seal(secret))

    return client


@pytest.mark.fast
def test_records_round_trip_and_a_missing_record_is_none(served):
    store = served()
    assert store.read_job(0.0) is None and store.read_job_status() is None and store.read_node_status(1) is None
    store.write_job({"run_id": "r", "nnodes": 2})
    store.write_job_status({"generation": 3})
    store.write_status(1, {"workers": []})
    other = served()
    assert other.read_job(1.0) == {"run_id": "r", "nnodes": 2}
    assert other.read_job_status(1.0) == {"generation": 3} and other.read_node_status(1) == {"workers": []}


@pytest.mark.fast
@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b"\xff\xfe", b"42", b'{"run_id": "r"}', b"", b"0" * 64])
def test_a_value_ftrun_did_not_write_is_refused_not_crashed_on(served, raw):
    store = served()
    store.kv.set(keys.JOB, raw)
    with pytest.raises(MalformedValue):
        store.read_job(1.0)


@pytest.mark.fast
@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000])
def test_a_sealed_value_that_is_not_a_json_object_is_refused(served, payload):
    store = served()
    store.kv.set(keys.JOB, store.seal.seal(keys.JOB, payload))
    with pytest.raises(MalformedValue, match="not"):
        store.read_job(1.0)


@pytest.mark.fast
def test_a_value_sealed_with_another_secret_or_for_another_key_is_refused(served):
    store, stranger = served(), served(new_secret())
    stranger.write_job({"run_id": "forged"})
    with pytest.raises(MalformedValue, match="not signed with this run's secret"):
        store.read_job(1.0)
    store.write_status(1, {"workers": []})
    store.kv.set(keys.status_node(2), store.kv.get(keys.status_node(1)))  # node 1's record, copied to node 2
    assert store.read_node_status(1) == {"workers": []}
    with pytest.raises(MalformedValue):
        store.read_node_status(2)


@pytest.fixture
def reading(served, monkeypatch):
    """Start a MailReader on box node3, reading commands and what node1 sends (grace: 0.2 s); returns a function
    that waits for ``n`` messages and returns them, and the reader."""
    from ftrun.store import mailbox

    monkeypatch.setattr(mailbox, "OVERWRITE_GRACE", 0.2)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    reader = MailReader(lambda: served(wire=True), "node3", wake_w,
                        lambda m: None if m.get("t") != "bad" else "a bad kind", ("node1",))

    def receive(n: int) -> list[dict]:
        received: list[dict] = []
        while len(received) < n:
            assert select.select([wake_r], [], [], 10)[0], "no wake-up within 10 s"
            os.read(wake_r, 64)
            received += reader.take()
        return received

    reader.start()
    yield receive, reader
    reader.stop()
    os.close(wake_r)
    os.close(wake_w)


@pytest.mark.fast
def test_the_mail_reader_hands_on_commands_in_order_and_drops_what_is_not_a_valid_message(served, reading):
    receive, reader = reading
    store, stranger = served(), served(new_secret())
    store.post("node3", {"t": "a"})
    index = store.kv.add(keys.mail_count("node3"), 1)  # a writer that is not ftrun's: takes an index, writes junk
    store.kv.set(keys.mail_item("node3", index), b"{broken")
    stranger.post("node3", {"t": "forged"})  # signed with another run's secret
    store.post("node3", {"t": "bad"})  # sealed, but the validator refuses it
    store.post("node3", {"t": "b"})
    assert receive(2) == [{"t": "a"}, {"t": "b"}]
    assert reader.dropped == 3 and "a bad kind" in reader.last_dropped
    assert not store.kv.check([keys.mail_item("node3", i) for i in range(1, 6)])  # read ones are deleted


@pytest.fixture
def broadcast_readers(served, monkeypatch):
    """Readers of boxes node3 and node4 that read node1's mail and broadcasts (grace 0.2 s, two broadcasts
    kept); returns a function that waits for ``n`` messages of one reader and returns them, and the readers."""
    from ftrun.store import mailbox

    monkeypatch.setattr(mailbox, "OVERWRITE_GRACE", 0.2)
    monkeypatch.setattr(mailbox, "KEPT_BROADCASTS", 2)
    pipes = [os.pipe() for _ in range(2)]
    readers = [MailReader(lambda: served(wire=True), box, wake_w, senders=("node1",), broadcasts=("node1",))
               for box, (_, wake_w) in zip(["node3", "node4"], pipes)]

    def receive(which: int, n: int) -> list[dict]:
        received: list[dict] = []
        while len(received) < n:
            assert select.select([pipes[which][0]], [], [], 10)[0], "no wake-up within 10 s"
            os.read(pipes[which][0], 64)
            received += readers[which].take()
        return received

    for reader in readers:
        reader.start()
    yield receive, readers
    for reader in readers:
        reader.stop()
    for fds in pipes:
        for fd in fds:
            os.close(fd)


@pytest.mark.fast
def test_a_broadcast_is_written_once_for_every_reader_and_the_sender_deletes_old_ones(served, broadcast_readers):
    receive, _ = broadcast_readers
    store = served()
    outbox = Outbox(store, "node1")

    def kept() -> list[bool]:
        return [store.kv.check([keys.sent_item(keys.BROADCAST, "node1", i)]) for i in (1, 2, 3, 4, 5)]

    for gen in range(5):
        outbox.broadcast({"t": "plan", "gen": gen})
        assert receive(0, 1) == receive(1, 1) == [{"t": "plan", "gen": gen}]
        if gen == 2:
            assert kept() == [True, True, True, False, False]  # the readers leave them
    # every KEPT_BROADCASTS broadcasts, the sender deletes those KEPT_BROADCASTS back, together
    assert kept() == [False, False, True, True, True]
    assert not store.kv.check([keys.bell("node3")]) and not store.kv.check([keys.bell(keys.BROADCAST)])


@pytest.mark.fast
def test_a_reader_that_starts_late_skips_the_deleted_broadcasts_and_reads_the_kept_ones(served, monkeypatch):
    from ftrun.store import mailbox

    monkeypatch.setattr(mailbox, "KEPT_BROADCASTS", 2)
    store = served()
    outbox = Outbox(store, "node1")
    for gen in range(5):  # 1 to 3 are deleted by the time the reader starts
        outbox.broadcast({"t": "plan", "gen": gen})
    wake_r, wake_w = os.pipe()
    reader = MailReader(lambda: served(wire=True), "node6", wake_w, broadcasts=("node1",))
    reader.start()
    try:
        received: list[dict] = []
        while len(received) < 2:
            assert select.select([wake_r], [], [], 10)[0], "no wake-up within 10 s"
            os.read(wake_r, 64)
            received += reader.take()
        outbox.broadcast({"t": "plan", "gen": 5})
        while len(received) < 3:
            assert select.select([wake_r], [], [], 10)[0], "no wake-up within 10 s"
            os.read(wake_r, 64)
            received += reader.take()
        assert [m["gen"] for m in received] == [3, 4, 5]
    finally:
        reader.stop()
        os.close(wake_r)
        os.close(wake_w)


@pytest.mark.fast
def test_a_message_sent_after_a_broadcast_is_handed_on_after_it(served, broadcast_readers):
    """A message to the box that names a broadcast not read yet waits for it: the box's message can be seen
    first (it is written after, but a look may read it before the broadcast's wait answers)."""
    receive, readers = broadcast_readers
    store = served()
    store.send_many("node1", [("node3", 1, {"t": "after it", "_after": 1})])  # as if it overtook broadcast 1
    assert select.select([], [], [], 0.1) == ([], [], [])
    assert readers[0].take() == []
    Outbox(store, "node1").broadcast({"t": "plan"})
    assert [m["t"] for m in receive(0, 2)] == ["plan", "after it"]
    assert [m["t"] for m in receive(1, 1)] == ["plan"]


@pytest.mark.fast
def test_a_message_whose_broadcast_never_comes_is_handed_on_after_the_grace(served, broadcast_readers):
    receive, _ = broadcast_readers
    served().send_many("node1", [("node3", 1, {"t": "orphan", "_after": 1})])  # broadcast 1's write failed
    assert [m["t"] for m in receive(0, 1)] == ["orphan"]


@pytest.mark.fast
def test_the_outbox_numbers_the_broadcasts_before_each_message(served):
    store = served()
    outbox = Outbox(store, "node1")
    outbox.send("node3", {"t": "before"})
    outbox.broadcast({"t": "plan"})
    outbox.send("node3", {"t": "after"})
    read = [store.read_mail(keys.sent_item("node3", "node1", i)) for i in (1, 2)]
    assert read == [{"t": "before"}, {"t": "after", "_after": 1}]
    assert store.read_mail(keys.sent_item(keys.BROADCAST, "node1", 1)) == {"t": "plan"}


@pytest.mark.fast
def test_stop_ends_a_reader_blocked_on_its_bell_at_once(served):
    """The reader waits on its bell for up to IDLE_WAIT (20 s); stop() interrupts that wait rather than
    joining for STOP_WAIT (5 s) and leaving the thread behind."""
    wake_r, wake_w = os.pipe()
    reader = MailReader(lambda: served(wire=True), "node5", wake_w)
    reader.start()
    until(lambda: reader._store is not None)
    reader.stop()
    assert not reader._thread.is_alive()
    os.close(wake_r)
    os.close(wake_w)


@pytest.mark.fast
def test_junk_written_ahead_of_an_agent_does_not_cost_its_messages(served, reading):
    """Junk at the index an agent will send next is not read as its message and does not move the reader on:
    the agent's message replaces it and is handed on. A message sealed for another index is junk too."""
    receive, reader = reading
    store = served()
    outbox = Outbox(store, "node1")
    store.kv.set(keys.sent_item("node3", "node1", 1), b"junk written first")
    replay = store.seal.seal(keys.sent_item("node3", "node1", 1), b'{"t": "moved"}')
    store.kv.set(keys.sent_item("node3", "node1", 2), replay)
    store.ring("node3")  # whoever writes junk can ring too: the reader looks, and drops it
    until(lambda: reader.dropped == 1)
    assert select.select([], [], [], 0.5) == ([], [], [])  # well past the grace: no valid message behind it
    outbox.send("node3", {"t": "first"})
    assert receive(1) == [{"t": "first"}]
    until(lambda: reader.dropped == 2)
    outbox.send("node3", {"t": "second"})
    assert receive(1) == [{"t": "second"}] and reader.dropped == 2


@pytest.mark.fast
def test_an_index_never_written_is_given_up_once_a_later_message_waits(served, reading):
    receive, reader = reading
    store = served()
    outbox = Outbox(store, "node1")
    outbox.sent["node3"] = 1  # message 1 was numbered, and its write failed
    outbox.send("node3", {"t": "after a lost one"})
    index = store.kv.add(keys.mail_count("node3"), 1)  # a client that took an index and died
    store.post("node3", {"t": "a command after it"})
    assert sorted(m["t"] for m in receive(2)) == ["a command after it", "after a lost one"]
    assert reader.dropped == 0 and index == 1


@pytest.mark.fast
def test_a_message_replayed_at_a_later_index_is_refused(served, reading):
    receive, reader = reading
    store = served()
    store.post("node3", {"t": "stop", "reason": "once"})
    assert receive(1) == [{"t": "stop", "reason": "once"}]
    index = store.kv.add(keys.mail_count("node3"), 1)
    sealed = store.seal.seal(keys.mail_item("node3", 1), b'{"t": "stop", "reason": "once"}')
    store.kv.set(keys.mail_item("node3", index), sealed)  # the same bytes, at index 2
    store.post("node3", {"t": "after"})
    assert receive(1) == [{"t": "after"}] and reader.dropped == 1  # index 2 given up once its grace passed


@pytest.mark.fast
def test_junk_in_a_mailbox_counter_stops_no_agent_message(served, reading):
    """The counter is the clients' only: a value there that is no number makes the store refuse their
    commands (a denial the seal cannot prevent), but agents number their own messages."""
    receive, _ = reading
    store, client = served(), served()
    store.kv.set(keys.mail_count("node3"), b"not a number")
    Outbox(store, "node1").send("node3", {"t": "still here"})
    assert receive(1) == [{"t": "still here"}]
    with pytest.raises(RuntimeError):
        client.post("node3", {"cmd": "ping"})
    with pytest.raises(UsageError, match="^the job's store did not take the command"):  # one line for inject
        served().request("node3", {"cmd": "ping"})


@pytest.mark.fast
def test_a_mailbox_counter_set_far_ahead_gives_up_the_indices_below_it_at_once(served, reading):
    """Anyone may set the counter: one set a billion ahead is given up in a bounded number of looks (one per
    index kept the reader and the store busy for ever), and the next command is read."""
    receive, reader = reading
    store = served()
    store.post("node3", {"t": "before"})
    assert receive(1) == [{"t": "before"}]
    store.kv.set(keys.mail_count("node3"), b"1000000000")
    store.post("node3", {"t": "after"})  # index 1,000,000,001
    assert receive(1) == [{"t": "after"}] and reader.dropped == 0


@pytest.mark.fast
def test_a_reader_takes_a_new_leaders_messages_once_told_to_and_no_more_of_the_old_ones(served, reading):
    receive, reader = reading
    store = served()
    old, new = Outbox(store, "node1"), Outbox(store, "node2")
    new.send("node3", {"t": "from node 2, elected"})  # written before the election is known here
    old.send("node3", {"t": "from node 1"})
    assert receive(1) == [{"t": "from node 1"}]
    reader.add_sender("node2", store)
    assert receive(1) == [{"t": "from node 2, elected"}]
    reader.drop_sender("node1")  # the leader replaced: should it come back, its word is not read
    old.send("node3", {"t": "stale"})
    new.send("node3", {"t": "current"})
    assert receive(1) == [{"t": "current"}]


@pytest.mark.fast
def test_a_command_without_an_answer_is_one_clear_error(served):
    store = served()
    with pytest.raises(UsageError, match="did not answer within 1 s"):
        store.request("node0", {"cmd": "ping"}, timeout=1.0)
    posted = store.read_mail(keys.mail_item("node0", 1))
    store.reply(posted, {"ok": True})  # answered late: the reply key is written, the asker is gone
    assert store.kv.check([keys.reply(posted["reply_to"])])
    store.reply({"reply_to": 7}, {"ok": True})  # not a token ftrun wrote: nothing happens


@pytest.mark.fast
def test_a_forged_answer_is_not_taken_for_the_jobs(served):
    import threading

    store, watcher, stranger = served(), served(), served(new_secret())

    def forge() -> None:  # answers as soon as the command is posted, with another secret
        watcher.kv.wait([keys.mail_item("node0", 1)], timedelta(seconds=10))
        stranger.reply(watcher.read_mail(keys.mail_item("node0", 1)), {"ok": True, "forged": True})

    thread = threading.Thread(target=forge)
    thread.start()
    with pytest.raises(UsageError, match="not understood .*not signed with this run's secret"):
        store.request("node0", {"cmd": "ping"}, timeout=10.0)
    thread.join()


@pytest.mark.fast
def test_the_leaders_wait_for_the_nodes_it_told_ends_once_each_said_it_is_ending(served):
    leader = served()
    waiting = threading.Thread(target=leader.await_ended, args=([1, 2], 60.0))
    waiting.start()
    served().say_ended(1)
    assert waiting.is_alive()  # node 2 has not said it yet
    served().say_ended(2)
    until(lambda: not waiting.is_alive())  # long before its 60 s
    leader.await_ended([3], 0.2)  # a node that never says so costs the timeout, not an error


@pytest.mark.fast
@pytest.mark.parametrize("served", ["tcpstore"], indirect=True)
def test_leases_expire_by_the_clock_given_and_an_evicted_node_learns_it(served):
    store = served()
    assert not store.native_leases
    leases = NodeLeases(store, [1, 2], timeout=10.0, now=0.0)
    assert leases.expired(0.0) == []
    store.renew_lease(1, 1)
    assert leases.expired(START_GRACE - 5) == []  # both within the start grace; node 1 seen renewing
    lost = leases.expired(START_GRACE + 1)
    assert lost == [(2, START_GRACE + 1 - (START_GRACE - 10))]
    assert store.is_evicted(2) and not store.is_evicted(1)
    assert [node for node, _ in leases.expired(START_GRACE + 16)] == [1]  # no renewal since -5


@pytest.mark.fast
@pytest.mark.parametrize("served", ["tcpstore"], indirect=True)
def test_a_node_heard_from_before_its_first_renewal_is_held_to_the_timeout_not_the_start_grace(served):
    store = served()
    leases = NodeLeases(store, [1, 2], timeout=10.0, now=0.0)
    store.renew_lease(2, 1)
    assert leases.expired(0.0) == []
    leases.watch(1, 5.0)  # its workers started (it was cut off before it could renew)
    leases.watch(2, 5.0)  # renewed already: its clock is its renewals'
    leases.watch(3, 5.0)  # a node that joined the running job
    assert leases.expired(12.0) == [(2, 12.0)]  # watching it changed nothing
    assert leases.expired(16.0) == [(1, 11.0), (3, 11.0)]  # long before the start grace


@pytest.mark.parametrize("served", ["etcd"], indirect=True)
def test_an_etcd_lease_ends_on_etcds_clock_and_its_watcher_counts_the_node_lost_at_once(served):
    store = served()
    assert store.native_leases
    keeper = LeaseKeeper(served, 1, timeout=2.0, where="etcd")  # etcd's shortest TTL
    leases = NodeLeases(store, [1], timeout=2.0, now=0.0)
    keeper.start()
    until(lambda: keeper.renewals >= 2)  # taken, then kept alive
    assert leases.expired(0.0) == [] and leases.seen[1] == (1, 0.0)
    assert leases.expired(1.5) == [] and leases.seen[1] == (1, 1.5)  # its key there is its lease held
    keeper.stop()  # no keep-alive any more: etcd ends the lease after its TTL and deletes the key
    until(lambda: store.lease_renewals([1]) == {1: None})
    assert leases.expired(2.0) == [(1, 2.0)]  # lost at once (seen held 0.5 s ago, kept alive 2 s ago at most)
    assert store.is_evicted(1)
    assert not store.keep_lease(keeper.held)  # what a keeper cut off that long learns when it comes back
    assert keeper.fence_reason(keeper.renewed) is None
    keeper.lapsed = True
    assert "lease in etcd ended" in keeper.fence_reason(keeper.renewed)


@pytest.mark.fast
def test_a_followers_looks_at_its_leaders_lease_read_it_once_per_timeout_and_take_a_watchs_word_between(served):
    store = served()
    looked: list[bool] = []
    store.lease_renewals = lambda nodes, watched=False: looked.append(watched) or {0: len(looked)}  # renewing
    leases = watch_leader_lease(store, 0, timeout=10.0, now=0.0)
    for look in range(2 * LEADER_LOOKS_PER_TIMEOUT):
        assert leases.expired(look * 10.0 / LEADER_LOOKS_PER_TIMEOUT) == []
    reads = [index for index, watched in enumerate(looked) if not watched]
    assert len(looked) == 2 * LEADER_LOOKS_PER_TIMEOUT and reads == [0, LEADER_LOOKS_PER_TIMEOUT]


def test_one_node_wins_each_term_of_an_election_and_the_others_read_who(served):
    # four nodes stand for term 1 at once: each adds to the term's claim counter on a connection of its own
    candidates = [served() for _ in range(4)]
    barrier = threading.Barrier(len(candidates))

    def stand(store: JobStore) -> bool:
        barrier.wait()
        return store.stand_for_leader(1)

    with ThreadPoolExecutor(len(candidates)) as pool:
        won = list(pool.map(stand, candidates))
    assert won.count(True) == 1
    winner = won.index(True) + 1
    reader = served()
    assert reader.read_leader(1, 0.0) is None  # not said yet: none is taken for the leader
    candidates[winner - 1].announce_leader(1, winner, "10.0.0.7", 41234)
    assert reader.read_leader(1, 5.0) == (winner, "10.0.0.7", 41234)
    assert reader.stand_for_leader(2) and not candidates[0].stand_for_leader(2)  # the next term is a new one
    reader.kv.set(keys.leader_of(3), reader.seal.seal(keys.leader_of(3), b'{"node": "x"}'))
    assert reader.read_leader(3, 0.0) is None  # not a node, host and port: nobody


@pytest.mark.fast
@pytest.mark.parametrize("lost, nodes, first", [(0, 10, {1, 2, 3}), (8, 10, {9, 0, 1}), (0, 2, {1}), (3, 4, {0, 1, 2})])
def test_the_three_nodes_after_the_lost_leader_stand_at_once(lost, nodes, first):
    assert {node for node in range(nodes) if stands_at_once(node, lost, nodes)} == first


def test_a_node_that_does_not_stand_at_once_follows_the_first_candidates_word_or_stands_when_none_comes(served):
    stood = []
    late = served()
    standing = late.stand_for_leader
    late.stand_for_leader = lambda term: stood.append(term) or standing(term)
    first = elect(served(), 1, 1, 0, 8, lambda: ("10.0.0.1", 4001), 5.0)
    assert first == Election(1, 1, "10.0.0.1", 4001)
    assert elect(late, 1, 5, 0, 8, lambda: ("10.0.0.5", 4005), 5.0) == first and stood == []
    # term 2: none of the first candidates stands (lost with the leader): node 5 stands after its patience
    assert elect(late, 2, 5, 0, 8, lambda: ("10.0.0.5", 4005), 1.0) == Election(2, 5, "10.0.0.5", 4005)
    assert stood == [2]


@pytest.mark.fast
def test_a_forged_or_replayed_lease_renews_nothing_and_a_forged_eviction_evicts_nobody(served):
    store, stranger = served(), served(new_secret())
    leases = NodeLeases(store, [1], timeout=10.0, now=0.0)
    store.renew_lease(1, 1)
    old = store.kv.get(keys.lease(1))
    store.renew_lease(1, 2)
    assert leases.expired(0.0) == [] and leases.seen[1] == (2, 0.0)
    store.kv.set(keys.lease(1), old)  # renewal 1 again, at 5 s
    assert leases.expired(5.0) == [] and leases.seen[1] == (2, 0.0)
    stranger.renew_lease(1, 99)  # with another secret
    store.kv.add(keys.lease(2), 1)  # junk in another node's lease
    assert leases.expired(11.0) == [(1, 11.0)]
    stranger.evict(3)
    store.kv.set(keys.evicted(4), "1")
    assert not store.is_evicted(3) and not store.is_evicted(4)


@pytest.mark.parametrize("served", ["etcd"], indirect=True)
def test_a_leaders_look_at_a_few_nodes_etcd_leases_is_one_request_and_a_followers_at_its_leaders_reads_one_key(
        served):
    store, holder = served(), served()
    for node in (1, 2, 3):
        holder.take_lease(node, 1, 10.0)
    paths: list[tuple[str, dict]] = []
    call = store.kv._cluster.call
    store.kv._cluster.call = lambda path, body: (paths.append((path, body)), call(path, body))[1]
    assert store.lease_renewals([1, 2, 3, 4]) == {1: 1, 2: 1, 3: 1, 4: None}
    assert [path for path, _ in paths] == ["kv/range"]  # one range over every lease, not a read per node
    paths.clear()
    assert store.lease_renewals([2]) == {2: 1}
    assert len(paths) == 1 and "range_end" not in paths[0][1]  # its leader's key alone


@pytest.mark.parametrize("served", ["etcd"], indirect=True)
def test_an_etcd_lease_keeper_learns_its_eviction_from_its_next_keep_alive_without_looking_for_the_mark(
        served, monkeypatch):
    """The leader's eviction ends the node's etcd lease: the keeper's next keep-alive finds it ended and the
    node fences, with no look at the eviction mark (a store request per two renewals saved on every node)."""
    store = served()
    keeper = LeaseKeeper(served, 1, timeout=10.0, where="etcd")
    looked = []
    original = JobStore.is_evicted
    monkeypatch.setattr(JobStore, "is_evicted", lambda self, node: (looked.append(node), original(self, node))[1])
    keeper.start()
    try:
        until(lambda: keeper.renewals >= 3)  # taken, kept alive twice: it would have looked by now
        NodeLeases(store, [1], timeout=10.0, now=0.0).forget(1)  # the leader counts it lost
        assert original(store, 1) and store.lease_renewals([1]) == {1: None}  # marked, and its key gone
        until(lambda: keeper.lapsed, timeout=10.0)  # at its next keep-alive, 10/3 s on at most
        assert "ended" in keeper.fence_reason(keeper.renewed) and looked == []
    finally:
        keeper.stop()


@pytest.mark.fast
def test_a_lease_keeper_that_cannot_reach_the_store_fences_before_the_leader_would_evict_it():
    def unreachable() -> JobStore:
        raise RuntimeError("connection refused")

    keeper = LeaseKeeper(unreachable, 1, timeout=4.0)
    assert keeper.fence_reason(keeper.renewed + 4 * FENCE_FRACTION - 0.01) is None
    assert "could not renew" in keeper.fence_reason(keeper.renewed + 4 * FENCE_FRACTION + 0.01)
    keeper.evicted = True
    assert "declared this node lost" in keeper.fence_reason(keeper.renewed)


@pytest.mark.fast
def test_an_etcd_lease_is_kept_alive_every_third_of_its_ttl_and_a_failed_renewal_is_tried_again_soon():
    """Keep-alives go as etcd's client sends them (TTL/3); the embedded store's renewals, which the leader counts
    by its own looks, five per timeout; a failure is tried again RETRY_AFTER on, not a whole interval on."""
    assert renewal_interval(10.0, native_leases=True) == pytest.approx(10.0 / KEEPALIVES_PER_TTL)
    assert renewal_interval(10.0, native_leases=False) == pytest.approx(10.0 / RENEWALS_PER_TIMEOUT)
    assert KEEPALIVES_PER_TTL * FENCE_FRACTION > 2  # two whole intervals of tries before a node fences
    assert retry_at(due=20.0, now=15.0) == 15.0 + RETRY_AFTER
    assert retry_at(due=15.2, now=15.0) == 15.2  # the next renewal is due sooner


def test_a_keeper_whose_renewal_failed_tries_again_long_before_its_next_renewal(served, monkeypatch):
    """A store that failed one renewal (a lost keep-alive, an etcd election) is tried again RETRY_AFTER later:
    with a 60 s timeout the next renewal would be 12 or 20 s on, past the wait below."""
    monkeypatch.setattr(lease_module, "first_renewal_delay", lambda interval, draw: 0.0)
    tries: list[float] = []

    def connect() -> JobStore:
        tries.append(time.monotonic())
        if len(tries) == 1:
            raise RuntimeError("connection refused")
        return served()

    keeper = LeaseKeeper(connect, 1, timeout=60.0)
    keeper.start()
    try:
        until(lambda: keeper.renewals == 1, timeout=8.0)
        assert len(tries) == 2 and tries[1] - tries[0] >= RETRY_AFTER
    finally:
        keeper.stop()


@pytest.mark.fast
def test_keepers_started_together_first_renew_spread_over_one_interval_never_later():
    """Agents started in the same second renew at different moments of each interval from then on; none renews
    for the first time later than it did with no spread (one interval), nor at once."""
    delays = [first_renewal_delay(2.0, draw / 100) for draw in range(100)]
    assert 0.0 < min(delays) and max(delays) <= 2.0
    assert max(delays) - min(delays) > 1.5  # spread over most of the interval
    assert len(set(delays)) == 100


@pytest.mark.fast
def test_readers_woken_together_look_again_at_different_moments_idle_wait_on_average():
    """Readers that one broadcast woke together do not all look at their lanes again in the same instant: their
    idle waits spread over most of IDLE_WAIT either side of it, and average IDLE_WAIT (the idle load stays)."""
    waits = [idle_wait(draw / 100) for draw in range(100)]
    assert 0.0 < min(waits) and max(waits) < 2 * IDLE_WAIT
    assert max(waits) - min(waits) > 0.9 * IDLE_WAIT
    assert abs(sum(waits) / len(waits) - IDLE_WAIT) < 0.05 * IDLE_WAIT


@pytest.mark.fast
@pytest.mark.parametrize("due, now, then", [
    (10.0, 10.0, 12.0),  # on time: one interval on
    (10.0, 11.5, 12.0),  # a little late: the cadence holds (a slow answer does not put the next off)
    (10.0, 17.0, 17.0),  # more than an interval late: once more at once, not every renewal missed
])
def test_a_renewal_is_due_one_interval_after_the_last_was_due_not_after_its_answer(due, now, then):
    assert next_renewal(due, now, 2.0) == then


@pytest.mark.fast
def test_a_plan_is_published_under_its_attempt(served):
    store = served()
    store.publish_plan(2, Plan(5, [0, 3, 1], "lost rank 1", lost=[2]))
    assert store._get(keys.current_gen(2)) == {"gen": 5}
    assert store._get(keys.plan(2, 5))["members"] == [0, 3, 1]


@pytest.mark.fast
@pytest.mark.parametrize("endpoint", ["nohost", "host:", ":29500", "host:http", "host:70000", "host:٤"])
def test_a_malformed_endpoint_is_one_clear_error(endpoint):
    with pytest.raises(UsageError, match="expected HOST:PORT"):
        parse_endpoint(endpoint)


def test_a_running_job_is_registered_answers_ping_and_is_unregistered_at_exit(live_job, workload, tmp_path):
    proc, entry = live_job("--nproc-per-node", "2", workload("wait_forever.py"), tmp_path)
    assert registry.running() == [entry] and registry.find(entry.run_id) == registry.find(entry.rdzv_id) == [entry]
    store = JobStore(connect(entry.endpoint, connect_timeout=STORE_START_WAIT), Seal(entry.secret))  # registered before it is served
    answer = store.request(keys.node_box(0), {"cmd": "ping"})
    assert answer["ok"] and answer["node_rank"] == 0 and sorted(answer["ranks"]) == ["0", "1"]
    assert answer["run"] == entry.run_id
    unknown = store.request(keys.node_box(0), {"cmd": "frobnicate"})
    assert not unknown["ok"] and "frobnicate" in unknown["error"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert registry.running() == []


@pytest.mark.fast
def test_an_endpoint_nobody_listens_on_is_one_clear_error(free_port):
    with pytest.raises(NoSuchJob, match="cannot reach a job at 127.0.0.1"):
        connect(f"127.0.0.1:{free_port()}")
