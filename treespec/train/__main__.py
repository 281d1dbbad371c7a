"""``python -m treespec.train KIND --out DIR ...``, and so ``torchrun --nproc-per-node N -m treespec.train ...``."""

import sys

from treespec.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
