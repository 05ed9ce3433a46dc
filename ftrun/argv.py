"""The launcher's arguments as torchrun's argparse parser reads them, before click parses them.

argparse accepts any unique prefix of a long option (``--redirect=3``, ``--nproc-per 2``); click accepts exact
names only. :func:`expand_abbreviations` spells such prefixes out, with argparse's rules, for torchrun's flags.
ftrun's own flags are exact-only: a prefix that would match both (``--re``: ``--redirects`` or ``--respawn``)
keeps torchrun's meaning. Pure functions, tested against ``torch.distributed.run.get_args_parser()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ftrun.errors import UsageError


def resolve_abbreviation(name: str, abbreviable: Sequence[str]) -> str | None:
    """The long option ``name`` abbreviates among ``abbreviable``, as argparse resolves it: the option itself
    when exact, the one option starting with it, None when none does; UsageError when several do."""
    if name in abbreviable:
        return name
    matches = [option for option in abbreviable if option.startswith(name)]
    if len(matches) > 1:
        raise UsageError(f"ambiguous option: {name} could match {', '.join(matches)}")
    return matches[0] if matches else None


def expand_abbreviations(args: list[str], takes_value: Mapping[str, bool], abbreviable: Sequence[str]) -> list[str]:
    """``args`` with each abbreviated long option of ``abbreviable`` written out in full, up to the script.

    ``takes_value`` tells, for every option the command knows, whether it takes a value (so that a value is
    not taken for the script). The script is the first argument that is neither an option nor an option's
    value; it, ``--`` and everything after them are the script's and stay as they are.
    """
    expanded: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            return expanded + args[index:]
        name, equals, value = arg.partition("=")
        if name.startswith("--") and name not in takes_value:
            name = resolve_abbreviation(name, abbreviable) or name
        expanded.append(name + equals + value)
        if takes_value.get(name) and not equals and index + 1 < len(args):
            expanded.append(args[index + 1])
            index += 1
        index += 1
    return expanded
