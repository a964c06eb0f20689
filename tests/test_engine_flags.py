"""The engine's on/off flags: each reaches EngineConfig through the shared CLI arguments, and a
value that is not a bool is refused with one clear error."""

import argparse

import pytest

from ssdlib.cli_args import add_engine_args, engine_kwargs
from ssdlib.engine_config import EngineConfig
from ssdlib.errors import ConfigError


@pytest.mark.parametrize("flag,field", [("adaptive-k", "adaptive_k"),
                                        ("fan-out-tuning", "fan_out_tuning")])
def test_flag_and_config(flag, field):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))[field] is True
    assert engine_kwargs(p.parse_args([f"--no-{flag}"]))[field] is False
    assert getattr(EngineConfig(), field) is True
    with pytest.raises(ConfigError, match=f"{field} must be True or False"):
        EngineConfig(**{field: "yes"})
