"""The ``moe-sbo`` command line: one module per subcommand (``main.py`` dispatches)."""
