"""``moe_sbo.engines.sglang``: SGLang's ``--moe-a2a-backend deepep`` on moe-sbo (docs/ENGINES.md).

``settings`` (the ``MOE_SBO_SGLANG*`` variables, no SGLang import), ``plugin`` (the
``sglang.srt.plugins`` entry point: its hooks), ``buffer`` (SGLang's DeepEP module on
``moe_sbo.deep_ep.Buffer``), ``dispatcher`` (moe-sbo's ``BaseDispatcher``: SGLang's DeepEP formats,
moe-sbo's hook events and SBO modes) and ``tbo`` (SGLang's two-batch-overlap holder of it). All but
``settings`` and ``plugin`` import SGLang at import.
"""
