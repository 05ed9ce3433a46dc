"""The recovery protocol's decisions, as pure functions of synthetic state: no process, no store, no clock."""

from __future__ import annotations

import re

import pytest

from ftrun.agent.decisions import (Act, LinkTrouble, MAX_REFORMS, Membership, REFORM_GRACE, Recovery,
                                   RecoveryOptions, Rescue, decide_deadline, decide_fault, decide_join,
                                   decide_link_fault, links_to_cut, lost_ranks, next_plan, recovery_summary,
                                   rescue_outcome, split_lost, succeeded, waiting_for, why_no_restart_here,
                                   why_not_in_place)
from ftrun.protocol import RECOVERY_PHASES, Plan

pytestmark = pytest.mark.fast


def members(n: int = 4, gen: int = 0, adopted: bool = True, **fields) -> Membership:
    """A generation of uids 0..n-1 that all joined through the API (unless ``adopted`` is False)."""
    m = Membership(Plan(gen, list(range(n))), target=n, **fields)
    if adopted:
        m.adopted |= set(range(n))
    return m


# --------------------------------------------------------------------------------------- the next plan
def test_next_plan_drops_the_lost_and_keeps_the_survivors_order():
    plan = next_plan(Plan(3, [0, 1, 2, 3]), {1}, [], target=4, reason="lost rank 1")
    assert (plan.gen, plan.members, plan.lost, plan.joiners) == (4, [0, 2, 3], [1], [])
    assert plan.reason == "lost rank 1"
    assert plan.rank_of(2) == 1 and plan.rank_of(1) is None  # ranks shift down past the lost one


def test_next_plan_after_rank_0_is_lost_makes_the_next_survivor_rank_0():
    plan = next_plan(Plan(0, [0, 1, 2, 3]), {0}, [], target=4, reason="lost rank 0")
    assert plan.members == [1, 2, 3] and plan.rank_of(1) == 0


def test_next_plan_appends_joiners_up_to_the_target_only():
    ready = [7, 8, 9]
    plan = next_plan(Plan(1, [0, 2, 3, 5]), {2, 5}, ready, target=4, reason="lost")
    assert plan.members == [0, 3, 7, 8] and plan.joiners == [7, 8] and plan.lost == [2, 5]
    assert ready == [7, 8, 9]  # the caller's list is left alone
    assert plan.world_size == 4 and plan.rank_of(8) == 3


def test_next_plan_for_joiners_alone_and_at_the_target():
    plan = next_plan(Plan(2, [0, 1, 3]), (), [4], target=4, reason="joiner ready")
    assert (plan.gen, plan.members, plan.lost, plan.joiners) == (3, [0, 1, 3, 4], [], [4])
    full = next_plan(Plan(2, [0, 1, 2, 3]), (), [4], target=4, reason="joiner ready")
    assert full.members == [0, 1, 2, 3] and full.joiners == []  # a spare stays a spare
    short = next_plan(Plan(0, [0, 1, 2, 3]), {0, 1, 2}, [4], target=4, reason="lost")
    assert short.members == [3, 4] and short.joiners == [4]  # fewer joiners than needed: all of them


def test_next_plan_lost_is_sorted_whatever_the_order_faults_came_in():
    plan = next_plan(Plan(0, [0, 1, 2, 3]), [3, 1], [], target=4, reason="lost")
    assert plan.lost == [1, 3] and plan.members == [0, 2]


def test_plan_survives_the_control_message_round_trip():
    plan = next_plan(Plan(1, [0, 2, 3]), {2}, [5], target=3, reason="lost rank 1")
    assert Plan.from_message(plan.message()) == plan


def test_in_place_recovery_goes_ahead_when_every_worker_adopted_the_api():
    assert why_not_in_place([0, 1, 2, 3], {0, 1, 2, 3}, survivors=3, available_joiners=0, min_nproc=1) is None
    assert why_not_in_place([0, 1, 2, 3], {0, 1, 2, 3, 4}, survivors=1, available_joiners=0, min_nproc=1) is None


def test_in_place_recovery_is_refused_when_a_worker_did_not_adopt_the_api():
    reason = why_not_in_place([0, 1, 2, 3], {0, 1, 3}, survivors=3, available_joiners=1, min_nproc=1)
    assert reason is not None and re.search(r"does not use the (ftrun )?worker API", reason)
    # the API check comes first: even with nobody left, the reason names the script
    reason = why_not_in_place([0, 1], set(), survivors=0, available_joiners=0, min_nproc=1)
    assert reason is not None and "worker API" in reason


def test_in_place_recovery_is_refused_when_no_worker_survived():
    assert why_not_in_place([0], {0}, survivors=0, available_joiners=2, min_nproc=1) == "no worker survived"


def test_in_place_recovery_is_refused_below_min_nproc_unless_joiners_make_up_for_it():
    assert why_not_in_place([0, 1, 2, 3], {0, 1, 2, 3}, 3, 0, min_nproc=4) == "only 3 workers left, below --min-nproc 4"
    assert why_not_in_place([0, 1, 2, 3], {0, 1, 2, 3}, 3, 1, min_nproc=4) is None  # a ready joiner counts
    assert why_not_in_place([0, 1, 2, 3], {0, 1, 2, 3}, 2, 1, min_nproc=4) == "only 2 workers left, below --min-nproc 4"


# --------------------------------------------------------------------------------------- faults
def test_which_lost_workers_were_members_and_which_were_joiners_still_waiting():
    m = members(ready=[7])
    assert split_lost(m, [2, 7, 9]) == ([2], [7, 9])  # 9: a spare never placed, 7: ready, not yet placed


def test_a_member_lost_is_recovered_in_place_with_the_next_plan():
    decision = decide_fault(members(), RecoveryOptions(), [2], [2], replacements=0, rescuing=False)
    assert decision.act is Act.NEW_PLAN and decision.reason == "lost rank 2"
    assert decision.plan == Plan(1, [0, 1, 3], "lost rank 2", lost=[2])


def test_a_ready_joiner_fills_the_place_of_the_lost_at_once():
    decision = decide_fault(members(ready=[9]), RecoveryOptions(), [0, 3], [0, 3], replacements=0, rescuing=False)
    assert decision.act is Act.NEW_PLAN and decision.reason == "lost ranks 0, 3"
    assert decision.plan.members == [1, 2, 9] and decision.plan.joiners == [9]


def test_a_script_without_the_api_restarts_the_group_at_once_with_the_reason():
    m = members()
    m.adopted.discard(3)
    decision = decide_fault(m, RecoveryOptions(), [1], [1], replacements=0, rescuing=False)
    assert decision.act is Act.RESTART and "worker API" in decision.reason


def test_no_survivor_means_saving_nothing_but_a_restart():
    decision = decide_fault(members(2), RecoveryOptions(), [0, 1], [0, 1], replacements=0, rescuing=False)
    assert decision == type(decision)(Act.RESCUE, "no worker survived")  # the live workers (none) are asked to save


def test_below_min_nproc_without_joiners_the_survivors_save_their_state_for_a_restart():
    decision = decide_fault(members(), RecoveryOptions(min_nproc=4), [2], [2], replacements=0, rescuing=False)
    assert decision.act is Act.RESCUE and decision.reason == "only 3 workers left, below --min-nproc 4"


def test_below_min_nproc_with_a_replacement_coming_the_survivors_wait_for_it():
    decision = decide_fault(members(), RecoveryOptions(min_nproc=4), [2], [2], replacements=1, rescuing=False)
    assert decision.act is Act.WAIT and decision.plan == Plan(0, [0, 1, 3])
    assert "below --min-nproc 4" in decision.reason


def test_finished_workers_are_not_survivors():
    m = members(finished={0, 1})
    decision = decide_fault(m, RecoveryOptions(), [2], [2], replacements=0, rescuing=False)
    assert decision.act is Act.NEW_PLAN  # rank 3 survives; 0 and 1 finished and stay in the plan
    decision = decide_fault(m, RecoveryOptions(), [2, 3], [2, 3], replacements=0, rescuing=False)
    assert (decision.act, decision.reason) == (Act.RESCUE, "no worker survived")


def test_nothing_is_decided_while_a_rescue_runs_or_recovery_is_off():
    assert decide_fault(members(), RecoveryOptions(), [2], [2], 0, rescuing=True).act is Act.NONE
    assert decide_fault(members(), RecoveryOptions(), [], [], 0, rescuing=False).act is Act.NONE
    off = decide_fault(members(), RecoveryOptions(enabled=False), [2], [2], 0, rescuing=False)
    assert off.act is Act.RESTART and "--no-recovery" in off.reason


def test_lost_ranks_are_named_in_the_generation_the_fault_hit():
    before, current = Plan(0, [0, 1, 2, 3]), Plan(1, [0, 1, 3])
    assert lost_ranks(before, current, [3, 2]) == [3, 2]  # rank 3 of generation 0, not rank 2 of generation 1
    assert lost_ranks(Plan(0, [0, 1]), Plan(1, [0, 1, 9]), [9]) == [2]  # a joiner placed since: its rank now


# --------------------------------------------------------------------------------------- joiners
def test_a_ready_joiner_tops_a_short_generation_up():
    m = Membership(Plan(2, [0, 1, 3]), target=4, ready=[4])
    decision = decide_join(m, RecoveryOptions(), None)
    assert decision.act is Act.NEW_PLAN and decision.plan == Plan(3, [0, 1, 3, 4], "joiner ready", joiners=[4])


@pytest.mark.parametrize("why", ["full", "nobody", "training over", "recovering"])
def test_joiners_wait_when_full_absent_the_training_over_or_a_recovery_running(why):
    m = Membership(Plan(2, [0, 1, 3] + ([2] if why == "full" else [])), target=4,
                   ready=[] if why == "nobody" else [4], left_loop={0} if why == "training over" else set())
    recovery = Recovery("fault", 0.0, 0.0, 0.0, m.plan, 5) if why == "recovering" else None
    assert decide_join(m, RecoveryOptions(), recovery).act is Act.NONE


def test_joiners_that_start_together_join_together_unless_the_ready_ones_fill_the_generation():
    # a late node's two workers (--nnodes MIN:MAX): the first ready waits for the second, not placed alone
    m = Membership(Plan(0, [0, 1, 100000, 100001]), target=6, ready=[200000])
    assert decide_join(m, RecoveryOptions(), None, warming=1).act is Act.NONE
    m.ready.append(200001)
    decision = decide_join(m, RecoveryOptions(), None, warming=0)
    assert decision.act is Act.NEW_PLAN and decision.plan.joiners == [200000, 200001]
    assert decision.plan.world_size == 6
    m = Membership(Plan(2, [0, 1, 3]), target=4, ready=[4])  # one ready spare fills it: another starting waits not
    assert decide_join(m, RecoveryOptions(), None, warming=1).act is Act.NEW_PLAN


def test_a_joiner_ready_once_the_group_is_restarting_is_not_placed():
    # a worker forked warm can be ready a moment after the wait for it gave up
    m = Membership(Plan(0, [0, 1, 3]), target=4, ready=[4])
    assert decide_join(m, RecoveryOptions(min_nproc=4), None, rescuing=True).act is Act.NONE


def test_joiners_below_min_nproc_wait_for_more():
    m = Membership(Plan(1, [0]), target=4, ready=[5])
    recovery = Recovery("fault", 0.0, 0.0, 0.0, m.plan, 5, waiting_since=1.0)
    assert decide_join(m, RecoveryOptions(min_nproc=3), recovery).act is Act.WAIT
    m.ready.append(6)
    decision = decide_join(m, RecoveryOptions(min_nproc=3), recovery)
    assert decision.act is Act.NEW_PLAN and decision.plan.members == [0, 5, 6]


# --------------------------------------------------------------------------------------- deadlines
def test_a_recovery_is_given_up_only_after_its_timeout_on_the_clock_given():
    recovery = Recovery("fault", began=100.0, started=0.0, noticed=0.0, before=Plan(0, [0, 1]), last_steps={0: 3, 1: 3})
    options = RecoveryOptions(recovery_timeout=30.0)
    assert decide_deadline(recovery, options, 130.0).act is Act.NONE
    late = decide_deadline(recovery, options, 130.5)
    assert late.act is Act.RESCUE and "--recovery-timeout 30 s" in late.reason
    assert decide_deadline(None, options, 1e9).act is Act.NONE


def test_a_wait_for_joiners_is_given_up_after_the_join_timeout():
    recovery = Recovery("fault", 0.0, 0.0, 0.0, Plan(0, [0, 1]), 3, waiting_since=50.0)
    options = RecoveryOptions(min_nproc=2, recovery_timeout=1.0, join_timeout=60.0)
    assert decide_deadline(recovery, options, 110.0).act is Act.NONE  # the recovery timeout does not apply
    late = decide_deadline(recovery, options, 110.5)
    assert late.act is Act.RESCUE and "--join-timeout 60 s" in late.reason and "--min-nproc 2" in late.reason


def test_a_rescue_ends_when_every_worker_saved_or_at_its_deadline():
    rescue = Rescue("no worker survived", deadline=10.0, waiting={1, 2})
    assert rescue_outcome(rescue, 5.0) is None
    rescue.waiting.discard(1)
    rescue.saved[1] = 41
    assert rescue_outcome(rescue, 10.0) == "no worker survived; the state of step 41 was saved for the restart"
    rescue.waiting.clear()
    assert rescue_outcome(rescue, 0.0).endswith("step 41 was saved for the restart")
    assert rescue_outcome(Rescue("why", 10.0, set()), 0.0) == "why"  # nothing saved: the reason alone


# --------------------------------------------------------------------------------------- outcome
def test_success_counts_members_that_trained_not_a_joiner_placed_at_the_end():
    m = members(finished={0, 1, 2, 3})
    assert succeeded(m)
    m.plan = Plan(1, [0, 1, 2, 3, 9])
    m.joiners.add(9)
    assert succeeded(m)  # 9 never committed a step
    m.trained.add(9)
    assert not succeeded(m)
    assert not succeeded(Membership(Plan(0, []), target=0))


def test_a_recovery_summary_times_each_phase_and_counts_no_lost_step():
    recovery = Recovery("fault", 0.0, started=100.0, noticed=100.01, before=Plan(0, [0, 1, 2, 3]),
                        last_steps={0: 7, 1: 7, 2: 7, 3: 7}, lost_ranks=[2], lost_uids=[2], plan_sent=100.02, gen=1)
    timings = {"abort": 0.001, "rendezvous": 0.02, "agree": 0.005, "transfer": 0.0}
    recovery.reports = {uid: {"step": 7, "held": 7, "timings": timings, "plan_received": 100.021} for uid in (0, 1, 3)}
    summary = recovery_summary(recovery, {"time": 100.1, "step": 8}, world_after=3)
    assert summary["steps_lost"] == 0 and summary["resumed_at_step"] == 8 and summary["latency"] == pytest.approx(0.1)
    assert summary["phases"]["detect"] == pytest.approx(0.01) and summary["phases"]["plan"] == pytest.approx(0.01)
    assert summary["phases"]["first_step"] == pytest.approx(100.1 - 100.047)
    assert (summary["world_before"], summary["world_after"], summary["lost_ranks"]) == (4, 3, [2])
    assert summary["data_plane"] == "formed"  # no member said it reconfigured its group in place
    for report in recovery.reports.values():
        report["data_plane"] = "reconfigured"
    assert recovery_summary(recovery, {"time": 100.1, "step": 8}, world_after=3)["data_plane"] == "reconfigured"
    recovery.reports[1] = {**recovery.reports[1], "data_plane": "formed"}  # one that fell back: not in place
    assert recovery_summary(recovery, {"time": 100.1, "step": 8}, world_after=3)["data_plane"] == "formed"
    behind = {**recovery.reports[0], "step": 5}
    recovery.reports[0] = behind  # a survivor that resumed two steps behind the committed one
    assert recovery_summary(recovery, {"time": 100.1, "step": 6}, world_after=3)["steps_lost"] == 2  # 6 and 7 again


def test_a_step_only_the_lost_worker_committed_was_in_flight_and_is_not_counted_lost():
    recovery = Recovery("fault", 0.0, started=100.0, noticed=100.01, before=Plan(0, [0, 1, 2, 3]),
                        last_steps={0: 7, 1: 7, 2: 8, 3: 7}, lost_ranks=[2], lost_uids=[2], gen=1)
    recovery.reports = {uid: {"step": 7, "held": 7, "timings": dict.fromkeys(RECOVERY_PHASES, 0.0),
                              "plan_received": 100.0} for uid in (0, 1, 3)}
    assert recovery.committed_before == 7  # uid 2's step 8 never reached a survivor: it left with uid 2
    assert recovery_summary(recovery, {"time": 100.1, "step": 8}, world_after=3)["steps_lost"] == 0
    recovery.last_steps[3] = 8  # a survivor that held step 8 and resumed at 7 would have lost one
    assert recovery_summary(recovery, {"time": 100.1, "step": 8}, world_after=3)["steps_lost"] == 1


def test_steps_lost_count_what_the_survivors_held_beyond_what_they_had_told():
    # progress is told only now and then: the agent last heard of step 5, the survivors held step 7
    recovery = Recovery("fault", 0.0, started=100.0, noticed=100.01, before=Plan(0, [0, 1, 2]),
                        last_steps={0: 5, 1: 5, 2: 5}, lost_ranks=[2], lost_uids=[2], gen=1)
    report = {"step": 7, "held": 7, "timings": dict.fromkeys(RECOVERY_PHASES, 0.0), "plan_received": 100.0}
    recovery.reports = {0: report, 1: report}
    assert recovery_summary(recovery, {"time": 100.1, "step": 8}, world_after=2)["steps_lost"] == 0
    recovery.reports[1] = {**report, "step": 5}  # had it resumed from step 5, steps 6 and 7 would be lost
    assert recovery_summary(recovery, {"time": 100.1, "step": 6}, world_after=2)["steps_lost"] == 2


# --------------------------------------------------------------------------------------- progress
def test_what_the_job_waits_for_in_words():
    options = RecoveryOptions(min_nproc=4, join_timeout=60.0)
    m = members(ready=[7])
    assert waiting_for(m, options, None, None, warming=0, now=5.0) is None
    assert waiting_for(m, options, None, None, warming=2, now=5.0) == "2 joiners starting"
    waiting = Recovery("fault", 0.0, 0.0, 0.0, m.plan, 3, waiting_since=10.0)
    m.plan = Plan(1, [0, 1])
    assert waiting_for(m, options, waiting, None, warming=1, now=25.0) == \
        "waiting for joiners to reach --min-nproc 4: 3 of 4 (1 starting), 45 s left"
    recovering = Recovery("fault", 100.0, 0.0, 0.0, m.plan, 3, gen=2)
    assert waiting_for(m, options, recovering, None, 0, now=100.5) is None  # a fast recovery shows nothing
    assert waiting_for(m, options, recovering, None, 0, now=103.2) == \
        "recovering in place into generation 2: 0 of 2 workers rejoined, 3 s so far"
    rescue = Rescue("why", deadline=20.0, waiting={1}, saved={0: 5})
    assert waiting_for(m, options, None, rescue, 0, now=12.0) == \
        "saving the live workers' state before a group restart: 1 of 2 saved, 8 s left"


# --------------------------------------------------------------------------------------- link faults
def test_the_fewest_members_are_cut_and_rank_0_stays():
    members = [0, 1, 2, 3]
    assert links_to_cut({}, members) == []
    assert links_to_cut({1: [2], 2: [1]}, members) == [2]  # one link: the later rank goes
    assert links_to_cut({0: [3], 3: [0]}, members) == [3]
    assert links_to_cut({0: [2], 1: [2], 3: [2], 2: [0, 1, 3]}, members) == [2]  # one member cut off from all
    two_hosts = {0: [2, 3], 1: [2, 3], 2: [0, 1], 3: [0, 1]}  # hosts {0,1} and {2,3} no longer connect
    assert sorted(links_to_cut(two_hosts, members)) == [2, 3]
    assert links_to_cut({1: [-1, 9]}, members) == []  # links to non-members (a garbled result) cut nobody


def test_a_reported_failure_re_forms_the_same_members_once_no_death_explains_it():
    m = members()
    trouble = LinkTrouble(gen=0, since=10.0, reasons=["rank 1, step: Connection closed by peer"])
    assert decide_link_fault(m, trouble, {0}, reforms=0, now=10.0 + REFORM_GRACE / 2).act is Act.NONE  # a death may come
    decision = decide_link_fault(m, trouble, {0}, reforms=0, now=10.0 + REFORM_GRACE)
    assert decision.act is Act.NEW_PLAN and decision.plan.members == [0, 1, 2, 3] and decision.plan.probe
    assert decision.plan.gen == 1 and "Connection closed by peer" in decision.reason
    stale = LinkTrouble(gen=0, since=0.0, reasons=["x"])
    m.plan = Plan(1, [0, 1, 3])  # a death was planned meanwhile: the old generation's reports mean nothing
    assert decide_link_fault(m, stale, {0}, reforms=0, now=99.0).act is Act.NONE


def test_failures_while_waiting_for_joiners_are_the_lost_members_doing_not_a_link():
    m = members()
    trouble = LinkTrouble(gen=0, since=10.0, reasons=["rank 1, step: Connection reset by peer"])
    waiting = Recovery("fault", began=9.0, started=0.0, noticed=0.0, before=m.plan, last_steps={0: 4},
                       waiting_since=9.5)
    assert decide_link_fault(m, trouble, {0}, reforms=0, now=60.0, recovery=waiting).act is Act.NONE
    waiting.waiting_since = None  # its plan is out: a failure in the new generation is judged again
    assert decide_link_fault(m, trouble, {0}, reforms=0, now=60.0, recovery=waiting).act is Act.NEW_PLAN


def test_a_stall_needs_every_node_with_members_stuck_and_waits_no_grace():
    m = members()
    trouble = LinkTrouble(gen=0, since=50.0, stuck_nodes={0})
    assert decide_link_fault(m, trouble, {0, 1}, reforms=0, now=50.0).act is Act.NONE  # node 1 may be busy
    trouble.stuck_nodes.add(1)
    decision = decide_link_fault(m, trouble, {0, 1}, reforms=0, now=50.0)
    assert decision.act is Act.NEW_PLAN and "past its hang timeout" in decision.reason


def test_a_probe_that_finds_a_broken_link_excludes_the_fewest_members():
    m = members()
    trouble = LinkTrouble(gen=0, since=1.0, reasons=["rank 1, probe: ..."], unreachable={1: [3], 3: [1]})
    decision = decide_link_fault(m, trouble, {0}, reforms=1, now=1.0)
    assert decision.act is Act.EXCLUDE and decision.exclude == (3,) and "excluding rank 3" in decision.reason


def test_failures_that_persist_after_re_forms_restart_the_group():
    trouble = LinkTrouble(gen=0, since=0.0, reasons=["rank 0, agree: timeout"])
    decision = decide_link_fault(members(), trouble, {0}, reforms=MAX_REFORMS, now=5.0)
    assert decision.act is Act.RESCUE and f"after {MAX_REFORMS} re-forms" in decision.reason
    trouble.acted = True
    assert decide_link_fault(members(), trouble, {0}, reforms=0, now=5.0).act is Act.NONE  # decided already


def test_gpu_evictions_refuse_a_restart_below_min_nproc_on_one_node_and_below_nproc_across_nodes():
    assert why_no_restart_here(False, usable=3, nproc=4, min_nproc=2, multinode=False) is None
    assert why_no_restart_here(False, usable=1, nproc=4, min_nproc=2, multinode=False) == \
        "GPU evictions left 1 usable GPU on this node, below --min-nproc 2"
    # across nodes every node starts --nproc-per-node workers: the other nodes' ranks count on them
    assert "below --nproc-per-node 4, which every node must start again" in \
        why_no_restart_here(False, usable=3, nproc=4, min_nproc=2, multinode=True)
    assert why_no_restart_here(True, usable=4, nproc=4, min_nproc=1, multinode=False) == "this node is evicted"
