"""Below FP8: weight-only layers with FP8, MXFP8/6/4 and NVFP4 weights (weight_only.py) and the per-layer choice of
weight format under a byte budget (adaptive.py)."""
