"""Each ``moe-sbo bench`` mode's options, one torch-free module per mode: ``add_arguments(parser)``."""
