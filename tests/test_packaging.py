"""The repository's top-level folders never shadow installed packages of the same name.

`kernels/` installs as rlvr.kernels, but a Python started in the repository root sees it as the
top-level `kernels`, the name of Hugging Face's kernel hub that transformers imports (>= 5.25).
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import kernels, rlvr.kernels.paged_attention as paged
print(kernels.__file__)
print(paged.__file__)
print(hasattr(kernels, "get_kernel") and hasattr(kernels, "CUDAProperties"))
"""


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_kernels_folder_hands_its_top_level_name_to_the_installed_package():
    result = _python("-c", PROBE)  # -c puts the working directory (the repository root) first on sys.path
    assert result.returncode == 0, result.stderr
    hub_kernels, ours, hub_api = result.stdout.split()
    assert not hub_kernels.startswith(os.path.join(ROOT, "kernels") + os.sep), hub_kernels  # Hugging Face's, not ours
    assert hub_api == "True"
    assert ours == os.path.join(ROOT, "kernels", "paged_attention", "__init__.py")


def test_without_an_installed_kernels_package_the_name_is_missing_not_ours():
    # -S: no site-packages, so the repository root is the only place that has a `kernels`
    result = _python("-S", "-c", "import kernels")
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr and "pip install kernels" in result.stderr, result.stderr
