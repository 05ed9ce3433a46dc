"""Protected state: what it is, how it is loaded, and the rescue files a group restart resumes from."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from ftrun.paths import Unreadable, open_regular
from ftrun.protocol import MAX_INT


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: a model, an optimizer, a scheduler."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


def state_of(name: str, obj: Any) -> dict[str, Any]:
    """``obj.state_dict()``, as ``protect(name=obj)`` takes it; TypeError, naming it, where ``obj`` has no
    ``state_dict()`` or ``load_state_dict()`` (a rank behind could not load it), or its state is not a dict."""
    for method in ("state_dict", "load_state_dict"):
        if not callable(getattr(obj, method, None)):
            raise TypeError(f"ftrun: protect({name}=...): a {type(obj).__name__} has no {method}(): protect objects "
                            "with state_dict() and load_state_dict() (a model, an optimizer, a scheduler), or wrap "
                            "the state in one")
    state = obj.state_dict()
    if not isinstance(state, dict):
        raise TypeError(f"ftrun: protect({name}=...): its state_dict() returns a {type(state).__name__}, not a dict")
    return state


def snapshot(objects: dict[str, Stateful], step: int) -> dict[str, Any]:
    """The committed step and every protected object's state (its live tensors, not copies)."""
    return {"step": step, "state": {name: obj.state_dict() for name, obj in objects.items()}}


def load_into(data: dict[str, Any], objects: dict[str, Stateful]) -> int:
    """Load a snapshot into the protected objects; returns the step it committed."""
    missing, extra = set(objects) - set(data["state"]), set(data["state"]) - set(objects)
    if missing or extra:
        which = f"holds none for {sorted(missing)}" if missing else f"holds state for {sorted(extra)}, not protected here"
        raise RuntimeError(f"ftrun: the state to load (a peer's, or a rescue file's) {which}: every rank must "
                           "protect the same names, before steps(), and a resumed run those of the run that saved it")
    for name, obj in objects.items():
        obj.load_state_dict(data["state"][name])
    return int(data["step"])


def save_rescue(objects: dict[str, Stateful], step: int, path: Path) -> None:
    """Write the state of ``step`` to ``path`` atomically: kept for a group restart or a next launch.

    OSError when it cannot be written (a full disk), and no partial file is left behind.
    """
    save_atomically(snapshot(objects, step), path)


def save_atomically(value: Any, path: Path) -> None:
    """``torch.save`` ``value`` to ``path``, which holds either the whole of it or what it held before.

    OSError when it cannot be written (a full disk), and no partial file is left behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    try:
        with open(partial, "wb") as f:
            target = _KeepsWriteError(f)
            try:
                torch.save(value, target)
            except RuntimeError:
                if target.error is not None:  # torch reports a failed write as an opaque "enforce fail"
                    raise target.error from None
                raise
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class _KeepsWriteError:
    """A binary file that keeps the first error its writes raised."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.file.flush()


class BadRescue(ValueError):
    """A rescue file that is not one to load (a FIFO, a device) or not a saved state; the message says why."""


def rescue_problem(data: Any) -> str | None:
    """Why ``data``, loaded from a rescue file, is not a state :func:`snapshot` made (None when it is one): a
    dict with a whole-number step a C int64 holds and a state that maps each protected name to its state dict."""
    if not isinstance(data, dict):
        return f"not a saved state (a {type(data).__name__}, not a dict of step and state)"
    step, state = data.get("step"), data.get("state")
    if type(step) is not int:  # a bool, a float, a string or a tensor is not a step ftrun saved
        return f"its step is a {type(step).__name__}, not an int"
    if not -MAX_INT <= step <= MAX_INT:
        return "its step is out of range (an int64 holds it where it is used)"
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in state.items()):
        return "its state is not a dict of state dicts by name"
    return None


def _open_regular(path: Path) -> BinaryIO:
    """The regular file at ``path``, open to read (:func:`ftrun.paths.open_regular`); BadRescue for anything
    else (a FIFO is not waited on for a writer, a device such as /dev/zero is not read), OSError when it cannot
    be opened."""
    try:
        fd, _ = open_regular(path)
    except Unreadable as exc:
        raise BadRescue(str(exc)) from None
    return os.fdopen(fd, "rb")


def load_rescue(path: Path) -> dict[str, Any]:
    """The state saved in the rescue file at ``path``, loaded without running code (``weights_only``: a pickle
    that would call a function is refused) and checked (:func:`rescue_problem`); raises when it is not one."""
    return load_checked(path, rescue_problem)


def load_checked(path: Path, problem_of: Callable[[Any], str | None]) -> Any:
    """What the file at ``path`` holds, loaded without running code (``weights_only``) onto the CPU; BadRescue
    with ``problem_of``'s reason when it is not what was saved there (``problem_of`` returns None for that)."""
    with _open_regular(path) as file:
        data = torch.load(file, map_location="cpu", weights_only=True)
    problem = problem_of(data)
    if problem is not None:
        raise BadRescue(problem)
    return data


def skipped_line(path: Path, exc: Exception) -> str:
    """The line that says a rescue file at ``path`` is skipped, and why."""
    return f"ftrun: skipping rescue file {path}: {_skipped_because(exc)}"


def _skipped_because(exc: Exception) -> str:
    """Why a rescue file is skipped, in one line: the first of its message (which may have none), after the
    exception's name unless ftrun's own check raised it."""
    first = (str(exc).splitlines() or [""])[0][:200]
    if isinstance(exc, BadRescue):
        return first
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def best_rescue(directory: Path) -> dict[str, Any] | None:
    """The usable rescue file with the highest committed step (:func:`load_rescue`); one line on stderr for each
    file that cannot be used (a worker killed mid-write leaves only a .partial), and one when none holds a
    committed state (a step of 0 or more): this worker then starts from scratch."""
    best: dict[str, Any] | None = None
    for path in sorted(directory.glob("*.pt")):
        try:
            data = load_rescue(path)
        except Exception as exc:  # noqa: BLE001 -- any unusable file is skipped the same way
            print(skipped_line(path, exc), file=sys.stderr, flush=True)
            continue
        if data["step"] >= 0 and (best is None or data["step"] > best["step"]):
            best = data
    if best is None:
        print(f"ftrun: no rescue file in {directory} holds a committed state to resume from: this worker starts "
              "from scratch (step 0) unless another rank resumes one", file=sys.stderr, flush=True)
    return best
