"""The scripts under scripts/ still load against the package as it is now, and their flags still parse.

The benchmarks and the GPU check run outside the suite (the GPU check only where a GPU is lent, with a few
minutes to spare): a name they import that a change moved or renamed would show first there. Here every
script is imported, as its own module with scripts/ on the path as when it runs, and each that takes flags
answers ``--help``, all in one interpreter (torch imported once).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(path.stem for path in (ROOT / "scripts").glob("*.py"))

LOAD_EACH = """
import contextlib, importlib, io, sys
sys.path.insert(0, sys.argv[1])
for name in sys.argv[2:]:
    module = importlib.import_module(name)
    if "ArgumentParser" not in open(module.__file__).read() or not hasattr(module, "main"):
        continue
    sys.argv = [name + ".py", "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            module.main()
    except SystemExit as exc:
        assert exc.code in (0, None), (name, exc.code)
    else:
        raise AssertionError(f"{name}: --help did not end the script")
    assert "usage:" in out.getvalue(), (name, out.getvalue()[:200])
    print("helped", name)
"""


def test_every_script_imports_and_answers_help():
    assert {"gpu_check", "gpu_drill", "nvml_check", "bench_recovery", "bench_control_plane"} <= set(SCRIPTS)
    result = subprocess.run([sys.executable, "-c", LOAD_EACH, str(ROOT / "scripts"), *SCRIPTS],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    helped = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("helped ")}
    assert {"gpu_drill", "bench_recovery", "bench_control_plane", "bench_transfer"} <= helped, result.stdout


def test_the_shell_scripts_parse():
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"


def test_each_steady_state_configuration_takes_each_place_of_a_round_equally_often():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from bench_recovery import OVERHEAD_CONFIGS, round_order
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    labels = list(OVERHEAD_CONFIGS)
    rounds = [round_order(labels, number) for number in range(2 * len(labels))]
    assert all(sorted(order) == sorted(labels) for order in rounds)
    for place in range(len(labels)):
        assert sorted(order[place] for order in rounds) == sorted(labels * 2)


def test_the_gpu_checks_planes_run_on_gloo_in_both_modes():
    # the GPU check's own code where no GPU is: ftrun's planes formed, used, aborted and re-formed as on NCCL,
    # fresh and in place (a call that no longer fits the planes' API fails here, not on a lent GPU)
    from ftrun.worker import backends

    for mode in ("fresh", "native"):
        result = subprocess.run([sys.executable, "scripts/gpu_check.py", "--planes", mode, "--backend", "gloo"],
                                capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 0 and result.stdout.endswith(f"planes ({mode}, gloo): ok\n"), \
            result.stdout + result.stderr[-3000:]
        assert ("data group re-formed in place (torch's reconfigure): True" in result.stdout) \
            == backends.reconfigures_in_place(mode)  # native, where this torch has the API
