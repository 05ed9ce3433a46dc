"""The link probe among a generation's members, over a real TCPStore and real sockets, in one process."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from ftrun.store import keys
from ftrun.store.client import open_client
from ftrun.worker import links

pytestmark = pytest.mark.fast


def run_probe(members: list[int], prober_of: dict[int, links.Prober]) -> dict[int, BaseException | None]:
    """Every member probes at once, each on its own store client, as workers do; what each one raised."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    outcome: dict[int, BaseException | None] = {}

    def member(uid: int) -> None:
        store = open_client("127.0.0.1", server.port, 30)

        def wait(waited: list[str]) -> None:
            deadline = time.monotonic() + 30
            while not store.check(waited):
                assert time.monotonic() < deadline, waited
                time.sleep(0.01)

        try:
            links.probe(store, prober_of[uid], uid, members, lambda u: keys.probe_address(0, 1, u),
                        lambda u: keys.probe_result(0, 1, u), wait)
            outcome[uid] = None
        except links.LinkFailure as exc:
            outcome[uid] = exc

    threads = [threading.Thread(target=member, args=(uid,)) for uid in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcome


def test_members_that_all_connect_go_on_to_form():
    probers = {uid: links.Prober() for uid in (0, 1, 2)}
    assert run_probe([0, 1, 2], probers) == {0: None, 1: None, 2: None}


def test_a_link_that_does_not_connect_stops_every_member_with_the_whole_matrix(free_port):
    probers = {uid: links.Prober() for uid in (0, 1, 2)}
    probers[2].address = f"127.0.0.1:{free_port()}"  # nothing listens there: nobody can connect to member 2
    outcome = run_probe([0, 1, 2], probers)
    assert all(isinstance(exc, links.LinkFailure) for exc in outcome.values())
    assert {uid: exc.unreachable for uid, exc in outcome.items()} == {uid: {0: [2], 1: [2], 2: []} for uid in (0, 1, 2)}
    assert str(outcome[0]) == "links that do not connect: 0-2, 1-2"


@pytest.mark.parametrize("address", [b"nohost", b"h:abc", b"h:-1", b"127.0.0.1:99999", b"\xff\xfe"])
def test_a_peers_probe_address_or_result_that_is_not_one_is_a_link_that_fails(address):
    """The probe keys are not sealed, and anyone who reaches the store may write them: what is there reads as
    a peer this member cannot reach (and a result that is no list of uids as every link failed), never as an
    exception that ends the worker in its recovery."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    store = open_client("127.0.0.1", server.port, 30)
    store.set(keys.probe_address(0, 1, 1), address)
    store.set(keys.probe_result(0, 1, 1), b"[" * 100_000)
    with pytest.raises(links.LinkFailure) as failed:
        links.probe(store, links.Prober(), 0, [0, 1], lambda u: keys.probe_address(0, 1, u),
                    lambda u: keys.probe_result(0, 1, u), lambda waited: None)
    assert failed.value.unreachable == {0: [1], 1: [-1]}


def test_the_prober_listens_where_gloo_would(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert links.gloo_address() == "127.0.0.1"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert links.gloo_address()  # this host's name's address
