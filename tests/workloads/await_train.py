"""faulty_train.py with waits on the run's event log, so joiner tests do not depend on timing luck.

FAULTS is read and planted as in faulty_train.py (in attempt 0 only, so a group restart runs clean).
AWAIT (environment) is a comma list of WHEN:WHAT; a worker waits until
the run's event log (FTRUN_RUN_DIR/events.jsonl) holds an event WHAT (an event name, or `joined`: a
"generation" event with joiners; `NAME*N`: at least N events NAME; `at_STEP*N`: N members wait before step
STEP; `left_loop*N`: N members have left their step loop; each such mark is a file FTRUN_RUN_DIR/<mark>.<uid>
a member writes as it begins that wait):
  WHEN = STEP    every member waits before step STEP (before that step's planted fault), once
  WHEN = end     every member waits after its last step, before it exits
  WHEN = joiner  a joiner (spare or respawned worker) waits before entering Session.steps()
A wait gives up after 120 s and carries on (the test then fails on what it checks, instead of hanging).
Every rank prints `commit uid=<uid> rank=<r> world=<w> step=<n> loss=<float>` for each committed step.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import faulty_train  # noqa: E402
from faulty_train import EXAMPLE, UID, ftrun  # noqa: E402

AWAIT = [tuple(a.split(":", 1)) for a in os.environ.get("AWAIT", "").split(",") if a]
MARK = re.compile(r"left_loop|at_\d+")
EVENTS = Path(os.environ.get("FTRUN_RUN_DIR", ".")) / "events.jsonl"


def logged(what: str) -> bool:
    """Whether the event log holds the event ``what`` (or, for `joined`, a generation with joiners)."""
    what, _, count = what.partition("*")
    wanted = int(count or 1)
    if MARK.fullmatch(what):
        return len(list(EVENTS.parent.glob(f"{what}.*"))) >= wanted
    try:
        lines = EVENTS.read_text().splitlines()
    except FileNotFoundError:
        return False
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:  # a line being written
            continue
        if (what == "joined" and event["event"] == "generation" and event.get("joiners")) or event["event"] == what:
            wanted -= 1
            if not wanted:
                return True
    return False


def wait_for(what: str) -> None:
    faulty_train.wait_until(lambda: logged(what))


def main() -> None:
    args = EXAMPLE.parse_args()
    ft = ftrun.init()
    training = faulty_train.build(args, ft)
    if os.environ.get("FTRUN_JOINER") == "1":
        for when, what in AWAIT:
            if when == "joiner":
                wait_for(what)
    waited: set[int] = set()
    planted: set[int] = set()
    for step in ft.steps(args.steps):
        for when, what in AWAIT:
            if when.isdigit() and int(when) == step and step not in waited:
                waited.add(step)
                (EVENTS.parent / f"at_{step}.{UID}").touch()
                wait_for(what)
        faulty_train.plant_due(step, planted, training, ft)
        loss = EXAMPLE.train_step(ft, training, step)
        if loss is not None:
            print(f"commit uid={UID} rank={ft.rank} world={ft.world_size} step={step} loss={loss:.12g}", flush=True)
    (EVENTS.parent / f"left_loop.{UID}").touch()  # after Session.steps() told the agent the loop is over
    for when, what in AWAIT:
        if when == "end":
            wait_for(what)


if __name__ == "__main__":
    main()
