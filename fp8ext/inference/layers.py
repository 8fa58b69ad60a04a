"""FP8InferenceLinear: a linear layer for serving that holds only its E4M3 weight and scales.

The weight is quantized once, offline; no high-precision copy stays in memory, so weight memory halves against
bf16 (plus one float32 scale per tensor, per output channel, or per 128 x 128 block). Names and meanings follow
the compressed-tensors checkpoint layout that vLLM and transformers load: `weight_scale` and `input_scale`
*dequantize* (w ~= weight * weight_scale, x ~= q * input_scale), i.e. they are fp8ext's scale_inv.

Weights (`weights=`): "tensor" (one scale), "channel" (one per output row, weight_scale [out, 1]), "block128"
(128 x 128 blocks, DeepSeek-V3's layout, weight_scale [ceil(out/128), ceil(in/128)]).
Activations (`activations=`): "static" (one calibrated per-tensor input_scale [1]) or "dynamic" (per token, or
per 1 x 128 group with block weights, computed from each input as it arrives). Block weights take dynamic
activations only: cuBLASLt pairs 128 x 128 weight blocks with 1 x 128 activation blocks.

Both GEMM operands are fp8ext.FP8Tensor (fp8ext/core/tensor.py): `weight_fp8` views the registered buffers (which
stay what state_dict, .to() and the checkpoint layouts see), and the activation is cast into one per call, or
arrives as an FP8Activation (an FP8Tensor made by a fused norm or SwiGLU kernel).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops import fused
from ..core.formats import E4M3
from ..core.tensor import BLOCK_1x128, BLOCK_128x128, ROW, TENSOR, FP8Tensor, Quantizer
from ..ops.mx import refuse_non_finite
from ..modules.normalization import RMSNorm
from ..ops import quantize, quantize_blockwise, quantize_rowwise, scale_buffer, scale_from_amax, scale_inv_view
from ..ops import quantize_blocks_eager, quantize_eager
from ..ops.matmul import direct_gemm_ok, epilogue_bias_dtype, gemm, gemm_with_weight, weight_capsules

__all__ = ["FP8InferenceLinear", "FP8Activation", "FP8InputRMSNorm", "WEIGHT_SCHEMES", "ACTIVATION_SCHEMES"]

WEIGHT_SCHEMES = ("tensor", "channel", "block128")
_LAYOUTS = {"tensor": TENSOR, "channel": ROW, "block128": BLOCK_128x128}  # weight scheme -> FP8Tensor scale layout
ACTIVATION_SCHEMES = ("static", "dynamic")


def _check_schemes(weights: str, activations: str, fn: str) -> None:
    if weights not in WEIGHT_SCHEMES:
        raise ValueError(f"{fn}: weights must be one of {WEIGHT_SCHEMES}, got {weights!r}")
    if activations not in ACTIVATION_SCHEMES:
        raise ValueError(f"{fn}: activations must be one of {ACTIVATION_SCHEMES}, got {activations!r}")
    if weights == "block128" and activations == "static":
        raise ValueError(f"{fn}: block128 weights take dynamic activations only (cuBLASLt pairs 128x128 weight "
                         "blocks with 1x128 activation blocks)")


def _layout(scale_inv: torch.Tensor) -> str:
    """The FP8Tensor layout of an activation's scale_inv: one element, or one per row."""
    return TENSOR if scale_inv.dim() == 0 else ROW


class FP8Activation(FP8Tensor):
    """An activation already quantized for an FP8InferenceLinear by a fused kernel (RMSNorm or SwiGLU writing
    E4M3 directly): an FP8Tensor (`data` [rows, in_features] E4M3, `scale_inv` the dequantizing scales in the
    layout the layer's GEMM takes, no transposed copy) that stands in for the high-precision activation it
    replaces: `shape`, `dtype`, `device` and dim() are that activation's (not data's). Made by
    FP8InferenceLinear.quantize_input; only the layer that made it (or layers with the same input scheme)
    should take it."""

    __slots__ = ("shape", "dtype", "device", "scheme")

    def __init__(self, data, scale_inv, shape, dtype, scheme):
        super().__init__(data, None, scale_inv, E4M3, _layout(scale_inv))
        self.shape, self.dtype, self.device, self.scheme = shape, dtype, data.device, scheme

    def dim(self) -> int:
        return len(self.shape)


class FP8InferenceLinear(nn.Module):
    """y = x W^T + b with W held as E4M3 bytes and scales (see the module docstring). Inference only: the
    buffers carry no gradient."""

    # cuBLASLt's fast accumulation: the tensor cores' partial sums are not promoted to float32 every few
    # K-blocks. Transformer Engine uses it in forward passes and vLLM's FP8 GEMMs on Hopper do; it made the
    # 1b preset's prefill about 8 % faster on an H100. On by default (cuBLASLt refuses it with block128 weights,
    # which always accumulate in float32); set False per layer or on the class.
    fast_accum = True

    def __init__(self, in_features: int, out_features: int, *, bias: bool, weights: str = "channel",
                 activations: str = "dynamic", device=None, out_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        _check_schemes(weights, activations, "FP8InferenceLinear")
        if in_features % 16 or out_features % 16:
            raise ValueError(f"FP8InferenceLinear: in_features and out_features must be multiples of 16 for FP8 "
                             f"GEMMs, got {in_features} and {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.weights, self.activations, self.out_dtype = weights, activations, out_dtype
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                   device=device))
        shape = {"tensor": (1,), "channel": (out_features, 1),
                 "block128": (-(-out_features // 128), -(-in_features // 128))}[weights]
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device)
                             if activations == "static" else None)
        self.bias_dtype = epilogue_bias_dtype(out_dtype)  # what cuBLASLt's bias epilogue takes
        self.register_buffer("bias", torch.zeros(out_features, dtype=self.bias_dtype, device=device) if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, weights: str = "channel", activations: str = "dynamic",
                    input_amax: Optional[float] = None, out_dtype: torch.dtype = torch.bfloat16) -> "FP8InferenceLinear":
        """Quantizes `linear`'s weight (the linear itself is left as it was). Static activations need the
        calibrated max|input| (`input_amax`). A weight holding NaN or Inf is refused with a ValueError naming the
        weight, the count and the first position: E4M3 has no Inf, and its scale (per tensor, channel or block)
        would turn the weight's other values into NaN or garbage for every output they touch."""
        w = linear.weight.detach().contiguous()
        if w.data_ptr() % 16:  # e.g. a weight from_pretrained mapped from a safetensors file; kernels read 16 bytes
            w = w.clone()
        refuse_non_finite(w, "FP8InferenceLinear.from_linear", f"{type(linear).__name__}.weight",
                          "an E4M3 weight cannot keep them (clean or replace the weight before quantizing)")
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, weights=weights,
                    activations=activations, device=w.device, out_dtype=out_dtype)
        w8 = Quantizer(E4M3, 0, granularity=_LAYOUTS[weights]).quantize(w)  # the weight role's cast, as in training
        layer.weight.copy_(w8.data)
        layer.weight_scale.copy_(w8.scale_inv.reshape(layer.weight_scale.shape))
        if activations == "static":
            if input_amax is None:
                raise ValueError("FP8InferenceLinear.from_linear: static activations need input_amax from calibration")
            a = torch.tensor(float(input_amax), dtype=torch.float32, device=w.device)
            layer.input_scale.copy_(scale_from_amax(a, E4M3)[1].reshape(1))
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach().to(layer.bias_dtype))
        return layer

    @property
    def weight_fp8(self) -> FP8Tensor:
        """The weight as the GEMM's FP8Tensor: the `weight` buffer itself (not copied) with weight_scale in the
        layout cuBLASLt reads; built at each call from the registered buffers, so it follows .to() and
        load_state_dict."""
        scale, layout = self._weight_scale_for_gemm()
        return FP8Tensor(self.weight, None, scale, E4M3, layout)

    def _weight_scale_for_gemm(self):
        """(weight_scale in the layout cuBLASLt reads, its FP8Tensor layout), made once and kept while weight_scale
        is unchanged. A per-tensor scale pairs with a per-tensor (static) activation scale as one element, with
        per-token scales as one per row."""
        ws = self.weight_scale
        vk = fused.version_key(ws)
        per_row = self.weights != "tensor" or self.activations != "static"
        key = None if vk is None else (vk, ws.device, per_row)
        cached = getattr(self, "_gemm_scale", None)
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        layout = ROW if per_row and self.weights == "tensor" else _LAYOUTS[self.weights]
        if self.weights == "block128":  # a view of a buffer whose rows are padded as cuBLASLt reads them
            buf = scale_buffer(BLOCK_128x128, self.out_features, self.in_features, ws.device)[0]
            scale = scale_inv_view(buf, BLOCK_128x128, self.in_features).copy_(ws)
        elif per_row:
            scale = ws.reshape(-1).expand(self.out_features).contiguous()
        else:
            scale = ws.reshape(())
        self._gemm_scale = (key, (scale, layout))
        return scale, layout

    def _input_scheme(self):
        """What a fused producer must write for this layer: (activations, the static scale or None)."""
        if self.activations == "static":
            key = fused.version_key(self.input_scale)
            cached = self.__dict__.get("_static_scale")
            if key is None or cached is None or cached[0] != key:
                cached = self.__dict__["_static_scale"] = (key, self.input_scale.reciprocal().reshape(1))
            return "static", cached[1]
        return "dynamic", None

    def _x_scale_inv(self, rows: int, row_scale_inv: Optional[torch.Tensor]) -> torch.Tensor:
        """The activation's scale_inv as the GEMM pairs it with weight_scale."""
        if self.activations == "dynamic":
            return row_scale_inv
        if self.weights == "tensor":
            return self.input_scale.reshape(())
        vk = fused.version_key(self.input_scale)
        key = None if vk is None else (rows, vk)
        cached = self.__dict__.get("_rows_scale_inv")
        if key is None or cached is None or cached[0] != key:
            cached = self.__dict__["_rows_scale_inv"] = (key, self.input_scale.expand(rows).contiguous())
        return cached[1]

    def quantize_input(self, x: torch.Tensor, op: str, norm: Optional[RMSNorm] = None) -> Optional[FP8Activation]:
        """This layer's E4M3 input computed by one fused kernel from x: op "rmsnorm" (norm(x), `norm` an
        RMSNorm) or "swiglu" (silu(gate) * up of x = [gate, up]). None when the fusion does not apply (block
        weights, or no CUDA kernel for x): the caller then runs the unfused ops."""
        if self.weights == "block128" or not fused.available(x, self.in_features):
            return None
        activations, scale = self._input_scheme()
        if op == "rmsnorm":
            q, sinv = fused.rms_norm_fp8(x, norm.fused_gamma(), norm.eps, scale)
            shape = x.shape
        elif op == "swiglu":
            q, sinv = fused.swiglu_fp8(x, scale)
            shape = q.shape
        else:
            raise ValueError(f"FP8InferenceLinear.quantize_input: op must be 'rmsnorm' or 'swiglu', got {op!r}")
        if shape[-1] != self.in_features:
            raise ValueError(f"FP8InferenceLinear.quantize_input: the fused output has {shape[-1]} features, this "
                             f"layer takes {self.in_features}")
        data = q.reshape(-1, self.in_features)
        return FP8Activation(data, self._x_scale_inv(data.shape[0], sinv), shape, x.dtype,
                             (activations, None if scale is None else self.input_scale))

    def takes_fp8_input(self) -> bool:
        """Whether fp8_input can hand this layer an E4M3 activation with one per-tensor scale (block weights pair
        only with 1 x 128 activation tiles)."""
        return self.weights != "block128"

    def fp8_input(self, x8: FP8Tensor, dtype: torch.dtype = torch.bfloat16) -> FP8Activation:
        """An E4M3 activation made elsewhere with one per-tensor scale (FP8 attention's output, which fp8_mha hands
        to the output projection) as this layer's input, the bytes not copied: x8.data [..., in_features]
        contiguous; dtype: that of the activation it stands for. Its scale is paired with the weight's as the
        layer's GEMM takes it (one per row, or one element for per-tensor weights with static activations)."""
        where = "FP8InferenceLinear.fp8_input()"
        if not self.takes_fp8_input():
            raise ValueError(f"{where}: block128 weights pair with 1 x 128 activation tiles only; an activation with "
                             f"one per-tensor scale cannot feed them")
        data, sinv = x8.data, x8.scale_inv
        if x8.fmt is not E4M3 or x8.layout != TENSOR or sinv.numel() != 1:
            raise ValueError(f"{where}: x8 must be E4M3 with one per-tensor scale, got {x8!r}")
        if data.dim() < 2 or data.shape[-1] != self.in_features or not data.is_contiguous():
            raise ValueError(f"{where}: x8.data must be a contiguous [..., {self.in_features}] tensor, got "
                             f"{list(data.shape)} (contiguous: {data.is_contiguous()})")
        if data.device != self.weight.device:
            raise ValueError(f"{where}: x8 is on {data.device}, the layer on {self.weight.device}")
        rows = data.reshape(-1, self.in_features)
        sinv = sinv.reshape(()).float()
        if self.activations == "dynamic" or self.weights != "tensor":  # the GEMM pairs one scale per row
            sinv = sinv.expand(rows.shape[0]).contiguous()
        return FP8Activation(rows.view(torch.float8_e4m3fn), sinv, data.shape, dtype, ("per-tensor", None))

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """is_first_microbatch is accepted (and ignored) so the layer stands in for fp8ext.Linear. x may be an
        FP8Activation made by quantize_input of a layer with the same input scheme, or by fp8_input."""
        if isinstance(x, FP8Activation):
            self._check_activation(x)
            x8, rows = x, x.data.shape[0]
        else:
            x2 = x.reshape(-1, self.in_features)
            x8, rows = self._quantize_input(x2 if x2.is_contiguous() else x2.contiguous()), x2.shape[0]
        y = None
        if self.weights != "block128" and direct_gemm_ok(x8.data):  # a decode step's path: weight capsules kept
            caps = self._weight_capsules()
            if caps is not None:
                y = gemm_with_weight(x8, caps, self.out_features, self.out_dtype, self._fast_accum())
        if y is None:
            y = gemm(x8, self.weight_fp8, out_dtype=self.out_dtype, bias=self.bias, use_fast_accum=self._fast_accum())
        if y.shape[0] != rows:  # block weights' padding rows
            y = y[:rows]
        return y.reshape(*x.shape[:-1], self.out_features)

    def _weight_capsules(self) -> Optional[tuple]:
        """weight_fp8 and the bias as gemm_with_weight takes them, kept while weight, weight_scale and bias are the
        same tensors, unchanged (their data_ptr and version; the entry holds them, so that no new tensor can take
        their addresses meanwhile); None for inference tensors (no version counter)."""
        w, ws, b = self.weight, self.weight_scale, self.bias
        keys = (fused.version_key(w), fused.version_key(ws), None if b is None else fused.version_key(b))
        if keys[0] is None or keys[1] is None or (b is not None and keys[2] is None):
            return None
        cached = self.__dict__.get("_capsules")
        if cached is None or cached[0] != keys:
            cached = self.__dict__["_capsules"] = (keys, weight_capsules(self.weight_fp8, b), (w, ws, b))
        return cached[1]

    # Values derived from the buffers, kept between calls; none survives a move, a copy or a new buffer.
    _DERIVED = ("_capsules", "_gemm_scale", "_static_scale", "_rows_scale_inv")

    def __setattr__(self, name, value):
        if name in ("weight", "weight_scale", "bias", "input_scale"):  # a new tensor: the old one is not kept alive
            self.__dict__.pop("_capsules", None)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        for k in self._DERIVED:  # they hold the old tensors: .to("cpu") must free the GPU copies
            self.__dict__.pop(k, None)
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = dict(super().__getstate__())
        for k in self._DERIVED:  # capsules do not copy or pickle; everything here is made again on the next call
            state.pop(k, None)
        return state

    def _quantize_input(self, x2: torch.Tensor) -> FP8Tensor:
        """x2 [rows, in_features] cast to E4M3 as the GEMM pairs it with weight_fp8."""
        if self.weights == "block128":
            pad = -x2.shape[0] % 4  # 1x128 activation blocks need a row count that is a multiple of 4
            xp = torch.nn.functional.pad(x2, (0, 0, 0, pad)) if pad else x2
            q, scale_inv = quantize_blockwise(xp, E4M3, block=(1, 128))
            return FP8Tensor(q, None, scale_inv, E4M3, BLOCK_1x128)
        direct = direct_gemm_ok(x2)  # a decode step on a GPU: the casts without the public functions' Python
        if self.activations == "static":
            scale = self._input_scheme()[1].reshape(())
            q = quantize_eager(x2, E4M3, scale, True, False, 0, None) if direct else quantize(x2, E4M3, scale)
            scale_inv = self._x_scale_inv(x2.shape[0], None)
        elif direct:
            q, scale_inv = quantize_blocks_eager(x2, E4M3, "row", False, 0.0, x2.device)
        else:
            q, scale_inv = quantize_rowwise(x2, E4M3)
        return FP8Tensor(q, None, scale_inv, E4M3, _layout(scale_inv))

    def _fast_accum(self) -> bool:
        return bool(self.fast_accum) and self.weights != "block128"

    def _check_activation(self, x: FP8Activation) -> None:
        activations, scale = x.scheme
        if activations == "per-tensor":  # fp8_input's: its scale laid out for a layer of this scheme
            per_row = self.activations == "dynamic" or self.weights != "tensor"
            bad = x.shape[-1] != self.in_features or not self.takes_fp8_input() or (x.scale_inv.dim() == 1) != per_row
        else:
            bad = (x.shape[-1] != self.in_features or self.weights == "block128" or activations != self.activations
                   or (scale is not None and scale is not self.input_scale and not torch.equal(scale, self.input_scale)))
        if bad:
            raise ValueError(f"FP8InferenceLinear: this FP8Activation ({activations} scales, {x.shape[-1]} "
                             f"features) was quantized for another layer's input; this one takes {self.activations} "
                             f"activations of {self.in_features} features with {self.weights} weights")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights={self.weights}, activations={self.activations}")


class FP8InputRMSNorm(RMSNorm):
    """An RMSNorm that, in inference on a GPU, writes the E4M3 input of the FP8InferenceLinear it feeds (norm
    and quantization in one kernel: fp8ext.fused.rms_norm_fp8) and returns it as an FP8Activation. Otherwise
    (gradients wanted, a CPU tensor, or the layer it feeds is no longer an FP8InferenceLinear that takes one)
    it is the RMSNorm it replaced. Its parameter and state-dict entry are the norm's own `weight`. Made by
    fuse_norms; the layer fed is looked up in the block at every call, so replacing it later is safe."""

    @classmethod
    def from_norm(cls, norm: RMSNorm, block: nn.Module, consumer_path: str) -> "FP8InputRMSNorm":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for k, v in norm.__dict__.items():
            if k not in ("_parameters", "_buffers", "_modules", "_fused_gamma"):
                new.__dict__[k] = v
        new._parameters = dict(norm._parameters)
        new._buffers = dict(norm._buffers)
        new._modules = dict(norm._modules)
        new.__dict__["_feeds"] = (block, consumer_path)  # plain references, not submodules
        return new

    def consumer(self) -> Optional["FP8InferenceLinear"]:
        """The layer this norm feeds, when it takes a fused input: an FP8InferenceLinear without block weights."""
        block, path = self._feeds
        try:
            layer = block.get_submodule(path)
        except AttributeError:
            return None
        return layer if isinstance(layer, FP8InferenceLinear) and layer.weights != "block128" else None

    def forward(self, x: torch.Tensor):
        if self._fused_ok(x):
            layer = self.consumer()
            a = layer.quantize_input(x, "rmsnorm", self) if layer is not None else None
            if a is not None:
                return a
        return super().forward(x)


_FUSABLE = (("attn_norm", "attn.qkv_proj"), ("ffn_norm", "ffn.w13"))


def fuse_norms(model: nn.Module) -> int:
    """Replaces, in each block of fp8ext's transformer whose fused QKV projection (attention) or w13 (SwiGLU)
    is an FP8InferenceLinear, the RMSNorm before it by an FP8InputRMSNorm; returns how many norms feed such a
    layer afterwards. Blocks are found by their attributes (attn_norm + attn.qkv_proj, ffn_norm + ffn.w13);
    norms fused earlier are re-pointed at their block."""
    n = 0
    for block in model.modules():
        for norm_name, path in _FUSABLE:
            norm = getattr(block, norm_name, None)
            if not isinstance(norm, RMSNorm) or (type(norm) is not RMSNorm and not isinstance(norm, FP8InputRMSNorm)):
                continue
            try:
                consumer = block.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(consumer, FP8InferenceLinear) and consumer.weights != "block128":
                if isinstance(norm, FP8InputRMSNorm):
                    norm.__dict__["_feeds"] = (block, path)
                else:
                    setattr(block, norm_name, FP8InputRMSNorm.from_norm(norm, block, path))
                n += 1
    return n
