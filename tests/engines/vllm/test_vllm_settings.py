"""The vLLM plugin's switch and variables (``settings.py``, ``plugin.register``): these need no vLLM,
so they run in the main test environment too."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_sbo.engines.vllm.settings import PluginSettings, read_settings


def test_off_unless_switched_on():
    assert read_settings({}) == PluginSettings(enabled=False)
    assert read_settings({"MOE_SBO_VLLM": "0", "MOE_SBO_VLLM_DISPATCHER": "node_aware"}).enabled is False


def test_on_with_choices():
    env = {
        "MOE_SBO_VLLM": "1",
        "MOE_SBO_VLLM_MODE": "deep_ep",
        "MOE_SBO_VLLM_DISPATCHER": "low_latency",
        "MOE_SBO_VLLM_OVERLAP": "none",
    }
    assert read_settings(env) == PluginSettings(True, "deep_ep", "low_latency", "none")
    assert read_settings({"MOE_SBO_VLLM": "1"}) == PluginSettings(True, "native", "alltoall", "combine")


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("MOE_SBO_VLLM", "yes", "MOE_SBO_VLLM must be 1"),
        ("MOE_SBO_VLLM_MODE", "fast", "MOE_SBO_VLLM_MODE must be one of"),
        ("MOE_SBO_VLLM_DISPATCHER", "local", "MOE_SBO_VLLM_DISPATCHER must be one of"),
        ("MOE_SBO_VLLM_OVERLAP", "dispatch", "need them inside the prepare/finalize"),
    ],
)
def test_bad_values_are_named(name, value, message):
    with pytest.raises(ValueError, match=message):
        read_settings({"MOE_SBO_VLLM": "1", name: value})


def test_register_does_nothing_when_off():
    """Off, the entry point imports no vLLM and installs no ``deep_ep`` (a fresh interpreter)."""
    script = (
        "import os, sys\n"
        "os.environ.pop('MOE_SBO_VLLM', None)\n"
        "from moe_sbo.engines.vllm.plugin import register\n"
        "register()\n"
        "print('deep_ep' in sys.modules, 'vllm' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]
