"""``moe-sbo bench <mode>``'s runners, one module per mode (``sbo``, ``tbo``, ``eplb``), each with
``main(args) -> int``; ``common`` holds what a mode's rank functions share, ``sweep`` the launching
side's steps, checks and wire. The command line (``cli.parsers.bench``) names each mode's parser and
runner and imports the runner only when that mode runs. A tool room: it imports the core, ``measure``,
``launch``, ``hf`` and ``planner``, never ``cli``; nothing imports it but ``cli``.
"""
