"""Make the shared test helpers importable (pytest runs with --import-mode=importlib)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
