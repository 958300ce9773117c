"""FP8 formats (``fp8``: e4m3 with 1x128 activation and 128x128 weight block scales) and the Triton
kernels that quantise activations (``kernels``), used by the FP8 dispatch and the FP8 experts alike."""
