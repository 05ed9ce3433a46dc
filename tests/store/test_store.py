"""The store package over a real TCPStore: records, mailboxes, leases, plans; and reaching a running job."""

from __future__ import annotations

import json
import os
import select
import signal
from datetime import timedelta

import pytest

from ftrun import registry
from ftrun.errors import NoSuchJob, UsageError
from ftrun.protocol import Plan
from ftrun.store import keys
from ftrun.store.client import STORE_START_WAIT, connect, open_client, parse_endpoint
from ftrun.store.job import JobStore, MalformedValue
from ftrun.store.leases import LeaseKeeper, NodeLeases
from ftrun.store.mailbox import MailReader


@pytest.fixture
def served():
    """A TCPStore served in this process; returns a function making client JobStores on it."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return lambda: JobStore(open_client("127.0.0.1", server.port, 5))


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
@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b"\xff\xfe", b"42"])
def test_a_value_ftrun_did_not_write_is_refused_not_crashed_on(served, raw):
    store = served()
    store.kv.set(keys.JOB, raw)
    with pytest.raises(MalformedValue):
        store.read_job(1.0)


@pytest.mark.fast
def test_the_mail_reader_hands_on_messages_in_order_and_drops_malformed_ones(served):
    store = served()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    reader = MailReader(served, "node3", wake_w)
    reader.start()
    try:
        store.post("node3", {"t": "a"})
        index = store.kv.add(keys.mail_count("node3"), 1)  # a writer that is not ftrun's
        store.kv.set(keys.mail_item("node3", index), b"{broken")
        store.post("node3", {"t": "b"})
        received: list[dict] = []
        while len(received) < 2:
            assert select.select([wake_r], [], [], 10)[0], "no wake-up within 10 s"
            os.read(wake_r, 64)
            received += reader.take()
        assert received == [{"t": "a"}, {"t": "b"}] and reader.dropped == 1
        assert not store.kv.check([keys.mail_item("node3", 1)])  # read messages are deleted
    finally:
        reader.stop()
        os.close(wake_r)
        os.close(wake_w)


@pytest.mark.fast
def test_a_command_without_an_answer_is_one_clear_error(served):
    store = served()
    with pytest.raises(UsageError, match="did not answer within 1 s"):
        store.request("node0", {"cmd": "ping"}, timeout=1.0)
    (posted,) = [store.take_mail("node0", 1)]
    store.reply(posted, {"ok": True})  # answered late: the reply key is written, the asker is gone
    assert store.kv.check([keys.reply(posted["reply_to"])])
    store.reply({"reply_to": 7}, {"ok": True})  # not a token ftrun wrote: nothing happens


@pytest.mark.fast
def test_leases_expire_by_the_clock_given_and_an_evicted_node_learns_it(served):
    store = served()
    leases = NodeLeases(store, [1, 2], timeout=10.0, now=0.0)
    assert leases.expired(0.0) == []
    store.renew_lease(1)
    assert leases.expired(NodeLeases.START_GRACE - 5) == []  # both within the start grace; node 1 seen renewing
    lost = leases.expired(NodeLeases.START_GRACE + 1)
    assert lost == [(2, NodeLeases.START_GRACE + 1 - (NodeLeases.START_GRACE - 10))]
    assert store.is_evicted(2) and not store.is_evicted(1) and store.renew_lease(2) is True
    assert [node for node, _ in leases.expired(NodeLeases.START_GRACE + 16)] == [1]  # no renewal since -5


@pytest.mark.fast
def test_a_lease_keeper_that_cannot_reach_the_store_fences_after_its_timeout():
    def unreachable() -> JobStore:
        raise RuntimeError("connection refused")

    keeper = LeaseKeeper(unreachable, 1, timeout=5.0)
    assert keeper.fence_reason(keeper.renewed + 4.9) is None
    assert "could not renew" in keeper.fence_reason(keeper.renewed + 5.1)
    keeper.evicted = True
    assert "declared this node lost" in keeper.fence_reason(keeper.renewed)


@pytest.mark.fast
def test_a_plan_is_published_under_its_attempt(served):
    store = served()
    store.publish_plan(2, Plan(5, [0, 3, 1], "lost rank 1", lost=[2]))
    assert store.kv.get(keys.current_gen(2)) == b"5"
    assert json.loads(store.kv.get(keys.plan(2, 5)))["members"] == [0, 3, 1]


@pytest.mark.fast
@pytest.mark.parametrize("endpoint", ["nohost", "host:", ":29500", "host:http", "host:70000", "host:٤"])
def test_a_malformed_endpoint_is_one_clear_error(endpoint):
    with pytest.raises(UsageError, match="expected HOST:PORT"):
        parse_endpoint(endpoint)


def test_a_running_job_is_registered_answers_ping_and_is_unregistered_at_exit(live_job, workload, tmp_path):
    proc, entry = live_job("--nproc-per-node", "2", workload("wait_forever.py"), tmp_path)
    assert registry.running() == [entry] and registry.find(entry.run_id) == registry.find(entry.rdzv_id) == [entry]
    store = JobStore(connect(entry.endpoint, connect_timeout=STORE_START_WAIT))  # registered before it is served
    answer = store.request(keys.node_box(0), {"cmd": "ping"})
    assert answer["ok"] and answer["node_rank"] == 0 and sorted(answer["ranks"]) == ["0", "1"]
    unknown = store.request(keys.node_box(0), {"cmd": "frobnicate"})
    assert not unknown["ok"] and "frobnicate" in unknown["error"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert registry.running() == []


@pytest.mark.fast
def test_an_endpoint_nobody_listens_on_is_one_clear_error(free_port):
    with pytest.raises(NoSuchJob, match="cannot reach a job at 127.0.0.1"):
        connect(f"127.0.0.1:{free_port()}")
