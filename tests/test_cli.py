import subprocess
import sys


def test_info_reports_versions():
    out = subprocess.run([sys.executable, "-m", "terrapipe.cli", "info"], capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("terrapipe 0.1.0")
    for name in ("numba", "torch", "pillow", "mpi4py", "cpus"):
        assert name in out


def test_unknown_command_fails():
    r = subprocess.run([sys.executable, "-m", "terrapipe.cli", "frobnicate"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_kernels_import_no_torch():
    # DESIGN: kernels import numpy and numba only.
    code = "import sys, terrapipe.kernels; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
