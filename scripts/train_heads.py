"""Train heads for a target: the same as ``treespec train-heads`` (see docs/training.md).

python scripts/train_heads.py data  --out runs/data
python scripts/train_heads.py train --kind eagle --data runs/data --out runs/eagle
torchrun --nproc_per_node 2 scripts/train_heads.py train --kind medusa ...   # data-parallel
"""

from __future__ import annotations

import sys

from treespec.cli import main

if __name__ == "__main__":
    sys.exit(main(["train-heads", *sys.argv[1:]]))
