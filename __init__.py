"""Not the treespec package: the root of its source checkout.

Python imports this file as ``treespec`` only when it starts in the folder that holds the clone
(``git clone`` names the clone ``treespec``, and Python looks in its starting folder first).
Left alone, the clone would import as an empty namespace package and ``treespec.generate``
would fail with an AttributeError that does not say why. This file hands the import on to the
installed package instead, or says what to do when there is none.
"""

import importlib
import os
import sys

if __name__ == "treespec":  # under another name (pytest collects this folder as a package): nothing to do
    _clone = os.path.dirname(os.path.abspath(__file__))
    _parent = os.path.dirname(_clone)
    _saved = sys.path[:]
    del sys.modules[__name__]  # look again, past the folder that holds the clone
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _parent]
    try:
        _package = importlib.import_module(__name__)
    except ModuleNotFoundError as exc:
        if exc.name != __name__:
            raise
        raise ImportError(
            f"`import treespec` found the source checkout {_clone} (Python looks in the folder it starts "
            f"in first) and no installed treespec: install it with `pip install -e {_clone}` (README.md), "
            "or start Python inside the checkout"
        ) from exc
    finally:
        sys.path[:] = _saved
    sys.modules[__name__] = _package
