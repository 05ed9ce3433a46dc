"""Bad input, wherever it comes in (flags, files, environment), is refused in one line with exit code 2."""

from __future__ import annotations

import os
import selectors

import pytest

from conftest import EXAMPLE
from ftrun import flag_values, protocol, registry
from ftrun.errors import UsageError
from ftrun.store import auth

HUGE = "9" * 4300  # past the 4,300 digits Python's int() takes: parsing it must not raise
POSITIVE = "must be a positive number of seconds, at most 1,000,000, not"  # flag_values.seconds, MAX_SECONDS
NOT_NEGATIVE = "must be 0 or more seconds, at most 1,000,000, not"


def policy(name: str, content: bytes):
    """An --xid-policy file written into the test's directory: returns a function of that directory."""

    def write(folder) -> str:
        path = folder / name
        path.write_bytes(content)
        return str(path)

    return write


def fifo(name: str):
    """A FIFO in the test's directory that nobody writes: opening it to read would wait for ever."""

    def make(folder) -> str:
        path = folder / name
        os.mkfifo(path)
        return str(path)

    return make


ETCD = ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1:1"]


@pytest.mark.parametrize("args, message", [
    (["--master-port", "70000"], "--master-port 70000: a port is between 1 and 65535"),
    (["--master-port", "-1"], "--master-port -1: a port is between 1 and 65535"),
    (["--rdzv-endpoint", "localhost:70000"], "is not HOST:PORT with a port from 1 to 65535"),
    (["--rdzv-endpoint", "localhost:" + HUGE], "is not HOST:PORT with a port from 1 to 65535"),
    (["-H", f"localhost:{HUGE}"], "-H entry 1: bad slot count '99999999999999999999': use a whole number from 1"),
    (["-H", ""], "-H entry 1: empty entry"),
    (["--hostfile", ""], "cannot read hostfile : "),
    (["--hostfile", fifo("hosts")], ": not a regular file: check the path"),  # not waited on
    (["--hostfile", "/dev/zero"], "cannot read hostfile /dev/zero: not a regular file"),  # not read without end
    (["--hostfile", policy("long", b"a" * 300)], "'aaaa" + "a" * 56 + "'... is not a host name: use at most 253"),
    (["--xid-policy", fifo("policy.json")], ": not a regular file"),
    (["--xid-policy", "/dev/zero"], "cannot read health policy file /dev/zero: not a regular file"),
    (["--xid-policy", ""], "cannot read health policy file .: not a regular file"),
    (["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:" + HUGE], "expected etcd endpoints HOST:PORT"),
    ([*ETCD, "--rdzv-conf", "user=u,password_file=/dev/zero"], "password_file=/dev/zero: not a readable file (not a"),
    ([*ETCD, "--rdzv-conf", lambda folder: "user=u,password_file=" + policy("pw", b"\xff\xfe")(folder)],
     "not a readable file (not UTF-8 text)"),
    ([*ETCD, "--rdzv-conf", lambda folder: "protocol=https,cacert=" + fifo("ca.pem")(folder)],
     "not a readable file (not a regular file)"),
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
    (["--monitor-interval", "nan"], f"--monitor-interval {POSITIVE} nan"),
    (["--monitor-interval", "inf"], f"--monitor-interval {POSITIVE} inf"),
    (["--monitor-interval", "1e20"], f"--monitor-interval {POSITIVE} 1e+20"),
    (["--node-timeout", "nan"], f"--node-timeout {POSITIVE} nan"),
    (["--hang-timeout", "nan"], f"--hang-timeout {POSITIVE} nan"),
    (["--hang-timeout", "2e6"], f"--hang-timeout {POSITIVE} 2e+06"),
    (["--recovery-timeout", "-1"], "--recovery-timeout must be a positive number of seconds"),
    (["--join-timeout", "-1"], "--join-timeout must be a positive number of seconds"),
    (["--shutdown-timeout", "nan"], f"--shutdown-timeout {NOT_NEGATIVE} nan"),
    (["--shutdown-timeout", "1e7"], f"--shutdown-timeout {NOT_NEGATIVE} 1e+07"),
    (["y" * 256], f"script {'y' * 256!r} not found"),  # a name too long to look up: not there, as a missing one
    (["--rdzv-conf", "bind=somewhere"], "--rdzv-conf bind=somewhere: give an IP address of this machine"),
    (["--rdzv-conf", "bind=224.0.0.1"], "--rdzv-conf bind=224.0.0.1: give an IP address of this machine"),
    (["--rdzv-conf", "bind=255.255.255.255"], "bind=255.255.255.255: give an IP address of this machine"),
    (["--rdzv-conf", "x" * 5000], "--rdzv-conf 'xxxxxxxx"),
    (["--rdzv-conf", "=1"], "--rdzv-conf '=1' is not valid"),
    (["--rdzv-conf", "join_timeout=soon"], "--rdzv-conf join_timeout=soon: give the seconds the nodes have to arrive"),
    (["--rdzv-conf", "join_timeout=-5"], "--rdzv-conf join_timeout must be a positive number of seconds"),
    (["--rdzv-conf", "join_timeout=inf"], "--rdzv-conf join_timeout must be a positive number of seconds"),
    (["--rdzv-conf", "join_timeout=1e9"], "--rdzv-conf join_timeout must be a positive number of seconds, at most"),
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
    ({"FTRUN_SECRET_FILE": "/"}, "FTRUN_SECRET_FILE /: not a regular file"),
    ({"FTRUN_SECRET_FILE": "/proc/self/mem"}, "FTRUN_SECRET_FILE /proc/self/mem: cannot read it"),
])
def test_bad_environment_is_one_line_and_exit_2(run_ftrun, env, message):
    result = run_ftrun(EXAMPLE, env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_a_secret_file_that_is_a_fifo_is_refused_in_one_line_rather_than_waited_on(run_ftrun, tmp_path):
    fifo = tmp_path / "secret"
    os.mkfifo(fifo, 0o600)  # opening it to read would wait for a writer that never comes
    result = run_ftrun(EXAMPLE, env={"FTRUN_SECRET_FILE": str(fifo)})
    assert result.returncode == 2 and result.stderr == f"ftrun: error: FTRUN_SECRET_FILE {fifo}: not a regular " \
        "file; give the file that holds the run's secret\n", result.stderr


def test_more_visible_gpus_than_one_node_may_run_workers_is_one_line_not_as_many_workers(run_ftrun):
    many = ",".join(map(str, range(2000)))
    for args in ((), ("--nproc-per-node", "gpu")):
        result = run_ftrun(*args, EXAMPLE, env={"CUDA_VISIBLE_DEVICES": many})
        assert result.returncode == 2 and result.stderr == "ftrun: error: 2000 GPUs are visible (CUDA_VISIBLE_DEVICES), " \
            "more than the 1024 workers one node may run: give --nproc-per-node\n", result.stderr


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
    (["chaos", "--mtbf", "nan", "--duration", "5"], f"--mtbf {POSITIVE} nan"),
    (["chaos", "--mtbf", "inf", "--duration", "5"], f"--mtbf {POSITIVE} inf"),
    (["chaos", "--mtbf", "1", "--duration", "nan"], f"--duration {POSITIVE} nan"),
    (["chaos", "--mtbf", "1", "--duration", "1e20"], f"--duration {POSITIVE} 1e+20"),
    (["xid", "٧٩", "--rank", "0"], "xid CODE: expected an Xid code"),
    (["xid", HUGE, "--rank", "0"], "xid CODE: expected an Xid code"),
    (["slow", "nan", "--rank", "0"], f"slow SECONDS {NOT_NEGATIVE} nan"),
    (["slow", "1e20", "--rank", "0"], f"slow SECONDS {NOT_NEGATIVE} 1e+20"),
    (["slow", "1", "--rank", "0", "--for", "nan"], f"--for {POSITIVE} nan"),
    (["kill", "--rank", "0", "--endpoint", "127.0.0.1:" + HUGE + "9"], "expected HOST:PORT with a port from 1"),
])
def test_bad_inject_input_is_one_line_and_exit_2(run_ftrun, private_registry, args, message):
    result = run_ftrun("inject", *args, env=private_registry)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_a_path_too_long_to_look_up_is_one_line_wherever_it_is_given(run_ftrun, private_registry, tmp_path):
    """A name past the system's 255 bytes (ENAMETOOLONG) is a path with nothing there, not a traceback."""
    long = str(tmp_path / ("z" * 256))
    for args, code, words in ((["--resume-from", long, EXAMPLE], 2, f"--resume-from {long}: no saved state there"),
                              (["status", "--log-dir", long], 3, f"--log-dir {long}: no such directory"),
                              (["report", long], 3, f"{long}: no such directory"),
                              (["report", "--log-dir", long, "some-run"], 3, f"{long}: no such directory")):
        result = run_ftrun(*args, env=private_registry)
        assert result.returncode == code and result.stderr.startswith(f"ftrun: error: {words}"), (args, result)
        assert result.stderr.count("\n") == 1 and result.stdout == "", (args, result)


@pytest.mark.fast
def test_the_longest_duration_a_flag_takes_is_one_every_wait_can_make_twice_over():
    """A wait of twice MAX_SECONDS is one the system takes (a longer one raises OverflowError, as
    --monitor-interval 1e20 did in the agent's loop); MAX_SECONDS itself is accepted, and a hair more is not."""
    read, write = os.pipe()
    try:
        os.write(write, b"x")  # readable: the select answers at once if its timeout is one it takes
        with selectors.DefaultSelector() as selector:
            selector.register(read, selectors.EVENT_READ)
            assert len(selector.select(2 * protocol.MAX_SECONDS)) == 1
    finally:
        os.close(read)
        os.close(write)
    assert flag_values.seconds("--hang-timeout", protocol.MAX_SECONDS) == protocol.MAX_SECONDS
    assert flag_values.seconds("--shutdown-timeout", 0.0, zero=True) == 0.0
    for value, zero in ((protocol.MAX_SECONDS * 1.000001, False), (0.0, False), (-0.001, True)):
        with pytest.raises(UsageError):
            flag_values.seconds("--flag", value, zero=zero)


def test_a_registry_entry_that_is_a_fifo_is_skipped_rather_than_waited_on(run_ftrun, private_registry):
    """`ftrun status` and `ftrun inject` read every entry of the registry: a FIFO there held them for ever."""
    folder = registry.private_dir(registry.registry_dir())
    os.mkfifo(folder / "r1_abcdef12.json", 0o600)
    for args in (["status"], ["status", "--json"], ["inject", "kill", "--rank", "0"]):
        result = run_ftrun(*args, env=private_registry, timeout=30)
        assert result.returncode == 3 and result.stderr.startswith("ftrun: error: no ftrun job is running on this "
                                                                   "machine"), (args, result)
        assert result.stderr.count("\n") == 1, (args, result)


def test_an_endpoint_whose_host_cannot_be_looked_up_is_one_line(run_ftrun, private_registry, tmp_path):
    """A host name the idna codec refuses (a label over 63 characters) was a UnicodeError traceback."""
    secret = tmp_path / "secret"
    auth.write_secret_file(secret, "ab" * 32)
    result = run_ftrun("status", "--endpoint", "x" * 100 + ":1", "--secret-file", secret, env=private_registry)
    assert result.returncode == 3 and result.stderr.count("\n") == 1, result
    assert f"cannot reach a job at {'x' * 100}:1: not a host name that can be looked up" in result.stderr, result


def test_resuming_from_rescue_files_that_are_not_regular_files_is_one_line(run_ftrun, tmp_path):
    """A FIFO named like a rescue file passed the check of --resume-from, then held every worker for ever."""
    os.makedirs(tmp_path / "run" / "rescue")
    os.mkfifo(tmp_path / "run" / "rescue" / "0.pt")
    (tmp_path / "run" / "rescue" / "1.pt").mkdir()
    result = run_ftrun("--resume-from", tmp_path / "run", EXAMPLE, timeout=30)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result
    assert result.stderr.startswith(f"ftrun: error: --resume-from {tmp_path / 'run'}: no saved state there"), result
