"""kernels/counters.py: the buffers that outlive a launch (the arrival counters are checked by their users' tests)."""

import pytest
import torch

from kernels.attention import triton as attention
from kernels.counters import Workspaces
from tests.helpers import rel_err
from tests.kernel_ops.test_attention import EPS, TOL, make_layer, reference


def test_one_workspace_per_shape_dtype_device():
    """The same buffer for every call with a (shape, dtype, device), another for any other (a captured CUDA graph
    keeps its pointers; calls at another shape must not move them); handed out poisoned in tests (conftest)."""
    workspace = Workspaces()
    cpu = torch.device("cpu")
    a = workspace((2, 3), torch.float32, cpu)
    assert a.shape == (2, 3) and a.isnan().all()
    assert workspace((2, 3), torch.float32, cpu) is a
    others = [workspace((3, 2), torch.float32, cpu), workspace((2, 3), torch.int32, cpu)]
    assert all(o is not a for o in others) and (others[1] == 12345).all()
    assert len(workspace.buffers) == 3


def test_decode_ops_keep_their_workspaces():
    """The attention decode's split partials come from its workspace: repeated calls at two batch sizes add no
    buffers after the first call at a shape, and stay right with the buffers poisoned each time (conftest)."""
    attention.decode_workspace.buffers.clear()
    for step, B in enumerate((1, 2, 1, 2)):
        x = make_layer(B, 1, 4, 2, 32, 8, 160, [90 - step] * B, torch.float32, "cpu", seed=step)
        ref, _, _ = reference(x)
        assert rel_err(attention.gated_attention(**x, eps=EPS, scale=32**-0.5), ref) < TOL[torch.float32]
    assert len(attention.decode_workspace.buffers) == 4  # o_part and lse_part at B = 1 and 2


@pytest.mark.gpu
def test_no_workspace_is_allocated_during_capture():
    """A workspace's first allocation inside a CUDA graph capture would come from the graph's pool: refused (warm
    up first, as for Triton's compile)."""
    workspace = Workspaces()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(AssertionError, match="warm up before capture"), torch.cuda.graph(graph):
        workspace((4,), torch.float32, torch.device("cuda"))
