"""treespec's kernels, installed as ``treespec.kernels``.

Python started in the root of a source checkout finds this folder as a top-level ``kernels``
before site-packages, and so shadows Hugging Face's ``kernels`` package, which transformers
(5.19 and newer) probes for at import: ``_is_package_available("kernels", return_version=True)``
finds this folder and, with no package metadata under that name, imports it. Imported under that
name, this file hands the import on to the installed package; without one, it leaves a stand-in
with no ``__file__`` and no ``__version__``, which transformers counts as a namespace shadow, not
an install (so it reports the package absent), and whose every other attribute says where
treespec's kernels are.
"""

import importlib
import os
import sys
import types

if __name__ == "kernels":  # as a top-level module, from the checkout's root: not ours to answer
    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _saved = sys.path[:]
    del sys.modules[__name__]  # look again, past the checkout
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    try:
        _package = importlib.import_module(__name__)
    except ModuleNotFoundError as exc:
        if exc.name != __name__:
            raise
        _package = types.ModuleType(__name__)
        _why = (
            f"`import kernels` found treespec's kernel folder in the checkout {_checkout} and no installed "
            "`kernels` package: treespec's kernels import as `treespec.kernels`"
        )

        def _absent(name: str, why: str = _why) -> object:
            raise AttributeError(f"module 'kernels' has no attribute {name!r}: {why}")

        _package.__getattr__ = _absent  # PEP 562: every lookup the stand-in cannot answer
    finally:
        sys.path[:] = _saved
    sys.modules[__name__] = _package
