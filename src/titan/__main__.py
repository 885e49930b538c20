"""``python -m titan COMMAND ...`` runs the ``titan`` command line (``torchrun -m titan train``
starts every rank the same way)."""

import sys

from titan.recipes.cli import main

if __name__ == "__main__":
    sys.exit(main())
