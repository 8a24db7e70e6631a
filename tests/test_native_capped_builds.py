"""The native kernels' builds per instruction-set cap (``ATEN_CPU_CAPABILITY``, polyrl/engines/native): each
cap has its compiler flags and a cache entry of its own, and a process started under a cap builds (or finds in
the cache) kernels of that instruction set that compute what torch computes. A cold cache compiles each build
(about 20 CPU-seconds each): tests/test_native_f32.py tests the kernels of this machine's own build in depth.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from polyrl.engines import native

if os.environ.get("POLYRL_NATIVE") == "0":
    pytest.skip("native kernels switched off (POLYRL_NATIVE=0)", allow_module_level=True)


def test_the_cap_chooses_the_build_and_its_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path)
    dirs = {}
    for cap, flags in (("avx2", ["-mavx2", "-mfma", "-mf16c"]), ("default", []), (None, ["-march=native"])):
        if cap is None:
            monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
        else:
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
        assert native._arch_flags() == flags
        dirs[cap] = native._build_dir()
    assert len(set(dirs.values())) == 3  # each build in a cache entry of its own
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    assert native.isa_cap() == "native"


def test_another_copy_of_the_sources_builds_into_an_entry_of_its_own(monkeypatch, tmp_path):
    """torch's builder records the sources' paths: two trees sharing an entry would rebuild it in turn."""
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path)
    here = native._build_dir()
    assert native._build_dir() == here  # the same tree finds its entry again
    monkeypatch.setattr(native, "HERE", tmp_path / "another" / "checkout")
    assert native._build_dir() != here


CAPPED_CHECK = """
import torch
from polyrl.engines import native
assert native.available()
ops = native.ops()
x, w = torch.randn(5, 40), torch.randn(9, 40)
assert torch.allclose(ops.linear(x, [w], None), x @ w.T, atol=1e-5)
g = torch.randn(3, 2 * 20)
assert torch.allclose(ops.silu_mul(g), torch.nn.functional.silu(g[:, :20]) * g[:, 20:], atol=1e-6)
print(ops.isa())
"""


@pytest.mark.slow
@pytest.mark.parametrize("cap,isa", [("avx2", "avx2"), ("default", "portable")])
def test_a_capped_build_runs_its_own_kernels(cap, isa):
    """A process started under the cap builds (or finds in the cache) the kernels for it."""
    if cap == "avx2" and not torch.cpu._is_avx2_supported():
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
    res = subprocess.run([sys.executable, "-c", CAPPED_CHECK], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-1] == isa
