"""FP8InferenceLinear's decode path on the GPU: the weight side of its GEMM crosses to C as capsules made once
(fp8ext.ops.matmul.gemm_with_weight). The output must be gemm()'s, bit for bit, and follow every change of the
weight, its scale and the bias; the kept capsules must not stop a copy, a pickle or a move to another device."""
import copy
import io

import pytest
import torch
from torch import nn

import fp8ext
from conftest import requires_cuda
from fp8ext.core.tensor import FP8Tensor
from fp8ext.inference import FP8InferenceLinear
from fp8ext.inference.layers import _layout
from fp8ext.ops.matmul import gemm

SCHEMES = [("tensor", "static"), ("tensor", "dynamic"), ("channel", "static"), ("channel", "dynamic")]


def layer(weights, activations, device, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(256, 128, bias=bias).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    amax = x.float().abs().max().item() if activations == "static" else None
    return FP8InferenceLinear.from_linear(lin, weights, activations, input_amax=amax), x


def reference(lay, x):
    """gemm() of the public casts of x and the layer's weight: what forward computed before the direct path."""
    if lay.activations == "static":
        q = fp8ext.quantize(x, fp8ext.E4M3, lay.input_scale.reciprocal().reshape(()))
        sinv = lay._x_scale_inv(x.shape[0], None)
    else:
        q, sinv = fp8ext.quantize_rowwise(x, fp8ext.E4M3)
    x8 = FP8Tensor(q, None, sinv, fp8ext.E4M3, _layout(sinv))
    return gemm(x8, lay.weight_fp8, out_dtype=lay.out_dtype, bias=lay.bias, use_fast_accum=lay._fast_accum())


def test_the_capsules_are_dropped_on_copy_pickle_and_move():
    lay, x = layer("channel", "dynamic", "cpu")
    caps = lay._weight_capsules()
    assert caps is not None and lay._weight_capsules() is caps  # kept while nothing changed
    twin = copy.deepcopy(lay)
    assert "_capsules" not in twin.__dict__ and torch.equal(twin(x), lay(x))
    buf = io.BytesIO()
    torch.save(lay, buf)
    assert "_capsules" in lay.__dict__
    lay.to(torch.device("cpu"))
    assert "_capsules" not in lay.__dict__


def _tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (tuple, list)):
        for e in v:
            yield from _tensors(e)


def test_a_new_buffer_tensor_drops_the_kept_capsules():
    lay, x = layer("channel", "dynamic", "cpu")
    lay._weight_capsules()
    lay.weight = lay.weight.clone()  # a buffer replaced: the old tensor must not stay alive through the cache
    assert "_capsules" not in lay.__dict__
    lay._weight_capsules()
    lay.bias = lay.bias.clone()
    assert "_capsules" not in lay.__dict__


def test_the_capsules_follow_the_buffers():
    lay, _ = layer("channel", "static", "cpu")
    caps = lay._weight_capsules()
    with torch.no_grad():
        lay.weight_scale.mul_(2)
    assert lay._weight_capsules() is not caps
    caps = lay._weight_capsules()
    lay.load_state_dict(lay.state_dict())
    assert lay._weight_capsules() is not caps
    with torch.inference_mode():
        frozen, _ = layer("channel", "static", "cpu")
    assert frozen._weight_capsules() is None  # inference tensors have no version to key on


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("weights, activations", SCHEMES)
@pytest.mark.parametrize("bias", [True, False])
def test_the_decode_path_is_gemm_bit_for_bit_and_follows_changes(weights, activations, bias):
    lay, x = layer(weights, activations, "cuda", bias=bias)
    with torch.no_grad():
        y = lay(x)
        assert "_capsules" in lay.__dict__
        assert torch.equal(y, reference(lay, x))
        x3 = x.reshape(4, 16, 256)
        assert torch.equal(lay(x3), reference(lay, x).reshape(4, 16, 128))
        # a new weight, scale and bias in place (as load_state_dict writes them): the next call uses them
        other, _ = layer(weights, activations, "cuda", bias=bias, seed=1)
        lay.load_state_dict(other.state_dict())
        assert torch.equal(lay(x), reference(other, x))
        for switch in (fp8ext.set_gemm_autotune, fp8ext.set_profiling):  # the public functions' path: same bytes
            switch(True)
            try:
                assert torch.equal(lay(x), reference(other, x))
            finally:
                switch(False)


@requires_cuda
@pytest.mark.cuda
def test_a_layer_moved_off_the_gpu_keeps_no_gpu_tensor():
    lay, x = layer("channel", "dynamic", "cuda")
    with torch.no_grad():
        lay(x)
    lay.to("cpu")
    kept = [t for k, v in lay.__dict__.items() if k not in ("_parameters", "_buffers") for t in _tensors(v)]
    assert not [t for t in kept if t.is_cuda]
    with torch.no_grad():
        assert lay(x.cpu()).device.type == "cpu"
