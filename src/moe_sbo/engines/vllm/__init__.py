"""``moe_sbo.engines.vllm``: the vLLM plugin (a ``vllm.general_plugins`` entry point, ``plugin.register``).

::

    settings.py           MOE_SBO_VLLM and its companions, read in one place (no vLLM import)
    plugin.py             the entry point: a no-op unless MOE_SBO_VLLM=1
    deep_ep_alias.py      the ``deep_ep`` module vLLM's DeepEP classes import: moe_sbo.deep_ep's Buffer
                          on the EP group's device group
    prepare_finalize.py   MoeSboPrepareAndFinalize, vLLM's modular-kernel prepare/finalize over any
                          moe-sbo dispatcher, with SBO through the six hook events
    selection.py          puts the above where vLLM's own backend selection looks for its DeepEP classes

The hard part is that vLLM 0.33.0 has no registry for prepare/finalize classes: its selection
(``all2all_utils.maybe_make_prepare_finalize``) picks from a fixed list by ``--all2all-backend``. The
plugin answers to the two DeepEP names of that list and changes nothing else. Every module but
``settings`` and ``plugin`` imports vLLM; docs/ENGINES.md says what is supported and tested.
"""
