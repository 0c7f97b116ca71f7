"""The DeepEP facade (mori.ep.deepep.Buffer) across nodes: MORI_NODE splits the MORI_TEST_WORLD
ranks into two emulated nodes (2 x 1 at world 2, 2 x 2 at world 4, 2 x 4 at world 8; ranks share
GPUs where there are fewer), and the same DeepEP-shaped program as tests/test_gpu_ep_deepep.py
(default device cuda, bf16 default dtype, a torch.distributed group) runs every case across
them: the normal mode on mori.ep's internode kernels (every token to another node crosses once
through the shmem proxy), the low-latency mode with each call's tokens for a rank on the other
node packed into one message through the proxy windows (hooks, FP8 scale formats, wait-time
statistics, zero-copy, CUDA-graph capture and replay). Checked as there, with the node-grouped combine reference (each node's rows summed and
rounded first), num_tokens_per_rdma_rank (tokens to each node), combined top-k weights passed
back rank-dependent, dispatch by layout alone (the callers' counts per expert carried by the
count exchange), cached dispatch, alignment and worst-case padding, bias, growth of the buffer,
hidden 2048 / 4096 / 7168 (the last needs the proxy window that DeepEP's ``num_rdma_bytes`` sized,
more than mori's default).
"""

from __future__ import annotations

import pytest

from tests._ranks import assert_ok, by_case, run_ranks, skip_unless_gpus
from tests.test_gpu_ep_deepep import NODE_CASES, WORLD, _suite

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

NODES = 2
RANKS_TIMEOUT_S = 180.0 + 30.0 * WORLD  # every cross-node call pays proxy round trips on a shared GPU


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    if WORLD % NODES:
        pytest.skip(f"MORI_TEST_WORLD={WORLD} does not split into {NODES} nodes")
    skip_unless_gpus(WORLD)
    store = tmp_path_factory.mktemp("deepep-nodes") / "store"
    return by_case(run_ranks(_suite, WORLD, str(store), NODES, timeout=RANKS_TIMEOUT_S), WORLD, NODE_CASES)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", NODE_CASES)
def test_deepep_facade_across_nodes(suite, case):
    assert_ok({case: suite[case]})
