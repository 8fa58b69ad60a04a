"""Does vLLM's own loader code take fp8ext's FP8 checkpoints? Runs vLLM's model loading on a CPU (no GPU, no
inference, no server) for small fp8ext checkpoints of a tiny Llama: each weight / activation scheme, one sharded,
one without KV-cache scales, and fp8ext's own Transformer exported as Llama.

    python3 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install --no-deps vllm==0.33.0 compressed-tensors==0.17.0
    /tmp/vllm-venv/bin/pip install torch==2.14.0 "transformers>=5.16.1,<5.21" safetensors packaging numpy \
        pydantic regex cachetools psutil tqdm msgspec pyyaml cloudpickle einops py-cpuinfo blake3 pyzmq urllib3 \
        requests loguru cbor2 aiohttp openai-harmony openai pillow pybase64 uvloop prometheus_client xgrammar \
        fastapi partial_json_parser llguidance     # what `import vllm` and its loader modules asked for
    PYTHONPATH=. /tmp/vllm-venv/bin/python benchmarks/vllm_load_check.py [--out /tmp/vllm_load_check]

fp8ext is imported from the repository (PYTHONPATH); vLLM need not be in fp8ext's own environment.

What runs, for each checkpoint, is vLLM's DefaultModelLoader.load_model, as an engine calls it:
- config: EngineArgs(model=DIR, dtype="bfloat16").create_engine_config(), which reads config.json and builds
  vLLM's CompressedTensorsConfig from its quantization_config (and the KV-cache dtype from kv_cache_scheme);
- scheme: building vLLM's LlamaForCausalLM calls CompressedTensorsConfig.get_quant_method for every layer; the
  scheme (CompressedTensorsW8A8Fp8 on an sm89+ GPU) and the FP8 linear kernel picked are reported;
- load_weights: the model's load_weights (AutoWeightsLoader with LlamaModel.hf_to_vllm_mapper: q/k/v_proj ->
  qkv_proj, gate/up_proj -> gate_up_proj) and each parameter's weight_loader; the loader's strict check that
  every parameter came from the checkpoint ("Following weights were not initialized from checkpoint") is
  switched on (model_loader_extra_config enable_weights_track; vLLM leaves it off for quantized models);
- values: before post-processing, this script compares every vLLM parameter with the checkpoint's tensors
  (FP8 weights byte for byte, the fused layers' parts concatenated; scales exactly; others as bf16);
- process_weights_after_loading: vLLM's post-load processing of each layer (the W8A8-FP8 scheme's and the
  kernel's, the KV-cache method's); after it, each attention layer's K/V scales are compared with the file's.

Patched, because there is no GPU: VLLM_TARGET_DEVICE=cpu (vLLM's CPU platform: the kernels it picks are its
CPU/torch ones, not those a GPU would use); the platform's get_device_capability reports 9.0 (sm90), so that
CompressedTensorsConfig checks the scheme against an H100-class GPU; and the CPU attention backend's check that
the host has AVX-512 for an FP8 KV cache is skipped (it concerns running attention kernels, not loading).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import traceback

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def tiny_llama():
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def fp8ext_transformer():
    from fp8ext.models.transformer import Transformer, TransformerConfig
    torch.manual_seed(0)
    return Transformer(TransformerConfig(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256)).eval()


def make(out: pathlib.Path, name: str, weights: str, activations: str, model_fn=tiny_llama, kv=True,
         shard=None) -> pathlib.Path:
    from fp8ext import inference
    model = model_fn()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    inference.calibrate(model, [ids], progress=False)
    inference.quantize_model(model, weights, activations, progress=False, kv_cache_scales=kv)
    return inference.save_quantized(model, out / name, **({"max_shard_size": shard} if shard else {}))


def checkpoints(out: pathlib.Path):
    for w, a in [("channel", "static"), ("tensor", "static"), ("channel", "dynamic"), ("tensor", "dynamic"),
                 ("block128", "dynamic")]:
        yield f"llama {w}/{a} +kv", make(out, f"{w}-{a}", w, a), False
    yield "llama block128/dynamic +kv, AMX check patched", out / "block128-dynamic", True
    yield "llama channel/dynamic no kv", make(out, "channel-dynamic-nokv", "channel", "dynamic", kv=False), False
    yield "llama tensor/static sharded", make(out, "tensor-static-sharded", "tensor", "static", shard="300KB"), False
    yield "fp8ext Transformer channel/static +kv", make(out, "fp8ext-channel-static", "channel", "static",
                                                        model_fn=fp8ext_transformer), False


def file_tensors(ckpt: pathlib.Path):
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def compare_values(model, tensors) -> str:
    """Every vLLM parameter against the checkpoint, before post-processing; '' when all match."""
    bad, checked = [], 0
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last == "attn" and leaf in ("k_scale", "v_scale") and f"{parent}.{leaf}" in tensors:
            sources = [f"{parent}.{leaf}"]  # vLLM's ...self_attn.attn.k_scale <- the file's ...self_attn.k_scale
        elif last == "attn":
            continue  # q_scale, zero points (and K/V scales a checkpoint without them lacks): vLLM's defaults
        else:
            sources = [f"{parent}.{part}.{leaf}".lstrip(".") for part in FUSED.get(last, (last,))]
        if not all(s in tensors for s in sources):
            bad.append(f"{name}: no {sources} in the checkpoint")
            continue
        got = p.data
        if got.dtype == torch.float8_e4m3fn:
            want = torch.cat([tensors[s] for s in sources], 0)
            same = got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        elif "scale" in leaf:
            want = torch.cat([tensors[s].float().flatten() for s in sources])
            same = got.numel() == want.numel() and torch.equal(got.float().flatten(), want)
        else:
            want = torch.cat([tensors[s] for s in sources], 0).to(got.dtype)
            same = got.shape == want.shape and torch.equal(got, want)
        checked += 1
        if not same:
            bad.append(f"{name} differs from {sources}")
    return "; ".join(bad) or f"{checked} params equal"


def load_one(ckpt: pathlib.Path, steps: list, amx: bool) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import base_loader, get_model_loader

    args = EngineArgs(model=str(ckpt), dtype="bfloat16", enforce_eager=True, load_format="safetensors",
                      skip_tokenizer_init=True, max_model_len=128,
                      model_loader_extra_config={"enable_weights_track": True})
    vc = args.create_engine_config()
    qc = vc.quant_config
    steps.append(f"config: {type(qc).__name__}, kv_cache_scheme "
                 f"{(qc.kv_cache_scheme or {}).get('strategy') if qc else None}")
    tensors = file_tensors(ckpt)
    original = base_loader.process_weights_after_loading

    def checked_post_processing(model, model_config, target_device):
        schemes = sorted({f"{type(m.scheme).__name__.replace('CompressedTensors', '')}"
                          f"[{type(getattr(m.scheme, 'fp8_linear', None)).__name__}]"
                          for m in model.modules() if getattr(m, "scheme", None) is not None})
        steps.append(f"scheme: {', '.join(schemes)}; kv cache dtype {vc.cache_config.cache_dtype}")
        steps.append("load_weights+strict: ok")
        values = compare_values(model, tensors)
        steps.append(f"values: {values}")
        if "differs" in values or "no [" in values:
            raise AssertionError(values)
        original(model, model_config, target_device)
        steps.append("process_weights_after_loading: ok")

    base_loader.process_weights_after_loading = checked_post_processing
    amx_check = torch.cpu._is_amx_tile_supported
    if amx:  # vLLM's CPU block-FP8 kernels are picked only on a host with AMX tiles
        torch.cpu._is_amx_tile_supported = lambda: True
    try:
        with set_current_vllm_config(vc):
            if not model_parallel_is_initialized():  # one process, tensor/pipeline parallel size 1
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method="tcp://127.0.0.1:29533")
                initialize_model_parallel(1, 1)
            model = get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=vc.model_config)
    finally:
        base_loader.process_weights_after_loading = original
        torch.cpu._is_amx_tile_supported = amx_check
    kv = []
    for name, m in model.named_modules():
        if hasattr(m, "_k_scale_float") and name.endswith(".attn"):
            src = name.rpartition(".")[0]
            if f"{src}.k_scale" in tensors:
                ok = (torch.equal(m._k_scale.float().flatten(), tensors[f"{src}.k_scale"].float().flatten())
                      and torch.equal(m._v_scale.float().flatten(), tensors[f"{src}.v_scale"].float().flatten())
                      and m._k_scale_float == tensors[f"{src}.k_scale"].max().item())
                kv.append(ok)
    if kv:
        steps.append(f"kv scales after processing: {sum(kv)}/{len(kv)} layers equal the file's")
        if not all(kv):
            raise AssertionError("K/V scales after process_weights_after_loading differ from the checkpoint's")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/vllm_load_check", help="where the checkpoints are written")
    a = p.parse_args()
    out = pathlib.Path(a.out)
    import vllm
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    type(current_platform).get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
    CPUAttentionBackend.supports_kv_cache_dtype = classmethod(lambda cls, kv_cache_dtype: True)
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, platform {type(current_platform).__name__} "
          f"(capability reported: {current_platform.get_device_capability().to_int()})")
    rows = []
    for label, ckpt, amx in checkpoints(out):
        steps = []
        files = len(list(ckpt.glob("*.safetensors")))
        try:
            load_one(ckpt, steps, amx)
            result = "ok"
        except Exception as e:  # noqa: BLE001 - the table reports it
            traceback.print_exc()
            result = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append((f"{label} ({files} file{'s' if files > 1 else ''})", steps, result))
    print()
    for label, steps, result in rows:
        print(f"{label}: {result}")
        for s in steps:
            print(f"    {s}")
    print(json.dumps({"ok": sum(r[2] == "ok" for r in rows), "of": len(rows)}))
    sys.exit(0 if all(r[2] == "ok" for r in rows) else 1)


if __name__ == "__main__":
    main()
