"""treespec's kernels, installed as ``treespec.kernels``.

Python started in the root of a source checkout finds this folder as a top-level ``kernels``
before site-packages, and so shadows Hugging Face's ``kernels`` package, which transformers
(5.25 and newer) imports whenever it is installed. Imported under that name, this file hands the
import on to the installed package, or says where treespec's kernels are.
"""

import importlib
import os
import sys

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
        raise ImportError(
            f"`import kernels` found treespec's kernel folder in the checkout {_checkout} and no installed "
            "`kernels` package: treespec's kernels import as `treespec.kernels`"
        ) from exc
    finally:
        sys.path[:] = _saved
    sys.modules[__name__] = _package
