"""Every kernel variant the wrappers launch must compile for sm_90 (Hopper), even on a machine without a GPU.

The interpreter-based tests never lower a kernel to the GPU, so this catches what they cannot (type
errors in loops, ops the backend rejects, tl.dot shape limits). Runs `python benchmarks/compile_check.py`
in a subprocess because that needs triton with TRITON_INTERPRET unset,
which cannot be undone inside a process that already imported the kernels interpreted.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_check.py"


def _have_ptxas() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        return False
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return os.path.exists(bundled) or bool(os.environ.get("TRITON_PTXAS_PATH"))


@pytest.mark.skipif(not _have_ptxas(), reason="triton's NVIDIA backend / ptxas not available")
def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # resolve cbatch exactly as this process does
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's notice; matches the default
    with tempfile.TemporaryDirectory() as cwd:  # a neutral cwd: no stray ./cbatch shadows the package
        proc = subprocess.run(
            [sys.executable, str(CHECK), "90"],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
        )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-6000:]
    assert "all variants compile for sm_90" in proc.stdout, report[-6000:]
