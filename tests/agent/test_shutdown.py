"""Stopping the workers: the escalation schedule and the answer to a signal as pure functions, and the Stopper
carrying them out over stand-in workers (no process, no clock: ``now`` is passed in)."""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

import pytest

from ftrun import protocol
from ftrun.agent.decisions import Rescue, rescue_outcome, rescue_source
from ftrun.agent.shutdown import KILL_WAIT, SAVE_SHARE, OnSignal, Phase, kill_now, on_signal, phase, schedule
from ftrun.agent.stopper import Stopper
from ftrun.errors import UsageError
from ftrun.event_log import read_events
from ftrun.events import EventLog
from ftrun.flag_values import resume_dir, resumed_rescue

pytestmark = pytest.mark.fast

GRACE = 30.0


# ------------------------------------------------------------------------------------------ the schedule
def test_a_plain_stop_signals_then_kills_at_the_grace_then_gives_up_kill_wait_later():
    stop = schedule(signal.SIGTERM, 100.0, GRACE, save=False)
    assert (stop.save_until, stop.kill_at, stop.abandon_at) == (100.0, 130.0, 130.0 + KILL_WAIT)
    assert [phase(stop, now, saving=False) for now in (100.0, 129.9, 130.0, 139.9, 140.0)] == \
        [Phase.SIGNAL, Phase.SIGNAL, Phase.KILL, Phase.KILL, Phase.ABANDON]


def test_a_preemption_saves_for_at_most_its_share_of_the_grace_and_still_kills_at_the_grace():
    stop = schedule(signal.SIGTERM, 0.0, GRACE, save=True)
    assert stop.save_until == GRACE * SAVE_SHARE and stop.kill_at == GRACE  # the whole stop fits the grace
    assert phase(stop, 1.0, saving=True) is Phase.SAVE
    assert phase(stop, 1.0, saving=False) is Phase.SIGNAL  # every saver answered: signal at once
    assert phase(stop, GRACE * SAVE_SHARE, saving=True) is Phase.SIGNAL  # the rest do not hold the stop up
    assert phase(stop, GRACE, saving=True) is Phase.KILL


def test_sigkill_or_no_grace_kills_at_once_and_nothing_is_saved():
    stop = schedule(signal.SIGKILL, 5.0, GRACE, save=True)
    assert (stop.save_until, stop.kill_at, stop.abandon_at) == (5.0, 5.0, 5.0 + KILL_WAIT)
    assert phase(stop, 5.0, saving=True) is Phase.KILL
    assert phase(schedule(signal.SIGTERM, 5.0, 0.0, save=True), 5.0, saving=True) is Phase.KILL


def test_killing_now_cuts_the_save_and_the_grace_but_the_unkillable_wait_counts_from_the_first_sigkill():
    stop = schedule(signal.SIGTERM, 0.0, GRACE, save=True)
    now = kill_now(stop, 3.0)
    assert (now.save_until, now.kill_at, now.abandon_at) == (3.0, 3.0, 3.0 + KILL_WAIT)
    assert phase(now, 3.0, saving=True) is Phase.KILL
    late = kill_now(schedule(signal.SIGTERM, 0.0, 1.0, save=False), 5.0)  # SIGKILL went out at 1.0 already
    assert (late.kill_at, late.abandon_at) == (1.0, 1.0 + KILL_WAIT)


def test_the_answer_to_a_signal():
    assert on_signal(False, False, savers=4)[0] is OnSignal.SAVE_THEN_STOP
    act, why = on_signal(False, False, savers=0)
    assert act is OnSignal.STOP and "no worker uses the worker API (ftrun.init())" in why
    assert on_signal(False, True, savers=4)[0] is OnSignal.STOP  # a failure is being handled already
    assert on_signal(True, True, savers=4)[0] is OnSignal.KILL  # a second signal


# ------------------------------------------------------------------------------------ rescues
def test_where_a_group_restart_or_a_resumed_launch_starts_from(tmp_path):
    run, earlier = tmp_path / "run", tmp_path / "earlier"
    assert rescue_source(0, False, run, None) is None
    assert rescue_source(1, False, run, None) is None  # nothing was saved: from scratch
    assert rescue_source(1, True, run, None) == run / "rescue"
    assert rescue_source(0, False, run, earlier) == earlier
    assert rescue_source(2, False, run, earlier) == earlier  # this launch saved nothing newer
    assert rescue_source(2, True, run, earlier) == run / "rescue"


def test_a_node_resumes_from_the_state_it_saved_itself_where_its_host_holds_it(tmp_path):
    (tmp_path / "rescue").mkdir()
    (tmp_path / "rescue" / "0.pt").write_bytes(b"")
    assert resumed_rescue(tmp_path, 0) == resumed_rescue(tmp_path, 1) == tmp_path / "rescue"  # node 1 saved none here
    (tmp_path / "node1" / "rescue" / "shards").mkdir(parents=True)
    assert resumed_rescue(tmp_path, 1) == tmp_path / "rescue"  # an empty directory holds nothing
    (tmp_path / "node1" / "rescue" / "shards" / "2.pt").write_bytes(b"")
    assert resumed_rescue(tmp_path, 1) == tmp_path / "node1" / "rescue"
    assert resumed_rescue(tmp_path, 2) == tmp_path / "rescue"
    assert resume_dir(str(tmp_path), 1) == resume_dir(str(tmp_path), 0) == tmp_path
    (tmp_path / "rescue" / "0.pt").unlink()
    assert resume_dir(str(tmp_path), 1) == tmp_path  # node 1's own state is enough for node 1
    with pytest.raises(UsageError, match="no saved state there"):
        resume_dir(str(tmp_path), 0)


def test_a_rescue_that_could_not_be_written_says_why():
    rescue = Rescue("recovery failed", deadline=10.0, waiting=set(), errors={0: "[Errno 28] No space left on device"})
    assert rescue_outcome(rescue, 1.0) == ("recovery failed; no state could be saved for the restart: "
                                           "[Errno 28] No space left on device")
    rescue.saved[1] = 7
    assert rescue_outcome(rescue, 1.0) == "recovery failed; the state of step 7 was saved for the restart"


# ------------------------------------------------------------------------------------ the Stopper
class StandIn:
    """A worker as the Stopper sees it: what it was sent, and the signals it got."""

    def __init__(self, uid: int) -> None:
        self.uid, self.pid, self.slot, self.exitcode = uid, 1000 + uid, SimpleNamespace(rank=uid), None
        self.sent: list[dict] = []
        self.signals: list[int] = []

    def send(self, data: bytes) -> None:
        self.sent += [json.loads(line) for line in data.splitlines()]

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


def make_stopper(tmp_path, workers, savers, grace=GRACE, node=0):
    log, notices, abandoned = EventLog(tmp_path / "events.jsonl"), [], []
    stopper = Stopper(schedule(signal.SIGTERM, 0.0, grace, save=bool(savers)),
                      lambda: [w for w in workers if w.exitcode is None],
                      lambda w, waited: abandoned.append((w.uid, waited)), log,
                      SimpleNamespace(notice=lambda text, style="": notices.append(text)), tmp_path, savers, node)
    return stopper, log, notices, abandoned


def test_another_nodes_stopper_says_where_it_saved_but_leaves_how_to_resume_to_node_0(tmp_path):
    workers = [StandIn(100000)]
    stopper, _, notices, _ = make_stopper(tmp_path, workers, workers, node=1)
    stopper.on_message(100000, {"t": protocol.SAVED, "step": 7})
    stopper.tick(1.0)
    assert notices == [f"ftrun: node 1: the state of step 7 is saved in {tmp_path / 'rescue'} (a new launch "
                       "resumes from node 0's)"]


def test_a_preempted_stopper_asks_the_api_workers_to_save_then_signals_everyone_once(tmp_path):
    api, plain = [StandIn(0), StandIn(1)], StandIn(2)
    stopper, log, notices, _ = make_stopper(tmp_path, [*api, plain], api)
    assert [m["t"] for w in api for m in w.sent] == [protocol.SAVE] * 2 and not plain.sent
    assert not any(w.signals for w in [*api, plain])  # nobody is signalled while saving
    stopper.on_message(0, {"t": protocol.SAVED, "step": 41})
    stopper.tick(1.0)
    assert stopper.phase is Phase.SAVE
    stopper.on_message(1, {"t": protocol.SAVED, "step": 42})
    stopper.tick(1.5)
    assert stopper.phase is Phase.SIGNAL and all(w.signals == [signal.SIGTERM] for w in [*api, plain])
    stopper.tick(2.0)
    assert all(w.signals == [signal.SIGTERM] for w in [*api, plain])  # each phase acts once
    (rescue,) = [e for e in read_events(log.path) if e["event"] == "rescue"]
    assert (rescue["saved"], rescue["best_step"], rescue["missing"], rescue["why"]) == \
        ({"0": 41, "1": 42}, 42, [], "SIGTERM")
    assert notices == [f"ftrun: the state of step 42 is saved in {tmp_path / 'rescue'}; "
                       f"`ftrun --resume-from {tmp_path} ...` continues from it"]


def test_a_worker_that_cannot_save_says_why_and_one_that_does_not_answer_is_not_waited_for_past_the_share(tmp_path):
    workers = [StandIn(0), StandIn(1)]
    stopper, log, notices, _ = make_stopper(tmp_path, workers, workers)
    stopper.on_message(0, {"t": protocol.SAVED, "step": 3, "error": "[Errno 28] No space left on device"})
    stopper.tick(GRACE * SAVE_SHARE)
    assert stopper.phase is Phase.SIGNAL
    (rescue,) = [e for e in read_events(log.path) if e["event"] == "rescue"]
    assert (rescue["best_step"], rescue["missing"], rescue["errors"]) == \
        (-1, [1], {"0": "[Errno 28] No space left on device"})
    assert notices == ["ftrun: no state could be saved: [Errno 28] No space left on device"]


def test_a_worker_still_there_after_sigkill_is_given_up_on_and_the_stop_ends(tmp_path):
    quick, stuck = StandIn(0), StandIn(1)
    stopper, log, notices, abandoned = make_stopper(tmp_path, [quick, stuck], [], grace=1.0)
    assert quick.signals == stuck.signals == [signal.SIGTERM]
    assert not quick.sent and not notices and not read_events(log.path)  # nothing to save: no rescue
    quick.exitcode = 0
    stopper.tick(1.0)
    assert quick.signals == [signal.SIGTERM] and stuck.signals == [signal.SIGTERM, signal.SIGKILL]
    stopper.tick(1.0 + KILL_WAIT - 0.1)
    assert not abandoned
    stopper.tick(1.0 + KILL_WAIT)
    assert abandoned == [(1, KILL_WAIT)] and not notices
