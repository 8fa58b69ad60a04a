"""A save interrupted part-way (the writer raises after writing half its bytes: a full disk, a quota, Ctrl-C; or a
flush or a rename fails) leaves the previous checkpoint as it was, byte for byte and loadable, lets the exception
through (never a silent half-save), and the next save works:

- fp8ext.train.checkpoint.save (checkpoint.tmp, fsync, rename over checkpoint.pt);
- fp8ext.inference.save_quantized (model.safetensors and config.json of fp8ext's Transformer).
"""

import io
import os
import pathlib

import pytest
import torch

import fp8ext
from fp8ext.train import checkpoint
from prop_support import bounded, one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread (prop_support)

ARGS = {"preset": "tiny", "data": None, "lr": 1e-3}


def faults(kind):
    return {"oserror": OSError(28, "No space left on device"), "runtimeerror": RuntimeError("unexpected pos 4096"),
            "ctrl-c": KeyboardInterrupt()}[kind]


# ---- fp8ext.train checkpoint.pt ----------------------------------------------------------------------------------

def half_torch_save(fault):
    real = torch.save

    def save(obj, f, *args, **kwargs):
        buf = io.BytesIO()
        real(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        f.write(data[:len(data) // 2])
        f.flush()
        raise fault
    return save


def failing_call(real, fault, when):
    """real, raising `fault` instead on the calls for which when(*args) is true."""
    def call(*args, **kwargs):
        if when(*args):
            raise fault
        return real(*args, **kwargs)
    return call


def _is_file_fd(fd):
    import stat
    return stat.S_ISREG(os.fstat(fd).st_mode)


TRAIN_FAULTS = {  # id -> (attribute owner, name, make the replacement)
    "torch.save-half-then-oserror": (torch, "save", lambda: half_torch_save(faults("oserror"))),
    "torch.save-half-then-runtimeerror": (torch, "save", lambda: half_torch_save(faults("runtimeerror"))),
    "torch.save-half-then-ctrl-c": (torch, "save", lambda: half_torch_save(faults("ctrl-c"))),
    "fsync-fails": (os, "fsync", lambda: failing_call(os.fsync, faults("oserror"), _is_file_fd)),
    "rename-fails": (os, "replace", lambda: failing_call(os.replace, faults("oserror"), lambda *a: True)),
}


def _layer_and_opt(seed):
    torch.manual_seed(seed)
    layer = fp8ext.FP8Linear(16, 16)
    opt = torch.optim.AdamW(layer.parameters())
    with fp8ext.fp8_autocast(enabled=True, fp8_recipe=fp8ext.DelayedScaling()):
        layer(torch.randn(16, 16)).sum().backward()
    opt.step()
    return layer, opt


@pytest.mark.parametrize("fault", TRAIN_FAULTS)
def test_an_interrupted_training_checkpoint_save_keeps_the_previous_one(tmp_path, monkeypatch, fault):
    layer, opt = _layer_and_opt(0)
    path = pathlib.Path(checkpoint.save(str(tmp_path), layer, opt, 1, ARGS))
    before = path.read_bytes()
    owner, name, make = TRAIN_FAULTS[fault]
    injected = make()
    with bounded(), monkeypatch.context() as m:
        m.setattr(owner, name, injected)
        layer2, opt2 = _layer_and_opt(1)
        with pytest.raises(BaseException) as info:
            checkpoint.save(str(tmp_path), layer2, opt2, 2, ARGS)
    assert isinstance(info.value, (KeyboardInterrupt,) if fault.endswith("ctrl-c") else (OSError, RuntimeError)), \
        f"the save's failure came out as {info.value!r}"
    assert path.read_bytes() == before, "the previous checkpoint.pt changed"
    _, state = checkpoint.read(str(tmp_path))
    assert state["step"] == 1 and torch.equal(state["model"]["weight"], layer.weight.detach())
    checkpoint.remove_stale_tmp(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.CHECKPOINT_NAME], "a partial file was left"
    checkpoint.save(str(tmp_path), layer2, opt2, 3, ARGS)  # and the next save works
    assert checkpoint.read(str(tmp_path))[1]["step"] == 3


# ---- fp8ext.inference save_quantized ---------------------------------------------------------------------------

def _quantized(seed):
    from fp8ext import inference
    from fp8ext.models.transformer import Transformer, TransformerConfig
    torch.manual_seed(seed)
    model = Transformer(TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                                          max_seq_len=32)).eval()
    inference.quantize_model(model, "channel", "dynamic")
    return model


def half_save_file(fault):
    import safetensors.torch
    real = safetensors.torch.save_file

    def save_file(tensors, filename, *args, **kwargs):
        real(tensors, filename, *args, **kwargs)
        data = pathlib.Path(filename).read_bytes()
        pathlib.Path(filename).write_bytes(data[:len(data) // 2])
        raise fault
    return save_file


def half_config_write(fault):
    real = pathlib.Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name == "config.json":
            real(self, text[:len(text) // 2], *args, **kwargs)
            raise fault
        return real(self, text, *args, **kwargs)
    return write_text


def second_rename_fails(fault):
    real, calls = os.replace, []

    def replace(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise fault
        return real(*args, **kwargs)
    return replace


def _safetensors_module():
    import safetensors.torch
    return safetensors.torch


INFERENCE_FAULTS = {  # id -> (attribute owner, name, make the replacement)
    "tensors-half-then-oserror": (_safetensors_module, "save_file", lambda: half_save_file(faults("oserror"))),
    "tensors-half-then-ctrl-c": (_safetensors_module, "save_file", lambda: half_save_file(faults("ctrl-c"))),
    "config-half-then-oserror": (lambda: pathlib.Path, "write_text", lambda: half_config_write(faults("oserror"))),
    "second-rename-fails": (lambda: os, "replace", lambda: second_rename_fails(faults("oserror"))),
}
INFERENCE_BUGS = {}  # fault id -> an xfail mark, for a case a library bug fails


@pytest.mark.parametrize("fault", [pytest.param(f, marks=INFERENCE_BUGS.get(f, ())) for f in INFERENCE_FAULTS])
def test_an_interrupted_save_quantized_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fault):
    from fp8ext import inference
    out = tmp_path / "q"
    first = _quantized(0)
    inference.save_quantized(first, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    ids = torch.randint(0, 64, (2, 8))
    want = first(ids)
    second = _quantized(1)
    owner, name, make = INFERENCE_FAULTS[fault]
    with bounded(), monkeypatch.context() as m:
        m.setattr(owner(), name, make())
        with pytest.raises(BaseException) as info:
            inference.save_quantized(second, out)
    assert isinstance(info.value, (KeyboardInterrupt,) if fault.endswith("ctrl-c") else OSError), \
        f"the save's failure came out as {info.value!r}"
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(after) == sorted(before), f"the folder held {sorted(before)}, now {sorted(after)}"
    changed = [n for n in before if after[n] != before[n]]
    assert not changed, f"the interrupted save changed {changed}"
    assert torch.equal(inference.load_quantized(out, device="cpu")(ids), want), "the previous checkpoint computes"
    inference.save_quantized(second, out)  # and the next save works
    assert torch.equal(inference.load_quantized(out, device="cpu")(ids), second(ids))
