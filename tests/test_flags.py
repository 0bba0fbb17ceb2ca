"""Config's fields are the flags: each declares its help once, and --help shows them all."""

from __future__ import annotations

import dataclasses
import re

import pytest

from batchserve.cli import _cost_pair, _octal, _on_off, build_parser, config_flags, config_from_args
from batchserve.config import FLAG_GROUPS, Config, setting
from batchserve.errors import StartupError

FLAG = re.compile(r"--[a-z][a-z0-9-]*[a-z0-9]")


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def help_text(monkeypatch: pytest.MonkeyPatch) -> str:
    """--help as printed, unwrapped (a wrap may break a line at a hyphen: --sim-/latency)."""
    monkeypatch.setenv("COLUMNS", "100000")
    return build_parser().format_help()


def test_every_field_is_a_flag_or_says_it_is_not():
    flags = {flag.field.name for flag in config_flags()}
    for field in dataclasses.fields(Config):
        assert "help" in field.metadata, f"{field.name}: declare it with config.setting"
        assert field.metadata["help"].strip(), f"{field.name}: its help is empty"
        assert (field.name in flags) == field.metadata["flag"], field.name


def test_help_lists_every_field_with_its_own_help_and_env(help_text: str):
    text = words(help_text)
    for flag in config_flags():
        assert f"--{flag.name}" in text
        assert words(flag.field.metadata["help"]) in text
        assert f"env BATCHSERVE_{flag.field.name.upper()})" in text


def test_help_names_no_stale_flag(help_text: str):
    real = {option for action in build_parser()._actions for option in action.option_strings}
    named = set(FLAG.findall(help_text))
    for flag in config_flags():
        named |= set(FLAG.findall(flag.field.metadata["help"]))
    assert named - real == set()
    assert {"--uds-mode", "--sim-hang-ms", "--keys-file"} <= named  # the pattern finds them


def test_a_flag_reads_its_field_by_type_and_choices_come_from_the_field():
    flags = {flag.field.name: flag for flag in config_flags()}
    assert flags["tcp"].read is _on_off
    assert flags["uds_mode"].read is _octal
    assert flags["sim_cost"].read is _cost_pair
    assert flags["sim_step_ms"].read is _cost_pair
    assert flags["port"].read is int
    assert flags["max_linger_ms"].read is float
    assert flags["fn"].read is str
    assert flags["policy"].read is str
    actions = {action.dest: action for action in build_parser()._actions}
    assert actions["policy"].choices == ("adaptive", "fixed")
    assert actions["generate_mode"].choices == ("continuous", "static")
    assert actions["port"].choices is None


@dataclasses.dataclass(frozen=True, kw_only=True)
class WithANote(Config):
    note: str = setting("", help="set by tests only: the command line cannot", flag=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WithAList(Config):
    sizes: list[int] | None = setting(None, help="no flag reads a list")


def test_a_field_marked_not_a_flag_stays_off_the_command_line():
    names = [flag.name for flag in config_flags(WithANote)]
    assert "note" not in names
    assert names == [flag.name for flag in config_flags()]


def test_a_field_no_flag_can_read_fails_when_the_flags_are_built():
    with pytest.raises(TypeError, match=r"Config\.sizes: no flag reads a list"):
        config_flags(WithAList)


def test_metrics_max_age_parses_and_its_help_says_what_may_be_old(help_text: str):
    assert config_from_args([])[0].metrics_max_age_ms == 500.0
    assert config_from_args(["--metrics-max-age-ms", "0"])[0].metrics_max_age_ms == 0.0
    assert config_from_args(["--metrics-max-age-ms", "2000"])[0].metrics_max_age_ms == 2000.0
    text = words(help_text)
    assert "--metrics-max-age-ms METRICS_MAX_AGE_MS how old /metrics' counters" in text
    assert "0 renders everything at every scrape (default: 500.0;" in text
    with pytest.raises(StartupError, match="metrics_max_age_ms must be 0 or more"):
        Config(metrics_max_age_ms=-1.0)


def test_every_flag_is_in_one_help_group_and_help_shows_the_groups(help_text: str):
    """--help reads in groups (config.FLAG_GROUPS): a new field must join exactly one."""
    grouped = [field for _, fields in FLAG_GROUPS.values() for field in fields]
    flags = [flag.field.name for flag in config_flags()]
    assert sorted(grouped) == sorted(flags), set(grouped) ^ set(flags)
    titles = re.findall(r"^([a-z]+):$", help_text, re.M)
    assert titles == ["options", *FLAG_GROUPS]
    for name, (_, fields) in FLAG_GROUPS.items():
        section = help_text.split(f"\n{name}:\n", 1)[1].split(":\n\n", 1)[0]
        assert f"--{fields[0].replace('_', '-')} " in section
