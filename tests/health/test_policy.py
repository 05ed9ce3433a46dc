"""The GPU health policy: Xid table decisions, other signals, and override files."""

from __future__ import annotations

import json

import pytest

from ftrun.errors import UsageError
from ftrun.health.policy import DEFAULT_TABLE, decide, load_table, parse_action
from ftrun.health.signals import Action, HealthSignal

pytestmark = pytest.mark.fast


def xid(code: int, gpu: int = 0) -> HealthSignal:
    return HealthSignal("xid", gpu, code, "", 0.0)


@pytest.mark.parametrize(
    ("code", "action"),
    [
        (13, Action.RESTART_RANK),
        (31, Action.RESTART_RANK),
        (43, Action.IGNORE),
        (45, Action.IGNORE),
        (48, Action.EVICT_GPU),
        (63, Action.IGNORE),
        (64, Action.EVICT_GPU),
        (74, Action.EVICT_GPU),
        (79, Action.EVICT_NODE),
        (92, Action.IGNORE),
        (94, Action.RESTART_RANK),
        (95, Action.EVICT_GPU),
        (119, Action.EVICT_GPU),
        (120, Action.EVICT_GPU),
        (140, Action.EVICT_GPU),
    ],
)
def test_xid_table_follows_the_catalog(code: int, action: Action) -> None:
    decision = decide(xid(code, gpu=5))
    assert decision.action is action
    assert decision.reason.startswith(f"GPU 5: Xid {code} (")


def test_table_entries_are_actions_with_descriptions() -> None:
    for code, (action, text) in DEFAULT_TABLE.items():
        assert isinstance(code, int) and code > 0
        assert isinstance(action, Action)
        assert text and "\n" not in text


def test_unknown_xid_is_ignored_with_a_reason_to_log() -> None:
    decision = decide(xid(4242))
    assert decision.action is Action.IGNORE
    assert "4242" in decision.reason and "not in the Xid table" in decision.reason


def test_custom_table_is_used() -> None:
    table = {13: (Action.EVICT_NODE, "test")}
    assert decide(xid(13), table).action is Action.EVICT_NODE
    assert decide(xid(79), table).action is Action.IGNORE


@pytest.mark.parametrize(
    ("kind", "value", "action"),
    [
        ("ecc_uncorrected", 1, Action.EVICT_GPU),
        ("ecc_uncorrected", 0, Action.IGNORE),
        ("row_remap_failure", 1, Action.EVICT_GPU),
        ("row_remap_failure", 0, Action.IGNORE),
        ("row_remap_pending", 1, Action.IGNORE),
        ("row_remap_pending", 0, Action.IGNORE),
        ("recovery_action", 0, Action.IGNORE),
        ("recovery_action", 1, Action.EVICT_GPU),
        ("recovery_action", 2, Action.EVICT_NODE),
        ("recovery_action", 3, Action.EVICT_GPU),
        ("recovery_action", 4, Action.EVICT_GPU),
        ("recovery_action", 7, Action.EVICT_NODE),
        ("recovery_action", 99, Action.EVICT_GPU),
        ("gpu_lost", 1, Action.EVICT_NODE),
        ("thermal_wobble", 1, Action.IGNORE),
    ],
)
def test_other_signals(kind: str, value: int, action: Action) -> None:
    decision = decide(HealthSignal(kind, 2, value, "", 0.0))
    assert decision.action is action
    assert decision.reason.startswith("GPU 2: ") and "\n" not in decision.reason


def test_row_remap_pending_says_a_reset_is_needed() -> None:
    assert "reset" in decide(HealthSignal("row_remap_pending", 0, 1)).reason


def test_parse_action_names() -> None:
    assert parse_action("evict_gpu") is Action.EVICT_GPU
    assert parse_action(" Restart-Rank ") is Action.RESTART_RANK
    with pytest.raises(ValueError, match="unknown action 'reboot'"):
        parse_action("reboot")
    with pytest.raises(ValueError):
        parse_action(3)


def test_json_overrides(tmp_path) -> None:
    path = tmp_path / "health.json"
    path.write_text(json.dumps({"xid": {"13": "evict_gpu", "4242": "evict_node"}}))
    table = load_table(path)
    assert decide(xid(13), table).action is Action.EVICT_GPU
    assert decide(xid(4242), table).action is Action.EVICT_NODE
    assert decide(xid(31), table).action is Action.RESTART_RANK
    assert table[13][1] == DEFAULT_TABLE[13][1]
    assert DEFAULT_TABLE[13][0] is Action.RESTART_RANK, "the default table must not change"


def test_toml_overrides(tmp_path) -> None:
    path = tmp_path / "health.toml"
    path.write_text('[xid]\n79 = "restart_rank"\n"43" = "EVICT_GPU"\n')
    table = load_table(path)
    assert table[79][0] is Action.RESTART_RANK
    assert table[43][0] is Action.EVICT_GPU


def test_empty_override_file_keeps_the_defaults(tmp_path) -> None:
    path = tmp_path / "health.json"
    path.write_text("{}")
    assert load_table(path) == DEFAULT_TABLE


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.json", '{"xid": {"13": "reboot"}}', "Xid 13: unknown action 'reboot'"),
        ("bad.json", '{"xid": {"thirteen": "ignore"}}', "'thirteen' is not an Xid code"),
        ("bad.json", '{"xid": {"-4": "ignore"}}', "'-4' is not an Xid code"),
        ("bad.json", '{"xid": ["13"]}', "'xid' must be a table"),
        ("bad.json", '{"sxid": {}}', "unknown keys ['sxid']"),
        ("bad.json", "[1, 2]", "not a table"),
        ("bad.json", '{"xid": {"13": }', "is not valid JSON"),
        ("bad.toml", "[xid\n13 = 1", "is not valid TOML"),
        ("bad.toml", "[xid]\n13 = 1", "unknown action 1"),
    ],
)
def test_bad_override_file(tmp_path, name: str, content: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UsageError) as info:
        load_table(path)
    text = str(info.value)
    assert message in text
    assert str(path) in text
    assert "\n" not in text


def test_missing_override_file(tmp_path) -> None:
    with pytest.raises(UsageError, match="cannot read health policy file") as info:
        load_table(tmp_path / "nope.json")
    assert "\n" not in str(info.value)
