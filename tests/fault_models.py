"""A model that fails on demand, for the end-to-end fault tests."""

import os
import time

import torch.nn as nn


class Faulty(nn.Module):
    """Four blocks; the block at ``FAULT_BLOCK`` raises, hangs or kills its
    process on microbatch ``FAULT_CALL`` according to ``FAULT_KIND``."""

    def __init__(self, width=4):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(4)])
        self.calls = 0

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == int(os.environ.get("FAULT_BLOCK", "-1")):
                self.calls += 1
                if self.calls == int(os.environ.get("FAULT_CALL", "2")):
                    kind = os.environ["FAULT_KIND"]
                    if kind == "raise":
                        raise ValueError("boom in block 3")
                    if kind == "hang":
                        time.sleep(3600)
                    if kind == "kill":
                        os._exit(7)
        return x.sum()
