"""Real NVML through ftrun's own monitor: init, list the GPUs, register for events, poll the health counters.

Run by scripts/gpu_check.sh on a machine with a GPU (or alone: ``python scripts/nvml_check.py --seconds 5``).
Prints each GPU as the monitor describes it, the GPUs registered for Xid and double-bit ECC events, then,
once a second, the volatile uncorrected ECC count, the row remapping flags and the driver's recovery
action field as the monitor's polls read them, and every health signal it reported. Exit 1 if NVML is
unusable.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from ftrun.health.nvml import NvmlMonitor
from ftrun.health.signals import HealthSignal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to watch")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    signals: list[HealthSignal] = []
    monitor = NvmlMonitor(signals.append, poll_interval=1.0)
    if not monitor.start():
        raise SystemExit("nvml check: NVML is unusable here (see the line above)")
    try:
        print(f"nvml check: GPUs watched (NVML index -> local rank): {monitor.gpus}", flush=True)
        for device in monitor.describe_devices():
            print(f"nvml check: device {json.dumps(device)}", flush=True)
        print(f"nvml check: registered for Xid and double-bit ECC events: GPUs {monitor.event_gpus}", flush=True)
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            time.sleep(1.0)  # the monitor's own thread polls every second; this only samples what it read
            print(f"nvml check: readings {json.dumps(monitor.readings())}", flush=True)
    finally:
        monitor.stop()
    print(f"nvml check: {len(signals)} health signal(s): {[(s.kind, s.gpu_index, s.value) for s in signals]}")
    print("nvml check: ok", flush=True)


if __name__ == "__main__":
    main()
