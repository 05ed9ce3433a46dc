"""Bad input, wherever it comes in (flags, files, environment), is refused in one line with exit code 2."""

from __future__ import annotations

import pytest

from conftest import EXAMPLE
from ftrun import flag_values

HUGE = "9" * 4300  # past the 4,300 digits Python's int() takes: parsing it must not raise


def policy(name: str, content: bytes):
    """An --xid-policy file written into the test's directory: returns a function of that directory."""

    def write(folder) -> str:
        path = folder / name
        path.write_bytes(content)
        return str(path)

    return write


@pytest.mark.parametrize("args, message", [
    (["--master-port", "70000"], "--master-port 70000: a port is between 1 and 65535"),
    (["--master-port", "-1"], "--master-port -1: a port is between 1 and 65535"),
    (["--rdzv-endpoint", "localhost:70000"], "is not HOST:PORT with a port from 1 to 65535"),
    (["--rdzv-endpoint", "localhost:" + HUGE], "is not HOST:PORT with a port from 1 to 65535"),
    (["-H", f"localhost:{HUGE}"], "-H entry 1: bad slot count '99999999999999999999': use a whole number from 1"),
    (["-H", ""], "-H entry 1: empty entry"),
    (["--hostfile", ""], "cannot read hostfile : "),
    (["--nproc-per-node", "100000"], "--nproc-per-node 100000: give between 1 and 1024 workers per node"),
    (["--nproc-per-node", HUGE], "--nproc-per-node '99999999999999999999' is not valid"),
    (["--spares", "2000"], "--spares 2000: give 0 or more, and at most 1024"),
    (["--refresh-every", "-1"], "--refresh-every -1: give 0 (no copies) or a number of steps"),
    (["--data-reconfigure", "inplace"], "--data-reconfigure 'inplace': give fresh or native"),
    (["--xid-policy", policy("latin1.json", b'{"xid": {"13": "\xe9vict_gpu"}}')], "is not UTF-8 text"),
    (["--xid-policy", policy("digits.json", '{"xid": {"٧٩": "ignore"}}'.encode())], "'٧٩' is not an Xid code"),
    (["--xid-policy", policy("super.toml", '[xid]\n"²" = "ignore"\n'.encode())], "'²' is not an Xid code"),
    (["--xid-policy", policy("long.json", f'{{"xid": {{"{"9" * 5000}": "ignore"}}}}'.encode())], "is not an Xid code"),
    (["--xid-policy", policy("number.json", f'{{"xid": {{"13": {"1" * 5000}}}}}'.encode())], "is not a policy"),
    (["--xid-policy", policy("deep.json", b'{"xid": ' + b"[" * 100_000)], "JSON nested too deeply"),
    (["--xid-policy", policy("deep.toml", b"xid = " + b"[" * 100_000)], "TOML nested too deeply"),
    (["--monitor-interval", "nan"], "--monitor-interval must be a positive number of seconds, not nan"),
    (["--monitor-interval", "inf"], "--monitor-interval must be a positive number of seconds, not inf"),
    (["--node-timeout", "nan"], "--node-timeout must be a positive number of seconds, not nan"),
    (["--hang-timeout", "nan"], "--hang-timeout must be a positive number of seconds, not nan"),
    (["--recovery-timeout", "-1"], "--recovery-timeout must be a positive number of seconds"),
    (["--join-timeout", "-1"], "--join-timeout must be a positive number of seconds"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be 0 or more seconds, not nan"),
    (["--rdzv-conf", "bind=somewhere"], "--rdzv-conf bind=somewhere: give an IP address of this machine"),
    (["--rdzv-conf", "=1"], "--rdzv-conf '=1' is not valid"),
    (["--rdzv-conf", "join_timeout=soon"], "--rdzv-conf join_timeout=soon: give the seconds the nodes have to arrive"),
    (["--rdzv-conf", "join_timeout=-5"], "--rdzv-conf join_timeout=-5: give the seconds"),
    (["--rdzv-conf", "join_timeout=inf"], "--rdzv-conf join_timeout=inf: give the seconds"),
])
def test_bad_launch_flags_are_one_line_and_exit_2(run_ftrun, tmp_path, args, message):
    args = [arg(tmp_path) if callable(arg) else arg for arg in args]
    result = run_ftrun(*args, EXAMPLE)
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.startswith("ftrun: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and len(result.stderr) < 400, result.stderr


@pytest.mark.parametrize("env, message", [
    ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon': give a number of seconds"),
    ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "-1"}, "--shutdown-timeout must be 0 or more seconds"),
    ({"FTRUN_SECRET_FILE": "/nonexistent"}, "FTRUN_SECRET_FILE /nonexistent: cannot read it"),
])
def test_bad_environment_is_one_line_and_exit_2(run_ftrun, env, message):
    result = run_ftrun(EXAMPLE, env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_spares_that_would_share_the_training_workers_gpus_are_one_line_and_exit_2(run_ftrun):
    result = run_ftrun("--nproc-per-node", 2, "--spares", 1, EXAMPLE, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--spares 1: this node has 2 GPUs and 2 train on them, and a spare needs a GPU of its own" \
        in result.stderr, result.stderr


def test_a_hosts_agent_refuses_spares_its_own_gpus_cannot_hold_in_one_line(run_ftrun, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")  # a local host: its agent runs here, without ssh
    result = run_ftrun("--hostfile", hostfile, "--spares", 1, EXAMPLE, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "ftrun: error: localhost: --spares 1: this node has 2 GPUs and 2 train on them" in result.stderr, \
        result.stderr


@pytest.mark.fast
@pytest.mark.parametrize("nproc, spares, gpus, refused", [
    (8, 1, 8, True),  # every GPU trains: a spare would wrap onto GPU 0
    (8, 2, 9, True),  # one GPU left, two spares
    (7, 1, 8, False),  # the spare has GPU 7
    (4, 2, 1, False),  # the workers share one GPU already (cuda:gloo drills, CPU training on a GPU machine)
    (4, 1, 0, False),  # no GPU
    (8, 0, 8, False),
])
def test_a_spare_needs_a_gpu_of_its_own_where_each_worker_has_one(nproc, spares, gpus, refused):
    assert (flag_values.spares_refusal(nproc, spares, gpus) is not None) == refused


@pytest.mark.parametrize("args, message", [
    (["chaos", "--mtbf", "nan", "--duration", "5"], "--mtbf must be a number of seconds above 0, not nan"),
    (["chaos", "--mtbf", "inf", "--duration", "5"], "--mtbf must be a number of seconds above 0, not inf"),
    (["chaos", "--mtbf", "1", "--duration", "nan"], "--duration must be a number of seconds above 0, not nan"),
    (["xid", "٧٩", "--rank", "0"], "xid CODE: expected an Xid code"),
    (["xid", HUGE, "--rank", "0"], "xid CODE: expected an Xid code"),
    (["slow", "nan", "--rank", "0"], "slow SECONDS must be a number of seconds"),
    (["slow", "1", "--rank", "0", "--for", "nan"], "--for SECONDS must be a number of seconds"),
])
def test_bad_inject_input_is_one_line_and_exit_2(run_ftrun, private_registry, args, message):
    result = run_ftrun("inject", *args, env=private_registry)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
