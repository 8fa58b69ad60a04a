"""Decode attention over a KV cache (fp8ext.inference.decode_attention): defined in fp8ext/ops/attention.py, below
fp8ext.models, whose transformer calls it in its decode steps; its public names are importable here too."""

from ..ops.attention import decode_attention, decode_attention_reference

__all__ = ["decode_attention", "decode_attention_reference"]
