"""The module paths from before the subpackages (fp8ext.recipe, fp8ext.linear, ...) still import, as the moved modules
themselves: fp8ext/__init__.py's MOVED_MODULES table, checked in a fresh interpreter for each way of importing."""
import importlib
import subprocess
import sys

import pytest

import fp8ext

OLD_PATHS = ("recipe", "formats", "tensor", "scaling", "context", "debug", "profiling", "fused", "mx", "packing",
             "linear", "linear_autograd", "layernorm_modules", "normalization", "graphs", "convert", "weight_only",
             "adaptive")


def test_the_table_covers_every_public_module_that_moved():
    assert set(fp8ext.MOVED_MODULES) == set(OLD_PATHS)
    for name, package in fp8ext.MOVED_MODULES.items():
        assert package in ("core", "ops", "modules", "lowp")
        assert importlib.util.find_spec(f"fp8ext.{package}.{name}") is not None


def test_each_old_module_path_is_the_moved_module_in_a_fresh_interpreter():
    """Each old path imported first (before anything else named it) by `import fp8ext.<old>`, then by the other forms."""
    code = """if True:
        import importlib, sys
        import fp8ext
        for name, package in fp8ext.MOVED_MODULES.items():
            exec(f"import fp8ext.{name}")
            old = sys.modules[f"fp8ext.{name}"]
            new = importlib.import_module(f"fp8ext.{package}.{name}")
            exec(f"from fp8ext import {name} as attr; import fp8ext.{name} as again; from fp8ext.{name} import *")
            assert old is new is getattr(fp8ext, name) is locals()["attr"] is locals()["again"], name
            assert new.__name__ == new.__spec__.name == f"fp8ext.{package}.{name}", (new.__name__, new.__spec__.name)
        """
    subprocess.run([sys.executable, "-c", code], check=True)


def test_old_paths_in_this_process_and_module_state_is_shared():
    for name in OLD_PATHS:
        new = importlib.import_module(f"fp8ext.{fp8ext.MOVED_MODULES[name]}.{name}")
        assert importlib.import_module(f"fp8ext.{name}") is new is getattr(fp8ext, name)
    from fp8ext.recipe import DelayedScaling, Format  # as code ported from Transformer Engine imports them
    assert DelayedScaling is fp8ext.DelayedScaling and Format is fp8ext.Format
    assert fp8ext.fused is fp8ext.ops.fused and fp8ext.fused.TRAINING is fp8ext.ops.fused.TRAINING
    assert "quantize" in dir(fp8ext.ops) and fp8ext.ops.quantize is fp8ext.quantize  # fp8ext.ops: the casts


def test_an_unknown_module_still_fails_to_import():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fp8ext.no_such_module")
    with pytest.raises(AttributeError):
        fp8ext.no_such_module
