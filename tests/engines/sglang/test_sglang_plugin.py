"""The plugin's switches (``settings.py``, no SGLang needed) and its entry point: off unless
``MOE_SBO_SGLANG=1``, and with it on, the hooks it registers in SGLang's ``HookRegistry``."""

from __future__ import annotations

import importlib.util

import pytest

from moe_sbo.engines.sglang import plugin, settings


def test_off_unless_switched_on():
    assert not settings.from_environ({}).enabled
    assert not settings.from_environ({"MOE_SBO_SGLANG": "0", "MOE_SBO_SGLANG_DISPATCHER": "moe_sbo"}).enabled
    on = settings.from_environ({"MOE_SBO_SGLANG": "1"})
    assert (on.enabled, on.dispatcher, on.overlap) == (True, "deep_ep", None)
    chosen = settings.from_environ(
        {"MOE_SBO_SGLANG": "1", "MOE_SBO_SGLANG_DISPATCHER": "moe_sbo", "MOE_SBO_SGLANG_OVERLAP": "combine_sm"}
    )
    assert (chosen.dispatcher, chosen.overlap) == ("moe_sbo", "combine_sm")


@pytest.mark.parametrize(
    "environ, words",
    [
        ({"MOE_SBO_SGLANG": "yes"}, "MOE_SBO_SGLANG must be 1"),
        ({"MOE_SBO_SGLANG_DISPATCHER": "alltoall"}, "MOE_SBO_SGLANG_DISPATCHER must be one of"),
        ({"MOE_SBO_SGLANG_DISPATCHER": "moe_sbo", "MOE_SBO_SGLANG_OVERLAP": "split"}, "two projections"),
        ({"MOE_SBO_SGLANG_DISPATCHER": "moe_sbo", "MOE_SBO_SGLANG_OVERLAP": "auto"}, "MOE_SBO_SGLANG_OVERLAP must"),
        ({"MOE_SBO_SGLANG_OVERLAP": "dispatch"}, "needs MOE_SBO_SGLANG_DISPATCHER=moe_sbo"),
    ],
)
def test_bad_settings_are_named(environ, words):
    with pytest.raises(ValueError, match=words):
        settings.from_environ({"MOE_SBO_SGLANG": "1", **environ})


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is installed by `make test-sglang`")
def test_entry_point_registers_hooks_only_when_on(monkeypatch):
    import sglang_runtime

    sglang_runtime.cpu_torchvision()
    from importlib.metadata import entry_points

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    (entry,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "moe_sbo"]
    assert entry.load() is plugin.register
    targets = set(sglang_runtime.plugin_targets())
    saved = {t: list(HookRegistry._hooks.get(t, [])) for t in targets}
    try:
        for t in targets:
            HookRegistry._hooks.pop(t, None)
        monkeypatch.delenv("MOE_SBO_SGLANG", raising=False)
        plugin.register()
        assert not any(HookRegistry._hooks.get(t) for t in targets)
        monkeypatch.setenv("MOE_SBO_SGLANG", "1")
        plugin.register()
        assert all([hook_type for hook_type, _, _ in HookRegistry._hooks[t]] == [HookType.AROUND] for t in targets)
    finally:
        for t, hooks in saved.items():
            HookRegistry._hooks[t] = hooks
