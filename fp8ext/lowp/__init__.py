"""Below FP8: weight-only layers with FP8, MXFP8/6/4 and NVFP4 weights (weight_only.py) and the per-layer choice of
weight format under a byte budget (adaptive.py, with its formats in weight_formats.py, its model passes in
evaluation.py and its plans in plan.py)."""
