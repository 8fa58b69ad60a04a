"""Models built from fp8ext's layers: a dense transformer (fp8ext.models.transformer)."""

__all__ = ["Transformer", "TransformerConfig", "PRESETS", "preset"]


def __getattr__(name):
    # imported on first use, so that `python -m fp8ext.models.transformer` runs the module once
    if name in __all__:
        from . import transformer
        return getattr(transformer, name)
    raise AttributeError(f"module 'fp8ext.models' has no attribute {name!r}")
