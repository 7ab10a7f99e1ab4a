"""CUDA graphs over a method's delegate: captured once on its static planned buffers, replayed every decode step.

With device memory planning on, a Method calls its delegate with the same planned buffers every step (the copy
nodes write into them), so the delegate's kernels can be captured once and replayed: no launches from Python,
no allocation. The delegate's write of each output into its planned buffer is part of the capture. The copy
nodes and the runner's small ops (token feed, position advance) stay eager around it, so every copy between
memory spaces is still made, and recorded, by the executor.
"""

import torch

from qmoe.parallel import collectives


class GraphedDelegate:
    """Wraps `method.delegate`. While `enabled`, a call with inputs seen before (same storage and shapes) is
    warmed up eagerly `warmup` times, then captured, and replayed from then on; the outputs are the graph's
    static tensors. While not enabled (prefill, whose shapes change), it runs eagerly."""

    def __init__(self, delegate, pool, warmup: int = 1):
        self.delegate, self.pool, self.warmup = delegate, pool, warmup
        self.enabled = False
        self.calls: dict[tuple, int] = {}
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple, list]] = {}

    def __call__(self, *inputs: torch.Tensor, out=()) -> tuple[torch.Tensor, ...]:
        if not self.enabled:
            return self.delegate(*inputs, out=out)
        key = tuple((x.data_ptr(), tuple(x.shape)) for x in (*inputs, *(o for o in out if o is not None)))
        if key in self.graphs:
            graph, outputs, captured = self.graphs[key]
            graph.replay()
            collectives.replayed(captured)  # its NCCL kernels ran without Python: recorded as at capture
            return outputs
        self.calls[key] = self.calls.get(key, 0) + 1
        if self.calls[key] <= self.warmup:  # first launches compile / autotune: never inside a capture
            return self.delegate(*inputs, out=out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), collectives.capturing() as captured:
            outputs = self.delegate(*inputs, out=out)  # writing the planned outputs is captured too
        self.graphs[key] = (graph, outputs, captured)
        graph.replay()  # capturing records the work without doing it
        collectives.replayed(captured)
        return outputs


def graph_delegates(program, methods) -> list[GraphedDelegate]:
    """Swap the delegates of `methods` for GraphedDelegates sharing one memory pool; returns them."""
    pool = torch.cuda.graph_pool_handle()
    graphed = []
    for name in methods:
        method = program.methods[name]
        method.delegate = GraphedDelegate(method.delegate, pool)
        graphed.append(method.delegate)
    return graphed
