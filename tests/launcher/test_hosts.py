"""Hostfile and -H host list parsing: every accepted format and every refusal."""

from __future__ import annotations

import dataclasses
import re

import pytest

from ftrun.errors import UsageError
from ftrun.launcher.hosts import MAX_HOSTS, Host, parse_host_list, parse_hostfile, read_hostfile

pytestmark = pytest.mark.fast


def refusal(text: str, source: str = "hosts") -> str:
    """Parse ``text`` as a hostfile that must be refused; return the message."""
    with pytest.raises(UsageError) as caught:
        parse_hostfile(text, source=source)
    return str(caught.value)


def list_refusal(spec: str) -> str:
    """Parse ``spec`` as a -H list that must be refused; return the message."""
    with pytest.raises(UsageError) as caught:
        parse_host_list(spec)
    return str(caught.value)


# Accepted hostfile formats


def test_host_is_frozen_and_slots_default_to_none():
    host = Host("node1")
    assert host.slots is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        host.slots = 4  # type: ignore[misc]


def test_one_host_per_line_leaves_slots_unset():
    assert parse_hostfile("node1\nnode2\n") == [Host("node1"), Host("node2")]


def test_deepspeed_slots_syntax():
    assert parse_hostfile("node1 slots=4\nnode2 slots=8") == [Host("node1", 4), Host("node2", 8)]


def test_openmpi_slots_with_max_slots_keeps_slots():
    assert parse_hostfile("node1 slots=4 max_slots=8") == [Host("node1", 4)]


def test_openmpi_max_slots_alone_gives_the_slot_count():
    assert parse_hostfile("node1 max-slots=6\nnode2 max_slots=2") == [Host("node1", 6), Host("node2", 2)]


def test_openmpi_slots_equal_to_max_slots_is_accepted():
    assert parse_hostfile("node1 slots=4 max-slots=4") == [Host("node1", 4)]


def test_mpich_colon_syntax():
    assert parse_hostfile("node1:4\nnode2:2") == [Host("node1", 4), Host("node2", 2)]


def test_formats_mix_in_one_file_and_keep_file_order():
    text = "zeta slots=2\nalpha:3\nmid\n"
    assert parse_hostfile(text) == [Host("zeta", 2), Host("alpha", 3), Host("mid")]


def test_comments_blank_lines_and_surrounding_whitespace_are_ignored():
    text = "# cluster A\n\n   node1 slots=4   # first box\n\t\nnode2:2#tight\n   # indented comment\n  node3  \n"
    assert parse_hostfile(text) == [Host("node1", 4), Host("node2", 2), Host("node3")]


def test_windows_line_endings_are_accepted():
    assert parse_hostfile("node1 slots=1\r\nnode2\r\n") == [Host("node1", 1), Host("node2")]


def test_ip_addresses_and_dotted_names_are_host_names():
    text = "10.0.0.1 slots=2\nnode-1.cluster.local:4\ngpu_box"
    assert parse_hostfile(text) == [Host("10.0.0.1", 2), Host("node-1.cluster.local", 4), Host("gpu_box")]


def test_bracketed_ipv6_is_stored_bare_and_normalized():
    text = "[::1]:4\n[FE80:0:0::1]\n[fe80::2] slots=2"
    assert parse_hostfile(text) == [Host("::1", 4), Host("fe80::1"), Host("fe80::2", 2)]


# Hostfile refusals: each names the source, the line number and the offending text


def test_duplicate_host_names_both_lines():
    message = refusal("node1\nnode2\nnode1 slots=2")
    assert message == "hosts:3: duplicate host 'node1' (already on line 1): list each host once"


def test_duplicate_host_ignores_case():
    assert refusal("Node1\nnode1").startswith("hosts:2: duplicate host 'node1' (already on line 1)")


def test_duplicate_ipv6_in_two_spellings():
    assert refusal("[::1]\n[0:0::1]:2").startswith("hosts:2: duplicate host '::1' (already on line 1)")


def test_line_numbers_count_comments_and_blank_lines():
    assert refusal("# header\n\nnode1\nnode1").startswith("hosts:4: duplicate host 'node1' (already on line 3)")


def test_as_many_hosts_as_one_launch_holds_are_accepted_and_one_more_is_refused_at_its_line():
    names = [f"node{index}" for index in range(MAX_HOSTS + 1)]
    assert len(parse_hostfile("\n".join(names[:MAX_HOSTS]))) == MAX_HOSTS
    # 100,000 lines stop at the first one too many, before any is looked up or started
    message = refusal("\n".join(f"node{index}" for index in range(100_000)))
    assert message.startswith(f"hosts:{MAX_HOSTS + 1}: more than {MAX_HOSTS} hosts") and "scheduler mode" in message
    assert list_refusal(",".join(names)).startswith(f"-H entry {MAX_HOSTS + 1}: more than {MAX_HOSTS} hosts")


@pytest.mark.parametrize("value", ["0", "-1", "x", "4.5", "", "+4", "٤", "1025", "1" * 4300])
def test_bad_slots_value_is_refused(value):
    message = refusal(f"node1\nnode2 slots={value}")
    assert message.startswith(f"hosts:2: bad slots value {value[:20]!r}") and len(message) < 200
    assert "whole number from 1 to 1024" in message


@pytest.mark.parametrize("key", ["max_slots", "max-slots"])
def test_bad_max_slots_value_is_refused(key):
    message = refusal(f"node1 slots=2 {key}=0")
    assert message.startswith(f"hosts:1: bad {key} value '0'")


@pytest.mark.parametrize("value", ["0", "-2", "four", ""])
def test_bad_mpich_slot_count_is_refused(value):
    message = refusal(f"node1:{value}")
    assert message.startswith(f"hosts:1: bad slot count {value!r}")
    assert "whole number from 1 to 1024" in message


def test_slots_above_max_slots_is_refused():
    message = refusal("node1 slots=8 max_slots=4")
    assert message == "hosts:1: slots=8 is more than max_slots=4: lower slots or raise max_slots"


def test_slots_given_twice_is_refused():
    message = refusal("node1 slots=2 slots=4")
    assert message.startswith("hosts:1: slots given twice in 'node1 slots=2 slots=4'")


def test_colon_slots_and_slots_key_together_are_refused():
    assert refusal("node1:2 slots=4").startswith("hosts:1: slots given twice in 'node1:2 slots=4'")


def test_both_max_slots_spellings_together_are_refused():
    assert refusal("node1 max_slots=2 max-slots=4").startswith("hosts:1: max_slots given twice")


@pytest.mark.parametrize("pair", ["cpus=4", "gpus=8", "Slots=4"])
def test_unknown_key_is_refused(pair):
    message = refusal(f"node1 {pair}")
    assert message.startswith(f"hosts:1: unexpected {pair!r} after the host name")
    assert "slots=N" in message


def test_bare_word_after_host_is_refused():
    assert refusal("node1\nnode2 4").startswith("hosts:2: unexpected '4' after the host name")


@pytest.mark.parametrize("name", ["-oProxyCommand=x", ".node", "node!", "slots=4", "n@de", "user@node"])
def test_garbage_host_name_is_refused(name):
    message = refusal(f"node1\n{name}")
    assert message.startswith(f"hosts:2: {name!r} is not a host name")


@pytest.mark.parametrize("token", ["::1:4", "fe80::1", "::1"])
def test_bare_ipv6_is_refused_with_bracket_hint(token):
    message = refusal(token)
    assert message.startswith(f"hosts:1: IPv6 address {token!r} must be in brackets")
    assert "[fe80::1]:4" in message


def test_bracketed_text_that_is_not_ipv6_is_refused():
    assert refusal("[node1]:4").startswith("hosts:1: 'node1' is not an IPv6 address")


def test_malformed_brackets_are_refused():
    assert refusal("[::1]x").startswith("hosts:1: '[::1]x' is not a bracketed IPv6 address")


def test_bad_ipv6_slot_count_is_refused():
    assert refusal("[::1]:0").startswith("hosts:1: bad slot count '0'")


def test_file_without_hosts_is_refused():
    message = refusal("# nothing here\n\n")
    assert message.startswith("hosts lists no hosts")


def test_default_source_is_hostfile():
    with pytest.raises(UsageError, match=r"^hostfile:1: "):
        parse_hostfile("node1:0")


# -H host lists


def test_host_list_with_and_without_slots():
    assert parse_host_list("host1:4,host2,[::1]:2") == [Host("host1", 4), Host("host2"), Host("::1", 2)]


def test_host_list_allows_spaces_around_entries():
    assert parse_host_list(" host1:4 , host2:4 ") == [Host("host1", 4), Host("host2", 4)]


def test_host_list_single_host():
    assert parse_host_list("localhost") == [Host("localhost")]


def test_host_list_duplicate_names_both_positions():
    assert list_refusal("a:1,b:1,a:2") == "-H entry 3: duplicate host 'a' (already entry 1): list each host once"


def test_host_list_bad_slot_count_names_position():
    message = list_refusal("host1:4,host2:0")
    assert message.startswith("-H entry 2: bad slot count '0'")


def test_host_list_empty_entry_is_refused():
    assert list_refusal("host1:4,,host2").startswith("-H entry 2: empty entry: remove the extra comma")


def test_host_list_trailing_comma_is_refused():
    assert list_refusal("host1:4,").startswith("-H entry 2: empty entry")


def test_empty_host_list_is_refused():
    assert list_refusal("").startswith("-H entry 1: empty entry")


def test_host_list_refuses_hostfile_key_value_syntax():
    assert list_refusal("host1 slots=4").startswith("-H entry 1: 'host1 slots=4' is not a host name")


def test_host_list_refuses_bare_ipv6():
    assert list_refusal("host1,fe80::1:4").startswith("-H entry 2: IPv6 address 'fe80::1:4' must be in brackets")


def test_host_list_refuses_garbage_name():
    assert list_refusal("good,b@d:2").startswith("-H entry 2: 'b@d' is not a host name")


# Reading files


def test_read_hostfile_parses_file_and_names_it_in_errors(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("node1 slots=2\nnode2:4\n")
    assert read_hostfile(path) == [Host("node1", 2), Host("node2", 4)]
    path.write_text("node1\nnode1\n")
    with pytest.raises(UsageError, match=rf"^{re.escape(str(path))}:2: duplicate host 'node1'"):
        read_hostfile(str(path))


def test_read_hostfile_missing_file_is_one_line_usage_error(tmp_path):
    path = tmp_path / "nope"
    with pytest.raises(UsageError) as caught:
        read_hostfile(path)
    message = str(caught.value)
    assert message == f"cannot read hostfile {path}: No such file or directory: check the path and permissions"
    assert "\n" not in message


def test_read_hostfile_directory_is_usage_error(tmp_path):
    with pytest.raises(UsageError, match=rf"^cannot read hostfile {re.escape(str(tmp_path))}: not a regular file"):
        read_hostfile(tmp_path)


def test_read_hostfile_binary_file_is_usage_error(tmp_path):
    path = tmp_path / "hosts.bin"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UsageError, match=rf"^cannot read hostfile {re.escape(str(path))}: not UTF-8 text"):
        read_hostfile(path)
