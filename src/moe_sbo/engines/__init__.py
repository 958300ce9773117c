"""``moe_sbo.engines``: plugins that let serving engines call moe-sbo — ``vllm`` (a
``vllm.general_plugins`` entry point) and ``sglang`` (a ``sglang.srt.plugins`` entry point). Each
engine is imported only inside its own subpackage, so moe-sbo imports without either installed.
"""
