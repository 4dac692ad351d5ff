"""Config schema: defaults, file values, overrides, and errors naming file, key and value."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from engramd.client.errors import ConfigError
from engramd.server.config import SETTINGS, build_config, describe_settings, dump_toml, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "engramd.toml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path):
    path = write(tmp_path, 'backend = "cpu"\nworkers = 3\nheartbeat_interval = 2\n')
    config = load_config(path, {"workers": 5, "socket": None})
    assert (config.backend, config.workers, config.heartbeat_interval) == ("cpu", 5, 2.0)
    assert config.tables == "demo"


@pytest.mark.parametrize("text, key, value", [
    ('backend = "tpu"', "backend", "tpu"),
    ("workers = 0", "workers", "0"),
    ('workers = "2"', "workers", "'2'"),
    ("max_slots = 1000", "max_slots", "1000"),
    ('instance = "a/b"', "instance", "'a/b'"),
    ("workers = true", "workers", "True"),
    ("colour = 3", "colour", "3"),
])
def test_bad_field_names_file_key_and_value(tmp_path, text, key, value):
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and repr(key) in message and value in message


def test_unreadable_and_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "backend = \n"))
    not_utf8 = tmp_path / "latin1.toml"
    not_utf8.write_bytes(b'\xff\xfe\x00backend = "cpu"\n')  # raised UnicodeDecodeError
    with pytest.raises(ConfigError, match="latin1.toml: not valid TOML"):
        load_config(not_utf8)


def test_bad_override_names_the_flag():
    with pytest.raises(ConfigError, match="--max-tokens"):
        build_config({}, "f", {"max_tokens": -4})


def test_shipped_configs_validate():
    files = sorted(CONFIGS.glob("*.toml"))
    assert files, "configs/ holds example configs"
    for path in files:
        load_config(path)


def test_every_setting_documented_and_dump_round_trips(tmp_path):
    text = describe_settings()
    assert tomllib.loads(text) == {s.key: s.default for s in SETTINGS}, "the docs are TOML of the defaults"
    for s in SETTINGS:
        assert s.doc and f"# {s.doc}\n{s.key} = " in text
    config = build_config({"workers": 7, "tables": "/x/y"}, "t")
    again = load_config(write(tmp_path, dump_toml(config)))
    assert again == config


def test_demo_config_sets_every_setting_and_loads():
    """configs/demo.toml is where operators read what each setting does: none may be missing."""
    path = CONFIGS / "demo.toml"
    written = set(tomllib.loads(path.read_text()))
    assert written == {s.key for s in SETTINGS}, {
        "missing": sorted({s.key for s in SETTINGS} - written), "unknown": sorted(written - {s.key for s in SETTINGS})}
    load_config(str(path), {})


def test_uid_in_the_instance_gives_each_user_their_own_table_folder(tmp_path):
    """The demo's instance is per user: its table folder in a shared /dev/shm belongs to whoever
    made it first, so a second user running the same config would be refused."""
    uid = os.geteuid()
    assert load_config(CONFIGS / "demo.toml").instance == f"demo-{uid}"
    assert load_config(None, {"instance": "a{uid}b{uid}"}).instance == f"a{uid}b{uid}"
    with pytest.raises(ConfigError, match="instance"):
        load_config(write(tmp_path, 'instance = "{user}"\n'))


@pytest.mark.parametrize("key, value, form", [
    ("metrics_address", "", "HOST:PORT"),
    ("client_modes", "served;mapped", "comma-separated"),
])
def test_a_value_of_the_wrong_form_is_told_the_form(key, value, form):
    """A setting checked by a pattern says, in words, what form it takes (the pattern alone
    left a reader to decode a regular expression)."""
    with pytest.raises(ConfigError, match=form):
        build_config({}, "f", {key: value})
