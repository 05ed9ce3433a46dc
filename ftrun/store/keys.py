"""Every key ftrun reads or writes in a job's store, in one place.

Keys that outlive attempts sit under ``ftrun/``; each attempt's keys under ``ftrun/a<attempt>/`` (so a group
restart never reads a dead attempt's barrier or plans, pytorch#135712); the process groups of a generation
under ``ftrun/a<attempt>/g<gen>/`` (a fresh prefix per generation, so no address of a dead group is read).

Every value of ftrun's own (sealed: an HMAC of key and value under the run's secret, see
:mod:`ftrun.store.auth`) is a JSON object; the counters and the workers' keys carry no seal.

====================================  =================================================================
``ftrun/job``                         sealed: run id, nodes, world size, run directory (leader, at start)
``ftrun/status/job``                  sealed: the job's live status (leader, about once a second)
``ftrun/status/node/<n>``             sealed: node ``n``'s live status (its agent, same rhythm)
``ftrun/mail/<box>/n``                counter of the commands posted to mailbox ``<box>`` (by any client)
``ftrun/mail/<box>/<i>``              sealed: command ``i`` (1-based); deleted once read
``ftrun/mail/<box>/<sender>/<i>``     sealed: message ``i`` (1-based) agent ``<sender>`` sent; deleted once read
``ftrun/bell/<box>``                  set (any value) after each message to ``<box>``; its reader waits on it
``ftrun/reply/<token>``               sealed: the answer to a command that carried ``reply_to = token``
``ftrun/lease/<n>``                   sealed: how often node ``n``'s agent renewed its lease (with etcd: took one;
                                      the key is on the etcd lease and goes when it ends)
``ftrun/evicted/<n>``                 sealed: set by the leader once it declared node ``n`` lost
``ftrun/group_store``                 sealed: where node 0 serves the process groups' TCPStore (etcd backend)
``ftrun/a<a>/gen``                    sealed: the current generation of attempt ``a``
``ftrun/a<a>/plan/<g>``               sealed: the plan of generation ``g``
``ftrun/a<a>/g<g>/arrived/<uid>``     worker ``uid`` reached generation ``g``'s barrier
``ftrun/a<a>/g<g>/probe/<uid>``       where worker ``uid`` listens for a link probe (HOST:PORT)
``ftrun/a<a>/g<g>/unreachable/<uid>`` JSON: the members worker ``uid`` could not connect to
``ftrun/a<a>/<group>/...``            a process group's own keys (torch's, under a PrefixStore)
====================================  =================================================================

This module imports nothing, so the worker runtime uses it as freely as the agent.
"""

from __future__ import annotations

OWN_PREFIX = "ftrun/"
"""Every key of ftrun's own starts with this; the rest belong to the workers' process groups."""

JOB = "ftrun/job"
GROUP_STORE = "ftrun/group_store"
STATUS_JOB = "ftrun/status/job"


def status_node(node_rank: int) -> str:
    """Node ``node_rank``'s live status record."""
    return f"ftrun/status/node/{node_rank}"


def node_box(node_rank: int) -> str:
    """The mailbox of node ``node_rank``'s agent (commands, and the leader's word for that node)."""
    return f"node{node_rank}"


LEADER_BOX = node_box(0)
"""Followers and the hostfile launcher write to node 0's mailbox: node 0's agent is the first leader."""


def leader_claim(term: int) -> str:
    """A counter the nodes add to when they stand for leader of ``term`` (1: the first after node 0): the one
    whose add returns 1 leads."""
    return f"ftrun/leader/{term}/claim"


def leader_of(term: int) -> str:
    """Which node leads from ``term`` on, and where it serves the process groups' store."""
    return f"ftrun/leader/{term}"
LAUNCHER = "launcher"
"""The hostfile launcher's name as a sender of messages (agents send as their own box's name)."""


def bell(box: str) -> str:
    """Set by every writer to ``box`` after its message: the box's reader blocks on it instead of polling."""
    return f"ftrun/bell/{box}"


def mailbox(box: str) -> str:
    """The prefix of every key of ``box``: its commands, their counter, and each sender's messages to it."""
    return f"ftrun/mail/{box}/"


def mail_count(box: str) -> str:
    """The counter of commands posted to ``box``."""
    return f"{mailbox(box)}n"


def mail_item(box: str, index: int) -> str:
    """Command ``index`` (1-based) of ``box``."""
    return f"{mailbox(box)}{index}"


def sent_item(box: str, sender: str, index: int) -> str:
    """Message ``index`` (1-based) that ``sender`` (``node<n>`` or ``launcher``) sent to ``box``."""
    return f"{mailbox(box)}{sender}/{index}"


BROADCAST = "all"
"""The box every node reads (no node's own): a sender's broadcasts are ``sent_item(BROADCAST, sender, n)``,
written once for all nodes and waited for by each (no bell)."""


def broadcast_count(sender: str) -> str:
    """How many broadcasts ``sender`` has written (sealed): tells a reader that starts late which of them are
    gone (the sender keeps only its last ones). It sits beside the broadcasts, not under their prefix: each
    reader's watch of them (etcd) then hears one event per broadcast, not two, which takes about a tenth off
    etcd's work per watcher."""
    return f"ftrun/mail/{BROADCAST}/{sender}.n"


def reply(token: str) -> str:
    """The answer to the command that carried ``reply_to = token``."""
    return f"ftrun/reply/{token}"


LEASE_PREFIX = "ftrun/lease/"
"""Every node's lease key starts with this."""


def lease(node_rank: int) -> str:
    """How often node ``node_rank`` renewed its lease."""
    return f"{LEASE_PREFIX}{node_rank}"


def ended(node_rank: int) -> str:
    """Set by a follower's agent as it ends: the leader, whose process serves the embedded store, waits for it
    before it ends (and the store with it), so that the follower has read the leader's last word."""
    return f"ftrun/ended/{node_rank}"


def evicted(node_rank: int) -> str:
    """Set once the leader declared node ``node_rank`` lost: that node must stop."""
    return f"ftrun/evicted/{node_rank}"


def attempt_prefix(attempt: int) -> str:
    """The prefix of attempt ``attempt``'s keys (its plans, barriers and process groups)."""
    return f"ftrun/a{attempt}"


def current_gen(attempt: int) -> str:
    """The current generation of ``attempt``."""
    return f"{attempt_prefix(attempt)}/gen"


def plan(attempt: int, gen: int) -> str:
    """The plan of generation ``gen`` of ``attempt``."""
    return f"{attempt_prefix(attempt)}/plan/{gen}"


def arrived(attempt: int, gen: int, uid: int) -> str:
    """Worker ``uid`` reached the barrier of generation ``gen``."""
    return f"{attempt_prefix(attempt)}/g{gen}/arrived/{uid}"


def probe_address(attempt: int, gen: int, uid: int) -> str:
    """Where worker ``uid`` listens for the link probe of generation ``gen`` (HOST:PORT)."""
    return f"{attempt_prefix(attempt)}/g{gen}/probe/{uid}"


def probe_result(attempt: int, gen: int, uid: int) -> str:
    """The members worker ``uid`` could not connect to in generation ``gen``'s probe (a JSON list)."""
    return f"{attempt_prefix(attempt)}/g{gen}/unreachable/{uid}"


def group_prefix(attempt: int, name: str) -> str:
    """The PrefixStore prefix of a process group of ``attempt`` (``g<gen>``, or ``alone<uid>`` for a spare)."""
    return f"{attempt_prefix(attempt)}/{name}"
