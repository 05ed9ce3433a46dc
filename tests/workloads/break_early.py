"""Leaves ft.steps() at step BREAK_AT (the environment's, default 5) with the step's collectives under way and
the step uncommitted (as a script that stops on a NaN loss does), then works on, outside any collective, for
AFTER seconds (default 8) before it prints `after the loop` and ends: longer than the hang timeout the test
gives, which must not take the work for a hang."""

from __future__ import annotations

import os
import time

import torch

import ftrun

ft = ftrun.init()
model = ft.ddp(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
ft.protect(model=model, optimizer=optimizer)
for step in ft.steps(100):
    loss = model(torch.full((2, 4), float(step))).sum()
    ft.backward(loss)
    if step == int(os.environ.get("BREAK_AT", "5")):
        break
    ft.commit(optimizer, loss)
time.sleep(float(os.environ.get("AFTER", "8")))  # the work after the loop: it is the test's subject, not a wait
print(f"after the loop: committed {ft.committed_step}", flush=True)
