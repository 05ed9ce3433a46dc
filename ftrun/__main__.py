"""The ``ftrun`` command, and ``python -m ftrun``."""

import signal

from ftrun.processes import quit_on_signals


def main() -> None:
    """Import the command line (typer and rich: about a tenth of a second with the interpreter's start), a
    SIGINT, SIGTERM or SIGHUP meanwhile ending the process quietly, then run it."""
    replaced = quit_on_signals()
    from ftrun.cli import main as command

    for sig, disposition in replaced.items():
        signal.signal(sig, disposition)
    command()


if __name__ == "__main__":
    main()
