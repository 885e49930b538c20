"""titan.models: model families as plain single-device PyTorch.

Import a family explicitly (`from titan.models.llama3 import build_llama3`); this package
imports nothing itself so that `import titan.models` stays cheap.
"""
