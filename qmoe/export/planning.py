"""Device-aware memory planning: every tensor the runtime holds, placed by lifetime into one arena per device.

Planned tensors, per method: the method inputs and outputs, the delegate's boundary tensors (its outputs) and
the copy destinations. The delegate's internal activations are its own business (as in ExecuTorch).
Methods run one at a time, so all methods share one timeline: method k's nodes occupy their own span of it.
Method inputs and outputs are pinned (live for the whole program: they are the static buffers a caller and a
CUDA graph bind to, and an output stays valid until its method runs again); every other tensor lives from
the node that makes it to its last use, so tensors of different methods, or with disjoint lifetimes in one
method, share bytes. A copy node whose source already sits on its destination device (a CPU delegate) is a
no-op: it aliases its source instead of taking memory. A method output that another method takes as input
(methods.FEEDS: forward's logits are sample's, a sampled token is the next step's tokens) is planned into that
input's bytes when both sit on one device, so handing it over copies nothing. Dynamic dims are planned at their
upper bound.
"""

import json
from dataclasses import asdict, dataclass, field

from torch import fx

from qmoe.export.methods import FEEDS, OUTPUT_NAMES
from qmoe.export.passes import COPY_DIRECTIONS, copy_nodes, is_copy


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
    alias_of: str | None = None  # key (method.tensor) whose bytes it uses: a no-op copy's source, a fed input

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


@dataclass
class _Tensor:
    """One planned tensor while planning: its node, role and lifetime, and the tensor whose bytes it uses."""

    method: str
    node: fx.Node
    role: str  # input | output | h2d | d2h | delegate_output
    start: int
    end: int
    root: "_Tensor | None" = None  # None: its own bytes

    @property
    def key(self) -> str:
        return f"{self.method}.{self.node.name}"

    @property
    def device(self) -> str:
        return self.node.meta["qmoe_device"]

    @property
    def spec(self):
        return self.node.meta["qmoe_spec"]

    @property
    def pinned(self) -> bool:
        return self.role in ("input", "output")

    def storage(self) -> "_Tensor":
        return self if self.root is None else self.root.storage()


def _tensors(method: str, gm: fx.GraphModule, t0: int) -> list[_Tensor]:
    """The planned tensors of one method graph, timed from t0; a copy node on its source's device (a CPU
    delegate) uses its source's bytes."""
    nodes = list(gm.graph.nodes)
    time = {n: t0 + i for i, n in enumerate(nodes)}
    outputs = nodes[-1].args[0]
    tensors: dict[fx.Node, _Tensor] = {}
    for n in nodes:
        if "qmoe_spec" not in n.meta:
            continue
        if n.op == "placeholder":
            role = "input"
        elif n in outputs:
            role = "output"
        else:
            role = COPY_DIRECTIONS[n.target] if is_copy(n) else "delegate_output"
        end = max((time[u] for u in n.users), default=time[n])
        t = tensors[n] = _Tensor(method, n, role, time[n], end)
        src = tensors.get(n.args[0]) if is_copy(n) else None
        if src is not None and src.device == t.device:
            t.root = src
    return list(tensors.values())


def _share_fed_inputs(graphs: dict[str, fx.GraphModule], tensors: list[_Tensor]) -> None:
    """A method output that another method takes as input (methods.FEEDS) uses that input's bytes when both sit
    on one device and it fits: the runner hands it over without a copy."""
    by_key = {t.key: t for t in tensors}
    for (producer, output), (consumer, name) in FEEDS.items():
        if producer not in graphs or consumer not in graphs:
            continue
        out_node = next(iter(graphs[producer].graph.find_nodes(op="output"))).args[0][
            OUTPUT_NAMES[producer].index(output)
        ]
        out, inp = by_key[f"{producer}.{out_node.name}"].storage(), by_key[f"{consumer}.{name}"]
        fits = out.spec.dtype == inp.spec.dtype and out.spec.nbytes <= inp.spec.nbytes
        if out.device == inp.device and fits and out is not inp.storage():
            out.root = inp


def plan_program(graphs: dict[str, fx.GraphModule], delegate_device: str, alignment: int) -> ProgramPlan:
    """Plan every method graph (after the device passes) into one arena per device."""
    tensors, t0 = [], 0
    for method, gm in graphs.items():
        tensors += _tensors(method, gm, t0)
        t0 += len(gm.graph.nodes)
    _share_fed_inputs(graphs, tensors)

    # Lifetime of each storage: the union over the tensors that use its bytes; pinned covers all time.
    span: dict[str, tuple[int, int]] = {}
    for t in tensors:
        start, end = (0, t0) if t.pinned else (t.start, t.end)
        key = t.storage().key
        s, e = span.get(key, (start, end))
        span[key] = (min(s, start), max(e, end))

    by_device: dict[str, list[Request]] = {}
    for t in tensors:
        if t.root is None:
            by_device.setdefault(t.device, []).append(Request(t.key, t.spec.nbytes, *span[t.key]))
    arenas, naive, offsets = {}, {}, {}
    for device, requests in sorted(by_device.items()):
        placed, arenas[device] = plan_arena(requests, alignment)
        offsets.update(placed)
        naive[device] = sum(align(r.nbytes, alignment) for r in requests)

    allocations = []
    for t in tensors:
        storage = t.storage().key
        allocations.append(
            Allocation(
                method=t.method,
                tensor=t.node.name,
                role=t.role,
                device=t.device,
                shape=list(t.spec.shape),
                dtype=t.spec.dtype,
                nbytes=t.spec.nbytes,
                offset=offsets[storage],
                start=span[storage][0],
                end=span[storage][1],
                alias_of=None if storage == t.key else storage,
            )
        )
    copies = {method: copy_nodes(gm) for method, gm in graphs.items()}
    return ProgramPlan(delegate_device, alignment, arenas, naive, allocations, copies, list(graphs))
