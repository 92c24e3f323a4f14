"""Skip markers for what an older torch lacks (the GPU machine's image runs torch
2.11); each names what annot does there instead."""

import pytest
from torch.distributed.fsdp import FSDPModule

fsdp_unused_params = pytest.mark.skipif(
    not hasattr(FSDPModule, "set_reduce_scatter_unused_params"),
    reason="this torch's FSDP2 lacks set_reduce_scatter_unused_params: annot refuses "
    "fsdp=True on it (tests/test_fsdp.py checks the refusal)",
)
