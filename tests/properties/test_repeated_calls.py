"""Repeated calls hold no memory: thousands of calls of the casts, the GEMM and FP8Linear's forward and backward, and
repeated checkpoint loads, after a warm-up, grow the process's resident memory by less than a small bound and leave
no Python objects behind (a C reference kept per call, a capsule never freed, a cache keyed by something new on every
call). Resident memory is read from /proc/self/statm (Linux; the test skips elsewhere)."""

import gc

import pytest
import torch

import fp8ext
from prop_support import bounded, one_thread, rss_bytes  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread (prop_support)

MiB = 1 << 20
RSS_BOUND = 8 * MiB
if rss_bytes() is None:
    pytest.skip("resident memory is read from /proc/self/statm (Linux)", allow_module_level=True)


def growth(step, rounds, warmup):
    """(resident bytes, gc-tracked objects) gained over `rounds` calls of step() after `warmup` ones."""
    for _ in range(warmup):
        step()
    gc.collect()
    rss, objects = rss_bytes(), len(gc.get_objects())
    for _ in range(rounds):
        step()
    gc.collect()
    return rss_bytes() - rss, len(gc.get_objects()) - objects


def op_calls():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 32, generator=g, dtype=torch.bfloat16)
    q = fp8ext.quantize(x, fp8ext.E4M3, 2.0)
    one, acc = torch.ones(1), torch.zeros(1)

    def step():
        fp8ext.quantize(x, fp8ext.E4M3, 2.0, amax_out=acc, scale_inv_out=torch.empty(1))
        fp8ext.quantize(x, fp8ext.E5M2, torch.full((1,), 0.5), stochastic=True, seed=1)
        fp8ext.dequantize(q, 0.5, torch.bfloat16)
        fp8ext.amax(x)
        fp8ext.cast_transpose(x, fp8ext.E5M2, one)
        fp8ext.cast_transpose_dbias(x, fp8ext.E4M3, one)
        fp8ext.quantize_rowwise(x)
        fp8ext.scale_from_amax(acc)
        fp8ext.gemm(q, q, a_scale_inv=one, b_scale_inv=one)
    return step


def refused_calls():
    """Calls refused with an error: the failure paths must free what they took too."""
    x = torch.randn(16, 16)

    def step():
        for bad in (lambda: fp8ext.quantize(x, fp8ext.E4M3, float("nan")),
                    lambda: fp8ext.gemm(x, x),
                    lambda: fp8ext.dequantize(x.to(torch.float8_e4m3fn), torch.zeros(2))):
            try:
                bad()
            except (TypeError, ValueError):
                pass
    return step


def linear_steps(recipe):
    torch.manual_seed(0)
    layer = fp8ext.FP8Linear(32, 32)
    x = torch.randn(16, 32, requires_grad=True)

    def step():
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = layer(x)
        y.sum().backward()
        layer.weight.grad = x.grad = layer.bias.grad = None
    return step


CASES = {  # name -> (make the step, rounds, warm-up)
    "casts-and-gemm": (op_calls, 1000, 100),  # 9 calls a round
    "refused-calls": (refused_calls, 500, 50),  # 3 calls a round
    "fp8linear-delayed": (lambda: linear_steps(fp8ext.DelayedScaling()), 200, 30),
    "fp8linear-current": (lambda: linear_steps(fp8ext.Float8CurrentScaling()), 200, 30),
}


@pytest.mark.parametrize("case", CASES)
def test_repeated_calls_keep_memory_flat(case):
    make, rounds, warmup = CASES[case]
    with bounded(seconds=60, memory=512 * MiB, what=case):
        rss, objects = growth(make(), rounds, warmup)
    assert rss < RSS_BOUND, f"{rounds} rounds of {case} grew resident memory by {rss / MiB:.1f} MiB"
    assert objects < rounds // 10, f"{rounds} rounds of {case} left {objects} more Python objects"


def test_repeated_checkpoint_loads_keep_memory_flat(tmp_path):
    from fp8ext import inference
    from fp8ext.models.transformer import Transformer, TransformerConfig
    from fp8ext.train import checkpoint
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                                          max_seq_len=32)).eval()
    inference.quantize_model(model, "channel", "dynamic")
    inference.save_quantized(model, tmp_path / "q")
    lin = torch.nn.Linear(16, 16)
    (tmp_path / "run").mkdir()
    checkpoint.save(str(tmp_path / "run"), lin, torch.optim.AdamW(lin.parameters()), 1,
                    {"preset": "tiny", "data": None, "lr": 1e-3})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\0" * 64)

    def step():
        inference.load_quantized(tmp_path / "q", device="cpu")
        checkpoint.read(str(tmp_path / "run"))
        try:
            inference.load_quantized(tmp_path / "bad", device="cpu")
        except ValueError:
            pass
    with bounded(seconds=60, memory=512 * MiB):
        rss, objects = growth(step, 20, 3)
    assert rss < RSS_BOUND, f"20 rounds of loads grew resident memory by {rss / MiB:.1f} MiB"
    assert objects < 20, f"20 rounds of loads left {objects} more Python objects"
