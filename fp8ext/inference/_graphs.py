"""A decode step captured as a CUDA graph (generate's decode steps, speculative decoding's draft steps), and when
one is wanted."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _C
from .kv_cache import KVCache

__all__ = ["graph_wanted", "GraphedStep"]


def graph_wanted(cuda_graph: Optional[bool], kv_cache: Optional[str], device: torch.device, fn: str,
                 kv_overflow: Optional[str] = None) -> bool:
    """Whether decode steps run as a CUDA graph: None means wherever possible (an FP8 cache without overflow on a
    GPU)."""
    possible = kv_cache == "fp8" and kv_overflow is None and device.type == "cuda" and bool(_C.WITH_CUDA)
    if cuda_graph and not possible:
        raise ValueError(f"{fn}: cuda_graph=True needs kv_cache='fp8' on a GPU, without kv_overflow (the FP8 "
                         f"cache's kernels read the step's position from device memory); got kv_cache={kv_cache!r}, "
                         f"kv_overflow={kv_overflow!r} on {device}")
    return possible if cuda_graph is None else bool(cuda_graph)


class GraphedStep:
    """One decode step of `model` over an FP8 `cache`, captured once as a CUDA graph and replayed for every
    position: the token and the position are copied into static device tensors, which the embedding, RoPE,
    the cache store and decode attention read (start_pos as a tensor; see KVCache.append). Capture happens at
    the first call, after two eager warm-up runs of that same step (they store the same K/V at the same
    position as the replay, so they change nothing). The returned logits [batch, vocab] are overwritten by the
    next call."""

    def __init__(self, model, cache: KVCache, batch: int, device: torch.device):
        self.model, self.cache = model, cache
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph = None
        self.out = None

    def _step(self) -> torch.Tensor:
        return self.model(self.tok, kv_cache=self.cache, start_pos=self.pos)[:, -1]

    def __call__(self, tok: torch.Tensor, pos: int) -> torch.Tensor:
        if tok.shape != self.tok.shape:
            raise ValueError(f"decode step: tokens must be {list(self.tok.shape)}, got {list(tok.shape)}")
        if pos != min(self.cache.lengths) or pos >= self.cache.max_len:
            raise ValueError(f"decode step: position {pos} must continue the cache (which holds "
                             f"{min(self.cache.lengths)} of {self.cache.max_len} positions)")
        with torch.cuda.device(self.tok.device):  # capture and replay on the model's GPU, whichever is current
            self.tok.copy_(tok)
            self.pos.fill_(pos)
            if self.graph is None:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._step()
                torch.cuda.current_stream().wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=side):
                    self.out = self._step()
            self.graph.replay()
        self.cache.advance_to(pos + 1)
        return self.out
