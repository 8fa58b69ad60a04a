"""Which of a model's modules a conversion leaves in high precision, by name: fp8ext.inference's quantize_model and
fp8ext.lowp's per-layer precision (fp8ext.adaptive) take the same `ignore` lists and read them the same way.

    ignored("model.lm_head", DEFAULT_IGNORE)     # True: the name ends with an ignored name
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["DEFAULT_IGNORE", "ignored"]

DEFAULT_IGNORE = ("lm_head", "embed", "embed_tokens", "output")  # the output head and embeddings


def ignored(name: str, ignore: Sequence[str]) -> bool:
    """Whether the module `name` is named by `ignore`: it is one of its names, ends with "." and one (a child of
    that name anywhere), or starts with one and "." (inside that module)."""
    return any(name == i or name.endswith("." + i) or name.startswith(i + ".") for i in ignore)
