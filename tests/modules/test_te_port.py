"""Code written for Transformer Engine ports to fp8ext by changing its imports."""

import math

import pytest
import torch
from torch import nn

import fp8ext

# A dense transformer block as Transformer Engine code writes it: RMSNorm, grouped-query attention with one fused
# QKV projection, a SwiGLU MLP, DelayedScaling(HYBRID, history 16, "max"). Only the first two lines change.
TE_CODE = '''
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Format, DelayedScaling
import torch
import torch.nn.functional as F
from torch import nn


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, params_dtype):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.qkv_proj = te.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False,
                                  params_dtype=params_dtype, device="cpu")
        self.o_proj = te.Linear(n_heads * self.head_dim, d_model, bias=False, params_dtype=params_dtype,
                                device="cpu", init_method=lambda w: torch.nn.init.normal_(w, std=0.02))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim,
                                          self.n_kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model, d_ff, params_dtype):
        super().__init__()
        self.w1 = te.Linear(d_model, d_ff, bias=False, params_dtype=params_dtype, device="cpu")
        self.w3 = te.Linear(d_model, d_ff, bias=False, params_dtype=params_dtype, device="cpu")
        self.w2 = te.Linear(d_ff, d_model, bias=False, params_dtype=params_dtype, device="cpu")

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, params_dtype=torch.float32):
        super().__init__()
        self.attn_norm = te.RMSNorm(d_model, eps=1e-6, params_dtype=params_dtype, device="cpu")
        self.attn = GroupedQueryAttention(d_model, n_heads, n_kv_heads, params_dtype)
        self.ffn_norm = te.RMSNorm(d_model, eps=1e-6, params_dtype=params_dtype, device="cpu")
        self.ffn = SwiGLU(d_model, d_ff, params_dtype)
        self.out_norm = te.LayerNorm(d_model, eps=1e-5, params_dtype=params_dtype, device="cpu")
        self.head = te.Linear(d_model, 32, bias=True, params_dtype=params_dtype, device="cpu", return_bias=True)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        x = x + self.ffn(self.ffn_norm(x))
        logits, bias = self.head(self.out_norm(x))
        return logits + bias


fp8_recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


def train(model, steps, fp8=True):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(32, 64, generator=g)      # a fixed vocabulary of 32 random embeddings
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 32, (8, 16), generator=g)
        x = tokens[ids]
        target = ids                                 # name the token at each position
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 32), target.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
'''


def port(code: str) -> str:
    """The port: Transformer Engine's imports replaced by fp8ext's, nothing else."""
    return (code.replace("import transformer_engine.pytorch as te", "import fp8ext as te")
                .replace("from transformer_engine.common.recipe import", "from fp8ext.recipe import"))


def test_transformer_engine_code_trains_after_changing_its_imports():
    ported = port(TE_CODE)
    assert ported.count("\n") == TE_CODE.count("\n") and "transformer_engine" not in ported
    ns = {}
    exec(compile(ported, "<te_block>", "exec"), ns)
    torch.manual_seed(0)
    model = ns["Block"]()
    assert sum(isinstance(m, fp8ext.FP8Linear) for m in model.modules()) == 6
    losses = ns["train"](model, 60)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:5]) / 5, f"FP8 training learned: {losses[:5]} -> {losses[-10:]}"
    torch.manual_seed(0)
    reference = ns["train"](ns["Block"](), 60, fp8=False)
    assert sum(losses[-10:]) / 10 < 2 * sum(reference[-10:]) / 10 + 0.05, "FP8 close to high precision"


def test_te_names():
    import fp8ext as te
    from fp8ext.recipe import DelayedScaling, Float8CurrentScaling, Format
    assert te.Linear is fp8ext.FP8Linear
    assert Format is fp8ext.Format and DelayedScaling is fp8ext.DelayedScaling
    assert Float8CurrentScaling is fp8ext.CurrentScaling
    recipe = DelayedScaling(fp8_dpa=False, fp8_mha=False)
    layer = te.Linear(32, 16)
    with te.autocast(enabled=True, recipe=recipe):
        assert te.is_fp8_enabled() and te.get_fp8_recipe() is recipe
        layer(torch.randn(4, 32)).sum().backward()


@pytest.mark.parametrize("kwargs", [dict(parallel_mode="column"), dict(tp_size=2), dict(sequence_parallel=True),
                                    dict(delay_wgrad_compute=True), dict(ub_overlap_ag=True)])
def test_te_linear_parallel_arguments_only_at_their_defaults(kwargs):
    with pytest.raises(NotImplementedError, match=f"{next(iter(kwargs))}=.*fp8ext does not have"):
        fp8ext.Linear(32, 16, **kwargs)
    fp8ext.Linear(32, 16, parallel_mode=None, tp_size=1, sequence_parallel=False, tp_group=None)


def test_te_linear_rejects_unknown_arguments():
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_thing'"):
        fp8ext.Linear(32, 16, no_such_thing=1)


def test_fp8_mha_sets_fp8_dpa_as_transformer_engine_does():
    for recipe in (fp8ext.DelayedScaling, fp8ext.Float8CurrentScaling):
        r = recipe(fp8_mha=True)
        assert r.fp8_mha and r.fp8_dpa, "TE forces fp8_dpa=True when fp8_mha=True"
        assert r == recipe(fp8_mha=True, fp8_dpa=True)
        assert recipe(fp8_dpa=True).fp8_dpa and not recipe(fp8_dpa=True).fp8_mha


def test_te_linear_init_method_params_dtype_and_return_bias():
    seen = []
    layer = fp8ext.Linear(32, 16, params_dtype=torch.bfloat16, device="cpu",
                          init_method=lambda w: (seen.append(w.shape), nn.init.constant_(w, 0.5)))
    assert seen == [(16, 32)] and layer.weight.dtype == torch.bfloat16
    assert (layer.weight == 0.5).all() and (layer.bias == 0).all(), "TE: init_method for the weight, zero bias"
    layer = fp8ext.Linear(32, 16, return_bias=True)
    x = torch.randn(4, 32)
    recipe = fp8ext.CurrentScaling()  # the output depends on x and the weight only
    for fp8 in (False, True):
        with fp8ext.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            out, bias = layer(x)
        assert bias is layer.bias
        with fp8ext.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            full = fp8ext.FP8Linear(32, 16)
            full.load_state_dict(layer.state_dict())
            want = full(x)
        assert torch.allclose(out + bias, want, atol=1e-6), "the bias is returned, not added"


def test_te_autocast_graph_switch_is_accepted():
    """TE's internal _graph=True, which fp8ext.make_graphed_callables uses (what it does: tests/modules/test_graphs.py)."""
    with fp8ext.fp8_autocast(_graph=True):
        assert fp8ext.is_fp8_enabled()
