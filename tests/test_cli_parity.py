"""ftrun's command line against torchrun's own parser (torch.distributed.run.get_args_parser()), so that parity
cannot drift: every flag and spelling, flag or value, PET_* variable, default and abbreviation."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest
import typer
from torch.distributed.argparse_util import check_env, env
from torch.distributed.run import get_args_parser

from ftrun import cli
from ftrun.errors import UsageError

pytestmark = pytest.mark.fast

TORCHRUN = get_args_parser()
RUN = typer.main.get_command(cli.app).commands["run"]
OPTIONS = {name: param for param in RUN.params if param.param_type_name == "option"
           for name in (*param.opts, *param.secondary_opts)}
ACTIONS = [a for a in TORCHRUN._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
DEFAULTS_DIFFER = {
    "nproc_per_node": "ftrun starts one worker per visible GPU, else 1 (torchrun: 1)",
    "node_rank": "None: SLURM_NODEID under Slurm, else 0",
    "master_addr": "None: 127.0.0.1, or this machine's name with --hostfile",
    "log_line_prefix_template": "None: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else ftrun's prefix; '' is none",
    "duplicate_stdout_filters": "refused, so kept as the raw text ('' for none)",
    "duplicate_stderr_filters": "refused, so kept as the raw text ('' for none)",
}
# Where the installed torch is older than the one ftrun follows (torch 2.15): flags its torchrun lacks (back to
# 2.6, the oldest admitted), and defaults it had before. ftrun keeps the current release's; the tests then check
# them against these.
NEWER_FLAGS = {spelling for name in (
    "shutdown-timeout", "log-line-prefix-template", "print-completion", "signals-to-handle", "virtual-local-rank",
    "event-log-handler", "duplicate-stdout-filters", "duplicate-stderr-filters", "numa-binding")
    for spelling in (f"--{name}", f"--{name.replace('-', '_')}")}
OLDER_DEFAULTS = {"master_port": (29500, None)}  # (older torchrun's, the current one's): None reads as 29500
README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.mark.parametrize("action", ACTIONS, ids=[a.dest for a in ACTIONS])
def test_every_torchrun_flag_is_accepted_with_its_spellings_variable_and_default(action):
    params = {OPTIONS.get(name) for name in action.option_strings}
    assert None not in params, f"ftrun does not accept {action.option_strings}"
    assert len(params) == 1, f"{action.option_strings} are different options in ftrun"
    (param,) = params
    assert set(param.opts) == set(action.option_strings)
    assert param.is_flag == (action.nargs == 0)
    expected_env = f"PET_{action.dest.upper()}" if isinstance(action, (env, check_env)) else None
    assert param.envvar == expected_env
    if action.dest in OLDER_DEFAULTS and action.default == OLDER_DEFAULTS[action.dest][0]:
        assert param.default == OLDER_DEFAULTS[action.dest][1]
    elif action.dest not in DEFAULTS_DIFFER:
        assert param.default == action.default


def test_ftrun_has_no_torchrun_lookalike_that_torchrun_lacks():
    torchrun_names = {name for action in ACTIONS for name in action.option_strings}
    panel = {name for param in RUN.params if getattr(param, "rich_help_panel", None) == cli.TORCHRUN_PANEL
             for name in param.opts}
    assert torchrun_names <= panel and panel - torchrun_names <= NEWER_FLAGS, panel ^ torchrun_names


def argparse_reading(arg: str) -> argparse.Action | str | None:
    """The action torchrun's parser takes the option ``arg`` for, None for none, or "ambiguous"."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            found = TORCHRUN._parse_optional(arg)  # argparse's own matching, without the rest of a parse
    except SystemExit:
        assert "ambiguous option" in err.getvalue(), err.getvalue()
        return "ambiguous"
    if isinstance(found, list):  # Python 3.12.3 and later list every interpretation
        found = found[0]
    return found[0]


def ftrun_reading(arg: str, takes_value: bool) -> str:
    """The option ftrun's command line spells ``arg`` out to, or "ambiguous"."""
    try:
        return cli._spelled_out(RUN, [arg, *(["value"] if takes_value else []), "script.py"])[0]
    except UsageError as exc:
        assert str(exc).startswith(f"ambiguous option: {arg} could match "), exc
        return "ambiguous"


PREFIXES = sorted({name[:end] for action in TORCHRUN._actions for name in action.option_strings
                   if name.startswith("--") for end in range(3, len(name) + 1)})


def test_every_abbreviation_of_a_torchrun_flag_reads_as_torchrun_reads_it():
    lacking = NEWER_FLAGS - {name for action in TORCHRUN._actions for name in action.option_strings}
    for prefix in PREFIXES:
        if any(name.startswith(prefix) for name in lacking):
            continue  # ftrun reads it as the current torchrun does, which has one more flag to match
        action = argparse_reading(prefix)
        if action is None:
            continue
        if action == "ambiguous":
            assert ftrun_reading(prefix, False) == "ambiguous", prefix
        elif isinstance(action, argparse._HelpAction):
            assert ftrun_reading(prefix, False) == "--help", prefix
        else:
            assert ftrun_reading(prefix, action.nargs != 0) in action.option_strings, prefix


def test_an_abbreviation_with_its_value_after_equals_and_the_scripts_own_flags():
    assert cli._spelled_out(RUN, ["--redirect=3", "--nproc-per", "2", "train.py", "--red", "--nproc"]) == \
        ["--redirects=3", "--nproc-per-node", "2", "train.py", "--red", "--nproc"]
    assert cli._spelled_out(RUN, ["--respawn", "-r", "3", "--", "--red"]) == ["--respawn", "-r", "3", "--", "--red"]


REFUSED = [  # (flags, the one line's words, how the README's list names it)
    (["--logs-specs", "custom"], "--logs-specs is not supported", "--logs-specs"),
    (["--numa-binding", "node"], "--numa-binding is not supported", "--numa-binding"),
    (["--duplicate-stdout-filters", "loss"], "--duplicate-stdout-filters is not supported",
     "--duplicate-stdout-filters"),
    (["--duplicate-stderr-filters", "loss"], "--duplicate-stderr-filters is not supported",
     "--duplicate-stderr-filters"),
    (["--event-log-handler", "console"], "--event-log-handler console is not supported", "--event-log-handler"),
    (["--rdzv-backend", "zookeeper"], "--rdzv-backend 'zookeeper' is not supported", "--rdzv-backend"),
    (["--nproc-per-node", "xpu"], "--nproc-per-node 'xpu' is not valid", "--nproc-per-node xpu"),
    (["--print-completion", "tcsh"], "--print-completion tcsh", "--print-completion tcsh"),
]


@pytest.mark.parametrize("args, message, listed", REFUSED, ids=[args[0] for args, _, _ in REFUSED])
def test_each_refusal_is_one_line_and_listed_in_the_readme(args, message, listed, capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exited:
        cli.main([*args, str(script)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and message in err, err
    refusals = README[README.index("<!-- refusals -->"):README.index("<!-- /refusals -->")]
    assert f"`{listed}`" in refusals, f"{listed} is refused, but the README's list of refusals does not say so"
