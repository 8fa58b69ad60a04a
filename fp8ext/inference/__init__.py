"""FP8 inference: calibrate a trained model, quantize its linear layers to E4M3 (weights per tensor, per output
channel or per 128 x 128 block; activations static or dynamic), save and load the result as a compressed-tensors
checkpoint (safetensors) that vLLM and transformers read. Packing, calibration and export run on a CPU.

    from fp8ext import inference
    inference.calibrate(model, batches)
    inference.quantize_model(model, weights="channel", activations="static")
    inference.save_quantized(model, "model-fp8/")
    model = inference.load_quantized("model-fp8/", factory, device="cuda")
    ids, stats = inference.generate(model, prompt, 64, kv_cache="fp8")   # the calibrated K/V scales, if saved
    ids, stats = inference.generate(model, prompt, 64, draft=inference.make_draft(model, "mxfp4"), speculate=4)
"""
from .attention import decode_attention
from .export import load_quantized, quantization_config, save_quantized
from .generate import decode_loss, generate
from .kv_cache import KVCache, model_kv_scales
from .speculative import make_draft
from .layers import ACTIVATION_SCHEMES, WEIGHT_SCHEMES, FP8Activation, FP8InferenceLinear, FP8InputRMSNorm, fuse_norms
from .quantize import (DEFAULT_IGNORE, calibrate, kv_scales_from_amax, quantizable_linears, quantize_model,
                       set_kv_cache_scales)

__all__ = ["calibrate", "quantize_model", "save_quantized", "load_quantized", "quantization_config", "generate", "KVCache",
           "FP8InferenceLinear", "FP8Activation", "FP8InputRMSNorm", "fuse_norms", "WEIGHT_SCHEMES", "ACTIVATION_SCHEMES", "DEFAULT_IGNORE", "quantizable_linears",
           "decode_attention", "decode_loss", "model_kv_scales", "kv_scales_from_amax", "set_kv_cache_scales",
           "make_draft"]
