"""WorkerSettings: what the supervisor hands a worker survives JSON and is validated."""

from __future__ import annotations

import pytest

from kiamfast.server.settings import SettingsError, WorkerSettings


def test_json_round_trip_keeps_everything_including_the_key():
    s = WorkerSettings(app_port=8282, metrics_port=9191, metadata_addr="10.0.0.1:8080",
                       imdsv2="required", token_key=b"\x00\x01" * 16, wait_budget=0.2,
                       debug=True, host_ip="10.0.0.9", base_role_arn="arn:aws:iam::1:role/")
    assert WorkerSettings.from_json(s.to_json()) == s


@pytest.mark.parametrize("addr,expected", [
    ("169.254.169.254", ("169.254.169.254", 80)),
    ("127.0.0.1:1338", ("127.0.0.1", 1338)),
    ("[fd00:ec2::254]", ("fd00:ec2::254", 80)),
    ("[fd00:ec2::254]:8080", ("fd00:ec2::254", 8080)),
    ("fd00:ec2::254", ("fd00:ec2::254", 80)),
    ("http://127.0.0.1:9/", ("127.0.0.1", 9)),
])
def test_metadata_addr_forms(addr, expected):
    assert WorkerSettings(metadata_addr=addr).upstream == expected


@pytest.mark.parametrize("kw", [
    {"imdsv2": "sometimes"}, {"app_port": 0}, {"app_port": 70000}, {"wait_budget": -1},
    {"token_key": b"short"}, {"metadata_addr": ""}, {"metadata_addr": "host:port"},
    {"upstream_token_ttl": 0}, {"max_url": 0}, {"passthrough_rate": 0},
    {"passthrough_burst": 0}, {"passthrough_concurrency": 0},
])
def test_invalid_settings_are_refused(kw):
    with pytest.raises(SettingsError):
        WorkerSettings(**kw)


def test_unknown_or_malformed_json_is_refused():
    with pytest.raises(SettingsError):
        WorkerSettings.from_json('{"no_such_setting": 1}')
    with pytest.raises(SettingsError):
        WorkerSettings.from_json("[1, 2]")
    with pytest.raises(SettingsError):
        WorkerSettings.from_json("{not json")
    with pytest.raises(SettingsError):
        WorkerSettings.from_json('{"token_key": "zz"}')


def test_token_key_from_a_file(tmp_path):
    key = tmp_path / "key"
    key.write_bytes(b"k" * 32)
    assert WorkerSettings(token_key_file=str(key)).load_token_key() == b"k" * 32
    key.write_bytes(b"k")
    with pytest.raises(SettingsError):
        WorkerSettings(token_key_file=str(key)).load_token_key()
    with pytest.raises(SettingsError):
        WorkerSettings().load_token_key()


def test_metrics_port_separate_only_when_different():
    assert not WorkerSettings(app_port=8181).separate_metrics_port
    assert not WorkerSettings(app_port=8181, metrics_port=8181).separate_metrics_port
    assert WorkerSettings(app_port=8181, metrics_port=9000).separate_metrics_port
