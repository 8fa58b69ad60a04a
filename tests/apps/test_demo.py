"""The README's main job, `python -m fp8ext.demo`, runs and says what it should."""

import fp8ext.demo


def test_demo_runs_and_writes_its_plot(tmp_path, capsys):
    out = tmp_path / "demo.png"
    fp8ext.demo.main(["--steps", "40", "--out", str(out)])
    text = capsys.readouterr().out
    assert "largest finite" in text and "57344" in text and "448" in text
    assert "gradient of fc1 weight" in text and "lab grid" in text
    assert out.exists() and out.stat().st_size > 10_000


def test_lab_grid_is_not_fp8():
    """The lab's simulation (notebooks/lab_3_2_3_fp8_training_inference.ipynb) loses values that FP8 represents exactly (2^-6 is E4M3's min normal)."""
    import torch
    v = torch.tensor([2.0**-6, 3.0 * 2**-9])
    assert fp8ext.demo.lab_simulate_fp8(v, fp8ext.E4M3).tolist() == [0.0, 0.0]
    assert fp8ext.dequantize(fp8ext.quantize(v, fp8ext.E4M3)).tolist() == v.tolist()
