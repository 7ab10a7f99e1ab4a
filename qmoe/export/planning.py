"""Device-aware memory planning: every tensor the runtime holds, placed by lifetime into one arena per device.

Planned tensors, per method: the method inputs and outputs, the delegate's boundary tensors (its outputs) and
the copy destinations. The delegate's internal activations are its own business (as in ExecuTorch).
Methods run one at a time, so all methods share one timeline: method k's nodes occupy their own span of it.
Method inputs and outputs are pinned (live for the whole program: they are the static buffers a caller and a
CUDA graph bind to, and an output stays valid until its method runs again); every other tensor lives from
the node that makes it to its last use, so tensors of different methods, or with disjoint lifetimes in one
method, share bytes. A copy node whose source already sits on its destination device (a CPU delegate) is a
no-op: it aliases its source instead of taking memory. Dynamic dims are planned at their upper bound.
"""

import json
from dataclasses import asdict, dataclass, field

from torch import fx

from qmoe.export.passes import copy_nodes, is_copy


@dataclass(frozen=True)
class Request:
    key: str
    nbytes: int
    start: int  # first time step the tensor is live
    end: int  # last time step it is live (inclusive)


def align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan_arena(requests: list[Request], alignment: int) -> tuple[dict[str, int], int]:
    """Greedy by size, first fit: each tensor at the lowest aligned offset where it overlaps no placed tensor
    whose lifetime overlaps its own -> ({key: offset}, arena size). Never larger than the aligned naive sum:
    a tensor lands at or below the end of the tensors already placed that are live with it."""
    placed: list[tuple[int, int, Request]] = []  # (offset, aligned size, request)
    offsets = {}
    for req in sorted(requests, key=lambda r: (-r.nbytes, r.start, r.key)):
        size = align(req.nbytes, alignment)
        live = sorted((o, s) for o, s, r in placed if s and r.start <= req.end and req.start <= r.end)
        offset = 0
        for o, s in live:
            if offset + size <= o:
                break
            offset = max(offset, o + s)
        offsets[req.key] = offset
        placed.append((offset, size, req))
    return offsets, max((o + s for o, s, _ in placed), default=0)


@dataclass
class Allocation:
    method: str
    tensor: str  # node name in the method graph
    role: str  # input | output | h2d | d2h | delegate_output
    device: str
    shape: list[int]  # upper bound
    dtype: str
    nbytes: int  # at the upper bound
    offset: int
    start: int
    end: int
    alias_of: str | None = None  # a no-op copy shares its source's bytes

    @property
    def key(self) -> str:
        return f"{self.method}.{self.tensor}"


@dataclass
class ProgramPlan:
    delegate_device: str
    alignment: int
    arenas: dict[str, int]  # device -> bytes
    naive_bytes: dict[str, int]  # device -> sum of aligned sizes of the non-alias tensors
    allocations: list[Allocation]
    copies: dict[str, list[dict]]  # method -> copy nodes {direction, tensor, nbytes, src_device, dst_device}
    methods: list[str] = field(default_factory=list)

    def allocation(self, method: str, tensor: str) -> Allocation:
        return next(a for a in self.allocations if a.method == method and a.tensor == tensor)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ProgramPlan":
        d = json.loads(text)
        d["allocations"] = [Allocation(**a) for a in d["allocations"]]
        return cls(**d)


def _role(node: fx.Node, is_output: bool) -> str:
    if node.op == "placeholder":
        return "input"
    if is_output:
        return "output"
    if is_copy(node):
        return node.name.split("_", 1)[0]
    return "delegate_output"


def plan_program(graphs: dict[str, fx.GraphModule], delegate_device: str, alignment: int) -> ProgramPlan:
    """Plan every method graph (after the device passes) into one arena per device."""
    nodes = {}  # key -> (method, node, start, end, pinned)
    roots = {}  # key -> key of the tensor whose bytes it uses
    t0 = 0
    order = []
    for method, gm in graphs.items():
        graph_nodes = list(gm.graph.nodes)
        time = {n: t0 + i for i, n in enumerate(graph_nodes)}
        output = graph_nodes[-1]
        for n in graph_nodes:
            if "qmoe_spec" not in n.meta:
                continue
            key = f"{method}.{n.name}"
            end = max((time[u] for u in n.users), default=time[n])
            nodes[key] = (method, n, time[n], end, n.op == "placeholder" or n in output.args[0])
            src = n.args[0] if is_copy(n) else None
            same_device = src is not None and src.meta["qmoe_device"] == n.meta["qmoe_device"]
            roots[key] = roots[f"{method}.{src.name}"] if same_device else key
            order.append(key)
        t0 += len(graph_nodes)
    horizon = t0

    # Lifetime of each storage root: the union over the tensors that use its bytes; pinned covers all time.
    span = {}
    for key in order:
        _, _, start, end, pinned = nodes[key]
        if pinned:
            start, end = 0, horizon
        r = roots[key]
        s, e = span.get(r, (start, end))
        span[r] = (min(s, start), max(e, end))

    by_device: dict[str, list[Request]] = {}
    for r, (s, e) in span.items():
        node = nodes[r][1]
        by_device.setdefault(node.meta["qmoe_device"], []).append(Request(r, node.meta["qmoe_spec"].nbytes, s, e))
    arenas, naive, offsets = {}, {}, {}
    for device, requests in sorted(by_device.items()):
        placed, arenas[device] = plan_arena(requests, alignment)
        offsets.update(placed)
        naive[device] = sum(align(r.nbytes, alignment) for r in requests)

    allocations = []
    for key in order:
        method, n, start, end, pinned = nodes[key]
        spec, r = n.meta["qmoe_spec"], roots[key]
        s, e = span[r]
        allocations.append(
            Allocation(
                method=method,
                tensor=n.name,
                role=_role(n, pinned and n.op != "placeholder"),
                device=n.meta["qmoe_device"],
                shape=list(spec.shape),
                dtype=spec.dtype,
                nbytes=spec.nbytes,
                offset=offsets[r],
                start=s,
                end=e,
                alias_of=None if r == key else r.split(".", 1)[1],
            )
        )
    copies = {method: copy_nodes(gm) for method, gm in graphs.items()}
    return ProgramPlan(delegate_device, alignment, arenas, naive, allocations, copies, list(graphs))
