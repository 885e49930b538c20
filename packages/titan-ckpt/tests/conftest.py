"""Shared fixtures of the titan.ckpt tests; the tiny models live in ckpt_testlib.py so that
worker scripts launched in subprocesses can import them too."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


