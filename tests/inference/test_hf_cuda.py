"""The Hugging Face checkpoints on a GPU: a transformers Llama quantized by fp8ext, fp8ext's own transformer saved as a
Llama checkpoint, and a checkpoint in llmcompressor's layout load onto the GPU (FP8 GEMMs through cuBLASLt) and give
the logits the CPU reference gives for the same file. Tiny random-init models; nothing is downloaded."""

import pytest
import torch

from conftest import requires_cuda

transformers = pytest.importorskip("transformers", reason="the Hugging Face models come from the [test] extra")
pytest.importorskip("compressed_tensors", reason="the llmcompressor-layout checkpoint is written with it")

from fp8ext import inference  # noqa: E402
from fp8ext.models.transformer import Transformer, TransformerConfig, preset  # noqa: E402

import test_compressed_tensors as llmcompressor_layout  # noqa: E402

pytestmark = [pytest.mark.cuda, requires_cuda]
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
SCHEMES = [("channel", "static"), ("tensor", "dynamic"), ("block128", "dynamic")]


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def logits(model, device):
    with torch.no_grad():
        out = model(IDS.to(device))
    return (out.logits if hasattr(out, "logits") else out).float().cpu()


def same_on_gpu_as_on_cpu(d):
    """The directory loaded on the CPU and on the GPU: (GPU logits, CPU logits, the GPU model)."""
    cpu = inference.load_quantized(d, device="cpu")
    gpu = inference.load_quantized(d, device="cuda")
    assert all(p.device.type == "cuda" for p in gpu.parameters())
    assert any(isinstance(m, inference.FP8InferenceLinear) for m in gpu.modules())
    return logits(gpu, "cuda"), logits(cpu, "cpu"), gpu


def close(got, want):
    """The GPU's FP8 GEMMs (cuBLASLt on Hopper's tensor cores) do not accumulate as exactly as the CPU reference's
    float32 products: on an H100, the first layer's output, from bit-identical E4M3 inputs, differed by 2.1e-4
    (float32 output) to 8.9e-4 (bfloat16) relative L2, with or without fast accumulation; later layers round such
    differences to neighbouring E4M3 values, and these tiny random-init models' logits agreed to 2.5e-2 - 3.3e-2
    (relative L2), with the same argmax almost everywhere."""
    rel = ((got - want).norm() / want.norm()).item()
    print(f"GPU vs CPU logits: relative L2 {rel:.2e}")
    assert rel < 5e-2, f"GPU logits differ from the CPU's by {rel:.2e} (relative L2)"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("weights, activations", SCHEMES)
def test_a_quantized_transformers_llama_runs_on_the_gpu(weights, activations, tmp_path):
    model = tiny_llama()
    inference.calibrate(model, [IDS], progress=False)
    inference.quantize_model(model, weights, activations, progress=False)
    got, want, gpu = same_on_gpu_as_on_cpu(inference.save_quantized(model, tmp_path))
    close(got, want)
    out = gpu.generate(IDS[:1].cuda(), max_new_tokens=4, do_sample=False)  # transformers' own generate
    assert out.shape == (1, 20) and out.device.type == "cuda"


@pytest.mark.parametrize("weights, activations", SCHEMES)
def test_fp8exts_llama_export_runs_on_the_gpu_and_generates(weights, activations, tmp_path):
    cfg = TransformerConfig(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256) \
        if weights == "block128" else preset("tiny")
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    inference.calibrate(model, [IDS], progress=False)
    inference.quantize_model(model, weights, activations, progress=False)
    got, want, gpu = same_on_gpu_as_on_cpu(inference.save_quantized(model, tmp_path))
    close(got, want)
    ids, stats = inference.generate(gpu, IDS[:1].cuda(), 4, kv_cache="fp8")  # fp8ext's FP8 KV cache
    assert ids.shape == (1, 20) and stats["kv_scales"] == "calibrated"


@pytest.mark.parametrize("layout", ["dynamic-channel-sharded", "static-tensor-kv-per-head", "block128-dynamic-group"])
def test_an_llmcompressor_checkpoint_runs_on_the_gpu(layout, tmp_path):
    d = llmcompressor_layout.write_checkpoint(tmp_path / layout, **llmcompressor_layout.LAYOUTS[layout])
    got, want, _ = same_on_gpu_as_on_cpu(d)
    close(got, want)
