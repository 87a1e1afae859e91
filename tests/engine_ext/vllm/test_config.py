"""ConnectorConfig from kv_connector_extra_config: defaults per engine id, strict keys and types."""

from __future__ import annotations

import pytest

from engine_ext.vllm.config import ConnectorConfig


def test_defaults_are_per_engine_and_values_are_coerced():
    config = ConnectorConfig.from_extra(None, "e1")
    assert config.host_dir == "/dev/shm/kvrelay-e1" and config.disk_dir.endswith("kvrelay-kv-e1")
    assert config.private_host_dir
    chosen = ConnectorConfig.from_extra({"host_mb": 64, "load_ahead": 1, "host_dir": "/dev/shm/mine"}, "e1")
    assert chosen.host_mb == 64.0 and not chosen.private_host_dir
    assert config.async_loads and config.device_order  # both on by default
    assert not ConnectorConfig.from_extra({"async_loads": False}, "e1").async_loads


@pytest.mark.parametrize(("extra", "message"), [
    ({"hots_mb": 1}, "unknown kv_connector_extra_config keys ['hots_mb']"),
    ({"private_host_dir": True}, "unknown kv_connector_extra_config keys ['private_host_dir']"),
    ({"host_mb": "big"}, "host_mb must be a float"),
    ({"load_ahead": 1.5}, "load_ahead must be a int"),
    ({"load_ahead": True}, "load_ahead must be a int"),
    ({"async_loads": "no"}, "async_loads must be a bool"),
    ({"device_order": 0}, "device_order must be a bool"),
    ({"host_mb": 0, "disk_mb": 0}, "no tier"),
    ({"disk_mb": -1}, "must be >= 0"),
    ({"load_ahead": -1}, "must be >= 0"),
])
def test_bad_settings_say_what_is_wrong(extra, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ConnectorConfig.from_extra(extra, "e1")


def test_each_tensor_parallel_worker_keeps_its_shards_apart():
    config = ConnectorConfig.from_extra({"host_dir": "/dev/shm/h", "disk_dir": "/var/d"}, "e1")
    assert config.shard_dirs(0, 1) == {"host": "/dev/shm/h", "disk": "/var/d"}
    assert config.shard_dirs(1, 2) == {"host": "/dev/shm/h/tp1-of-2", "disk": "/var/d/tp1-of-2"}
    assert len({config.shard_dirs(rank, 4)["disk"] for rank in range(4)}) == 4
