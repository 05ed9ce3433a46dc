"""The worker API called wrongly: one exception naming the mistake, at the call, rather than a surprise after a
fault (a source that cannot send its state, a joiner that cannot load it, a rescue that skips it) or a loop that
counts differently from torchrun's.

The session runs as under plain torchrun (world size 1, Gloo, in this process): the checks are the same under
ftrun, where the session is managed.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import ftrun.worker.session as session_module
from ftrun.worker.session import Session
from ftrun.worker.state import load_into

pytestmark = pytest.mark.fast


class Holder:
    """State of the user's own, protected through state_dict()/load_state_dict()."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


class OnlySaves:
    def state_dict(self):
        return {"t": torch.ones(1)}


class Custom:
    """A type torch does not load from a peer's bytes unless it is allowed by name."""


@pytest.fixture
def session(monkeypatch, free_port):
    for name in ("FTRUN_CHANNEL_FD", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    made = Session("gloo")
    try:
        yield made
    finally:
        dist.destroy_process_group()


def train(ft, model, opt, step):
    loss = model(torch.full((1, 2), float(step))).sum()
    ft.backward(loss)
    return ft.commit(opt, loss)


@pytest.mark.parametrize("state, words", [
    (OnlySaves(), r"a OnlySaves has no load_state_dict\(\)"),
    (torch.ones(2), r"a Tensor has no state_dict\(\)"),
    (Holder([torch.ones(1)]), r"its state_dict\(\) returns a list, not a dict"),
    (Holder({"fn": lambda x: x}), "no peer could take its state: PicklingError"),
    (Holder({"lock": threading.Lock()}), "no peer could take its state: TypeError: cannot pickle '_thread.lock'"),
    (Holder({"custom": Custom()}), "Unsupported global.*add_safe_globals"),
])
def test_state_no_peer_could_take_is_refused_by_protect_naming_it(session, state, words):
    with pytest.raises(TypeError, match=rf"^ftrun: protect\(extra=\.\.\.\): .*{words}"):
        session.protect(extra=state)
    assert "extra" not in session.protected


def test_what_is_protected_is_fixed_once_the_loop_began(session):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session.protect(model=model, optimizer=opt)
    for step in session.steps(2):
        with pytest.raises(RuntimeError, match=r"protect\(\) every object before steps\(\)"):
            session.protect(late=Holder({"t": torch.ones(1)}))
        train(session, model, opt, step)


def test_commit_outside_a_step_is_refused_and_a_second_loop_goes_on_from_the_last_commit(session):
    """As under ftrun: a second steps() continues the run's steps (torchrun's range() would start again)."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session.protect(model=model, optimizer=opt)
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="commit.. commits a step of steps.."):
        session.commit(opt)  # a warm-up step before the loop would take step 0's place
    seen = []
    for total in (3, 5):
        for step in session.steps(total):
            seen.append(step)
            assert train(session, model, opt, step) is not None
    assert seen == [0, 1, 2, 3, 4] and session.committed_step == 4
    with pytest.raises(RuntimeError, match="commit.. commits a step of steps.."):
        session.commit(opt)


@pytest.mark.parametrize("total", ["10", 1.5, None])
def test_steps_takes_a_whole_number_at_the_call(session, total):
    with pytest.raises(TypeError, match="steps.. takes a whole number of steps"):
        session.steps(total)


def test_a_second_init_on_another_backend_is_refused(session, monkeypatch):
    monkeypatch.setattr(session_module, "_session", session)
    assert session_module.init() is session and session_module.init("gloo") is session
    with pytest.raises(ValueError, match=r"init\('nccl'\) after init\(\) on 'gloo'"):
        session_module.init("nccl")


def test_state_for_names_not_protected_here_is_not_loaded_silently():
    mine = {"model": Holder({"t": torch.zeros(1)})}
    with pytest.raises(RuntimeError, match=r"holds state for \['late'\], not protected here"):
        load_into({"step": 3, "state": {"model": {"t": torch.ones(1)}, "late": {"t": torch.ones(1)}}}, mine)
    with pytest.raises(RuntimeError, match=r"holds none for \['model'\]"):
        load_into({"step": 3, "state": {}}, mine)
    assert load_into({"step": 3, "state": {"model": {"t": torch.ones(1)}}}, mine) == 3
