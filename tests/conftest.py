"""Shared test helpers. GPU tests carry the `cuda` mark and skip cleanly without a CUDA device."""

import pytest
import torch

import fp8ext

HAS_CUDA = fp8ext.cuda_available() and torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and fp8ext built with CUDA")
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def pytest_collection_modifyitems(config, items):
    """Tests parametrised over devices get the `cuda` mark for their GPU instances."""
    for item in items:
        params = item.callspec.params.values() if hasattr(item, "callspec") else ()
        if any(isinstance(v, str) and v == "cuda" for v in params):
            item.add_marker(pytest.mark.cuda)


def bytes_of(q: torch.Tensor) -> torch.Tensor:
    """The raw bytes of an FP8 tensor, on the CPU."""
    return q.view(torch.uint8).cpu()


def assert_same_bytes(got: torch.Tensor, want, what: str = ""):
    """Byte-for-byte equality; on failure, report the first mismatches with their inputs' context."""
    g = bytes_of(got).numpy().reshape(-1)
    w = want.view(torch.uint8).cpu().numpy().reshape(-1) if isinstance(want, torch.Tensor) else want.reshape(-1)
    bad = (g != w).nonzero()[0]
    assert bad.size == 0, f"{what}: {bad.size} of {g.size} bytes differ; first at {bad[:8].tolist()}: " \
                          f"got {[hex(v) for v in g[bad[:8]]]}, want {[hex(v) for v in w[bad[:8]]]}"
