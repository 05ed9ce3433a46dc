"""Training through the worker API with a data group that rejects CPU tensors, as NCCL's does, on CPU.

``ftrun.init(backend="cuda:gloo")`` forms each generation's data group with Gloo for CUDA tensors only:
any collective on CPU tensors issued on it raises ("No backend type associated with device type cpu").
The model and optimizer stay on the CPU, so every collective ftrun makes here (agreement, loss sum, state
transfer) must go to the control plane. No DDP (it cannot run on such a group with CPU parameters): each
rank computes the whole global batch, so all ranks hold the same state. FAULTS and AWAIT as in
await_train.py. Every rank prints ``commit uid=<uid> rank=<r> world=<w> step=<n> loss=<mean>
sum=<checksum of the parameters and the optimizer's moments>`` per committed step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ftrun  # noqa: E402
from await_train import AWAIT, UID, wait_for  # noqa: E402
from faulty_train import FAULTS  # noqa: E402


def checksum(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    moments = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return float(sum(t.double().sum() for t in [*model.parameters(), *moments]))


def main() -> None:
    ft = ftrun.init(backend="cuda:gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ft.protect(model=model, optimizer=optimizer)
    inputs = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    targets = torch.tanh(inputs.flip(1))
    if os.environ.get("FTRUN_SPARE") == "1":
        for when, what in AWAIT:
            if when == "joiner":
                wait_for(what)
    waited: set[int] = set()
    for step in ft.steps(int(sys.argv[1])):
        for when, what in AWAIT:
            if when.isdigit() and int(when) == step and step not in waited:
                waited.add(step)
                wait_for(what)
        for kind, at, uid in FAULTS:
            if (kind, int(at), int(uid)) == ("kill", step, UID):
                os.kill(os.getpid(), 9)
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        total = ft.commit(optimizer, loss)
        if total is not None:
            print(f"commit uid={UID} rank={ft.rank} world={ft.world_size} step={step} "
                  f"loss={total / ft.world_size:.9g} sum={checksum(model, optimizer):.12g}", flush=True)


if __name__ == "__main__":
    main()
