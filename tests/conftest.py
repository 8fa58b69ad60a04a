"""Shared test helpers. GPU tests carry the `cuda` mark and skip cleanly without a CUDA device.

The tests live in subfolders mirroring fp8ext's (core/, ops/, modules/, inference/, lowp/, testing/, apps/ for the
applications, csrc/ for the C layer and its bindings, project/ for the build, docs and notebooks); the helpers
shared by them (this file, reference.py, inputs.py, dlpack_craft.py, ct_reference.py, vllm_layout.py) stay here,
imported by name from any subfolder."""

import os
import sys

import pytest
import torch

import fp8ext
from fp8ext.testing import assert_fp8_equal

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared helpers, from the subfolders' tests

HAS_CUDA = fp8ext.cuda_available() and torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and fp8ext built with CUDA")
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def pytest_collection_modifyitems(config, items):
    """Tests parametrised over devices get the `cuda` mark for their GPU instances."""
    for item in items:
        params = item.callspec.params.values() if hasattr(item, "callspec") else ()
        if any(isinstance(v, str) and v == "cuda" for v in params):
            item.add_marker(pytest.mark.cuda)


def run_ranks(script, out, nproc: int, timeout: int = 300) -> None:
    """Runs `script` as `nproc` processes under torchrun on this host (gloo on the CPU), passing it `out`, the folder
    its ranks write their results into; a hung collective ends the launcher and its ranks and fails the test, and
    a failing rank fails it with the end of their stderr."""
    import subprocess
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a collective that some rank never joined: end the launcher and its ranks
        os.killpg(proc.pid, 9)
        _, stderr = proc.communicate()
        pytest.fail(f"the {nproc} ranks did not finish in {timeout} s (a hung collective): {stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]


def assert_same_bytes(got, want, what: str = "") -> None:
    """Byte-for-byte equality of FP8 tensors or uint8 codes, NaN encodings included (the GPU must give the
    CPU's exact bytes): fp8ext.testing.assert_fp8_equal with strict_nan=True, `what` leading the message."""
    assert_fp8_equal(got, want, strict_nan=True, msg=what or None)


@pytest.fixture
def progress(request):
    """progress(text): a line on the terminal while a long test runs (output capture would hold it back until the
    test ends), e.g. a notebook's cells as they execute. Silent under -q -q and when there is no terminal reporter."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def say(text: str) -> None:
        if reporter is None or capture is None or request.config.get_verbosity() <= -2:
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"    {request.node.name}: {text}")
    return say


@pytest.fixture
def fp8_attention_calls(monkeypatch):
    """The CPU engine of FP8 attention (fp8ext.modules.attention.FP8_ATTENTION_ENGINES['cpu']), counting its calls:
    the keyword arguments of each call."""
    from fp8ext.modules import attention
    calls = []
    cpu = attention.FP8_ATTENTION_ENGINES["cpu"]
    monkeypatch.setitem(attention.FP8_ATTENTION_ENGINES, "cpu", lambda *a, **kw: calls.append(kw) or cpu(*a, **kw))
    return calls
