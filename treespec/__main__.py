"""``python -m treespec ...`` runs the ``treespec`` command line."""

import sys

from treespec.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
