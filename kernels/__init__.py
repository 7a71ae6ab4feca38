"""Pallas attention kernels (installed as rlvr.kernels).

This folder sits at the repository's top level (the design card's layout) and installs as
`rlvr.kernels`. A Python started in the repository root (`python -m rlvr.main`, `python -m pytest`)
also finds it as the top-level name `kernels`, which is Hugging Face's kernel-hub package: transformers
(>= 5.25) requires it and runs `from kernels import ...` when importing any model. Imported under that
name, this file hands the name over to the installed package, so running from the repository root
never shadows it (tests/test_packaging.py checks both names).
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _ROOT]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError(
            "No module named 'kernels' outside the rlvr repository (its kernels/ folder is rlvr.kernels); "
            "Hugging Face's kernel hub installs with `pip install kernels`",
            name="kernels",
        )
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds after this file
    _spec.loader.exec_module(_module)
