"""Test probes for RL runs started by the tests (this folder is on their PYTHONPATH, so every
process of such a run imports this at start-up). Inactive unless its variable is set.

TITAN_TEST_REFUSE_FULL_LOGITS=1: gathering a 3-d DTensor whose last dimension is the padded
vocabulary (full logits, [B, S, V]) raises, so a run under tensor parallel proves that its
loss works on vocab-sharded logits.
"""

import os

if os.environ.get("TITAN_TEST_REFUSE_FULL_LOGITS") == "1":
    from torch.distributed.tensor import DTensor

    _full_tensor = DTensor.full_tensor

    def _refusing_full_tensor(self, *args, **kwargs):
        if self.dim() == 3 and self.shape[-1] >= 256:  # byte tokenizer: 256 + special ids
            raise AssertionError(f"the full logits {tuple(self.shape)} were gathered")
        return _full_tensor(self, *args, **kwargs)

    DTensor.full_tensor = _refusing_full_tensor
