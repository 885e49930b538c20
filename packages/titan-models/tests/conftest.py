"""Shared tiny-model helpers for the titan-models tests."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from titan.models.llama3 import build_llama3

sys.path.insert(0, os.path.dirname(__file__))  # titan_models_testlib (--import-mode=importlib)

TINY = dict(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=128, max_seq_len=64)
"""debugmodel shrunk to test size (head_dim 8, GQA 2:1, llama3 RoPE scaling kept)."""


def build_tiny(seed: int = 0, **overrides):
    """Tiny Llama 3 built on meta, materialized on CPU and initialized from `seed`."""
    with torch.device("meta"):
        model = build_llama3("debugmodel", **{**TINY, **overrides})
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.fixture
def make_tiny():
    """The `build_tiny` factory (tests import helpers through fixtures: importlib mode)."""
    return build_tiny


@pytest.fixture
def tiny():
    """Overrides that turn debugmodel into the tiny test model."""
    return dict(TINY)


@pytest.fixture
def tiny_model():
    """A freshly initialized tiny model."""
    return build_tiny()
