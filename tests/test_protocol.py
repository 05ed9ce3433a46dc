"""Message shapes are checked where messages enter a process: every kind with its fields, nothing else."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from ftrun import protocol
from ftrun.protocol import Plan, mail_problem, worker_message_problem

pytestmark = pytest.mark.fast

FAILURE = {"rank": 1, "local_rank": 1, "pid": 42, "exitcode": -9, "when": 1.5, "message": "", "traceback": ""}
COMMIT = {"t": protocol.PROGRESS, "gen": 0, "step": 1, "time": 2.0, "step_time": 0.1}
PLAN_LINE = json.dumps(Plan(3, [0, 2], "lost rank 1", lost=[1]).message())
VALID_MAIL = [
    {"t": protocol.WORKER_STARTED, "uid": 100000, "pid": 7, "local_rank": 0, "rank": 2, "joiner": False},
    {"t": protocol.WORKER_STARTED, "uid": 100002, "pid": 7, "local_rank": 2, "rank": None, "joiner": True},
    {"t": protocol.WORKER_MESSAGE, "uid": 100000, "msg": {"t": protocol.ENTERED, "step": 3}},
    {"t": protocol.COMMITS, "commits": [{"uid": 100000, "msg": COMMIT}, {"uid": 100001, "msg": COMMIT}]},
    {"t": protocol.WORKER_EXITED, "uid": 100000, "code": 0},
    {"t": protocol.WORKER_EXITED, "uid": 100000, "code": -9, "failure": FAILURE},
    {"t": protocol.NODE_GONE, "node": 1, "reason": "ssh ended", "since": 12.5},
    {"t": protocol.NODE_STUCK, "node": 1, "gen": 2, "reason": "every rank has made no progress for 9 s"},
    {"t": protocol.RELAY, "uid": 100000, "data": PLAN_LINE + "\n" + protocol.encode(protocol.SAVE, copies=False).decode()},
    {"t": protocol.SIGNAL, "uid": 100000, "sig": int(signal.SIGKILL)},
    {"t": protocol.START_WORKER, "uid": 100001, "local_rank": 1, "rank": 3},
    {"t": protocol.STOP, "reason": "the leader stopped"},
    {"t": protocol.RESTART, "attempt": 1, "reason": "worker failure", "store": "10.0.0.1:41235"},
    {"t": protocol.FOLLOWING, "node": 2, "term": 1, "gen": 3},
    {"t": protocol.RELAY, "uid": 100000, "data": json.dumps(Plan(4, [100000], "lost ranks 0, 1", lost=[0, 1],
                                                                  store="10.0.0.2:41234").message())},
    {"t": protocol.DONE},
    {"cmd": protocol.PING, "reply_to": "abc"},
    {"cmd": protocol.INJECT, "kind": "kill", "rank": 0},
    {"cmd": "frobnicate"},  # another version's command: the agent answers that it does not know it
]


@pytest.mark.parametrize("message", VALID_MAIL, ids=lambda m: m.get("t") or m["cmd"])
def test_every_message_ftrun_posts_is_accepted(message):
    assert mail_problem(message) is None


@pytest.mark.parametrize("message, why", [
    ({"t": "x"}, "unknown kind 'x'"),
    ({}, "unknown kind 'None'"),
    ([1, 2], "not a JSON object"),
    ("text", "not a JSON object"),
    ({"t": ["stop"]}, "unknown kind"),
    ({"t": protocol.STOP}, "stop: no field 'reason'"),
    ({"t": protocol.STOP, "reason": 7}, "field 'reason' has a wrong type"),
    ({"t": protocol.RESTART, "attempt": "1", "reason": "x", "store": "h:1"}, "field 'attempt' has a wrong type"),
    ({"t": protocol.RESTART, "attempt": 1, "reason": "x"}, "restart: no field 'store'"),
    ({"t": protocol.RESTART, "attempt": 1, "reason": "x", "store": "h:0"}, "field 'store' has a wrong type"),
    ({"t": protocol.SIGNAL, "uid": 1, "sig": 99999}, "field 'sig'"),
    ({"t": protocol.SIGNAL, "uid": True, "sig": 9}, "field 'uid'"),
    ({"t": protocol.WORKER_EXITED, "uid": 1, "code": 1}, "no valid 'failure'"),
    ({"t": protocol.WORKER_EXITED, "uid": 1, "code": 1, "failure": {**FAILURE, "extra": 1}}, "no valid 'failure'"),
    ({"t": protocol.WORKER_EXITED, "uid": 1, "code": 1, "failure": {**FAILURE, "when": float("nan")}}, "failure"),
    ({"t": protocol.NODE_GONE, "node": 1, "reason": "", "since": float("inf")}, "field 'since'"),
    ({"t": protocol.NODE_GONE, "node": 1, "reason": "", "since": 10**400}, "field 'since'"),  # no float holds it
    ({"t": protocol.NODE_GONE, "node": 2**63, "reason": "", "since": 0}, "field 'node'"),  # nor an int64
    ({"t": protocol.RELAY, "uid": 1, "data": json.dumps({"t": protocol.SLOW, "seconds": 1e300, "duration": None})},
     "field 'data'"),  # a sleep that long raises OverflowError
    ({"t": protocol.RELAY, "uid": 1, "data": '{"t": "slow", "seconds": 1, "duration": NaN}'}, "field 'data'"),
    ({"t": protocol.WORKER_MESSAGE, "uid": 1, "msg": {"t": protocol.PROGRESS, "gen": 0}}, "field 'msg'"),
    ({"t": protocol.RELAY, "uid": 1, "data": "not json"}, "field 'data'"),
    ({"t": protocol.COMMITS, "commits": []}, "field 'commits'"),
    ({"t": protocol.COMMITS, "commits": [{"uid": 1, "msg": COMMIT}] * 2}, "field 'commits'"),  # a worker twice
    ({"t": protocol.COMMITS, "commits": [{"uid": 1, "msg": {"t": protocol.ENTERED, "step": 3}}]}, "'commits'"),
    ({"t": protocol.COMMITS, "commits": [{"uid": 1, "msg": {**COMMIT, "step": "1"}}]}, "field 'commits'"),
    ({"t": protocol.COMMITS, "commits": [{"uid": 1, "msg": COMMIT, "x": 0}]}, "field 'commits'"),
    ({"t": protocol.COMMITS, "commits": [{"uid": i, "msg": COMMIT} for i in range(100_001)]}, "'commits'"),
    ({"t": protocol.RELAY, "uid": 1, "data": json.dumps({"t": protocol.PLAN, "gen": 1})}, "field 'data'"),
    ({"t": protocol.RELAY, "uid": 1, "data": json.dumps({**json.loads(PLAN_LINE), "members": [0, 0]})}, "'data'"),
    ({"t": protocol.RELAY, "uid": 1, "data": "[" * 100_000}, "field 'data'"),
    ({"t": protocol.RELAY, "uid": 1, "data": json.dumps({**json.loads(PLAN_LINE), "store": "host"})}, "'data'"),
    ({"t": protocol.RELAY, "uid": 1, "data": json.dumps({**json.loads(PLAN_LINE), "store": "h:99999"})}, "'data'"),
    ({"t": protocol.RELAY, "uid": 1, "data": json.dumps({**json.loads(PLAN_LINE), "store": ":80"})}, "'data'"),
    ({"t": protocol.FOLLOWING, "node": "2", "term": 1, "gen": 0}, "field 'node'"),
    ({"t": protocol.FOLLOWING, "node": 2, "term": 1}, "no field 'gen'"),
    ({"t": protocol.START_WORKER, "uid": 1, "local_rank": "0", "rank": 1}, "field 'local_rank'"),
    ({"cmd": ["ping"]}, "cmd or reply_to is not a string"),
    ({"cmd": protocol.PING, "reply_to": 7}, "cmd or reply_to is not a string"),
    ({"cmd": protocol.INJECT, "kind": "kill"}, "inject: no field 'rank'"),
])
def test_a_malformed_message_is_named_not_raised(message, why):
    assert why in mail_problem(message)


@pytest.mark.parametrize("message, why", [
    ({"t": protocol.HELLO, "uid": 1, "pid": 2, "spare": False}, None),
    ({"t": protocol.PROGRESS, "gen": 0, "step": 1, "time": 2.0, "step_time": 0.1}, None),
    ({"t": protocol.FINISHED, "step": 5}, None),
    ({"t": protocol.RECOVERED, "gen": 1, "step": 4, "held": 4, "plan_received": 3.0, "received_state": True,
      "timings": {"abort": 0.1, "rendezvous": 0.2, "agree": 0.0, "transfer": 0.3}}, None),
    ({"t": protocol.RECOVERED, "gen": 1, "step": 4, "held": 4, "plan_received": 3.0, "timings": {"abort": 0.1}},
     "'timings'"),
    ({"t": protocol.FINISHED}, "no field 'step'"),
    ({"t": protocol.PROGRESS, "gen": 0, "step": 1, "time": float("nan"), "step_time": 0.1}, "field 'time'"),
    ({"t": protocol.ENTERED}, "no field 'step'"),
    ({"t": protocol.COLLECTIVE_FAILED, "gen": 1, "step": 4, "phase": "probe", "error": "reset",
      "unreachable": {"0": [2], "2": [0], "3": []}}, None),
    ({"t": protocol.COLLECTIVE_FAILED, "gen": 1, "step": 4, "phase": "step", "error": "x", "unreachable": None}, None),
    ({"t": protocol.COLLECTIVE_FAILED, "gen": 1, "step": 4, "phase": "probe", "error": "x",
      "unreachable": {"zero": [1]}}, "field 'unreachable'"),
    ({"t": protocol.COLLECTIVE_FAILED, "gen": 1, "step": 4, "phase": "probe", "error": "x",
      "unreachable": {"9" * 5000: [1]}}, "field 'unreachable'"),  # int() refuses more than 4,300 digits
    ({"t": protocol.PROGRESS, "gen": 0, "step": 1, "time": 10**400, "step_time": 0.1}, "field 'time'"),
    ({"t": protocol.STOP, "reason": "x"}, "unknown kind 'stop'"),  # a mailbox kind is no worker's
])
def test_worker_messages_are_checked_too(message, why):
    problem = worker_message_problem(message)
    assert problem is None if why is None else why in problem


def test_every_kind_the_code_sends_has_a_shape_its_reader_accepts():
    # a kind missing from the tables would be dropped as malformed where it arrives, silently
    source = "\n".join(path.read_text() for path in Path(protocol.__file__).parent.rglob("*.py"))
    sent_by_workers = set(re.findall(r"channel\.send\(protocol\.([A-Z_]+)", source))
    posted = set(re.findall(r'"t": protocol\.([A-Z_]+)', source))
    assert sent_by_workers and posted
    assert {getattr(protocol, name) for name in sent_by_workers} <= set(protocol.FROM_WORKER)
    assert {getattr(protocol, name) for name in posted} <= set(protocol.MAIL)


def test_a_plan_is_read_back_from_its_own_fields_only():
    message = {**Plan(2, [5, 1], "why", lost=[3], joiners=[1]).message(), "newer_field": True}
    assert Plan.from_message(message) == Plan(2, [5, 1], "why", lost=[3], joiners=[1])
