"""mori.ep pieces that need no GPU."""

from __future__ import annotations

import pytest

from mori import errors
from mori.ep import EpConfig


def test_config_is_validated():
    with pytest.raises(errors.InvalidArgumentError, match="topk"):
        EpConfig(num_experts=8, hidden=1024, max_tokens_per_rank=16, topk=10)
    with pytest.raises(errors.InvalidArgumentError, match="hidden"):
        EpConfig(num_experts=8, hidden=1000, max_tokens_per_rank=16)
    with pytest.raises(errors.InvalidArgumentError, match="positive"):
        EpConfig(num_experts=8, hidden=1024, max_tokens_per_rank=0)
    c = EpConfig(num_experts=256, hidden=7168, max_tokens_per_rank=4096)
    assert (c.topk, c.num_sms) == (8, 24)
    with pytest.raises(Exception):
        c.hidden = 1  # frozen
