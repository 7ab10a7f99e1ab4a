"""Passes over a method's top-level graph: partition, device propagation, H2D/D2H copy nodes.

After torch.export, `partition` builds the method's top-level torch.fx graph (ExecuTorch's view of a lowered
method): placeholders for the method inputs, one `call_delegate` node that runs the part placed on the target
device (here the whole exported graph: every op of the model has a device implementation), a getitem per
delegate output, and the output node. Every tensor-producing node then carries in `node.meta`:
  qmoe_spec:      TensorSpec (name, upper-bound shape, dtype) -- dynamic T planned at max_seq_len
  qmoe_placement: "host" or "delegate" -- which side of the delegate boundary holds it
  qmoe_device:    "cpu" for host tensors, the delegate device (e.g. "cuda:0") for delegate tensors
With device memory planning on, `insert_copy_nodes` puts an explicit `h2d_copy` before each delegate input
that comes from the host and a `d2h_copy` after each delegate output consumed on the host (a method output
counts as consumed on the host unless its D2H is skipped). A method holds one delegate, so no h2d(d2h(x)) round
trip can form inside a method; between methods, an output fed to the next method's input shares its planned
slot instead (planning.py). With planning off the delegate node is marked `qmoe_self_copies`: it copies its host inputs
in and its outputs out itself, on every call. Devices are metadata, so CPU-only tests can check all of this.
"""

import operator
from dataclasses import dataclass, replace

import torch
from torch import fx
from torch.export import ExportedProgram

from qmoe.export.settings import ExportSettings


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # upper bound of each dim
    dtype: str  # "float32", "int64", ...
    dynamic_dims: tuple[int, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.torch_dtype.itemsize


def h2d_copy(src: torch.Tensor) -> torch.Tensor:
    """Marks a copy node: a host tensor into its planned buffer on the delegate device (Method runs it)."""
    raise RuntimeError("h2d_copy marks a copy node in a method graph; Method runs it")


def d2h_copy(src: torch.Tensor) -> torch.Tensor:
    """Marks a copy node: a delegate tensor into its planned buffer on the host (Method runs it)."""
    raise RuntimeError("d2h_copy marks a copy node in a method graph; Method runs it")


def call_delegate(*args):
    raise RuntimeError("call_delegate marks the delegate in a method graph; Method runs it")


COPY_DIRECTIONS = {h2d_copy: "h2d", d2h_copy: "d2h"}


def is_copy(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in COPY_DIRECTIONS


def _upper_bound_spec(name: str, val: torch.Tensor, ep: ExportedProgram) -> TensorSpec:
    bounds = {sym: vr.upper for sym, vr in ep.range_constraints.items()}
    shape, dynamic = [], []
    for i, size in enumerate(val.shape):
        if isinstance(size, torch.SymInt):
            shape.append(int(size.node.expr.subs(bounds)))
            dynamic.append(i)
        else:
            shape.append(int(size))
    return TensorSpec(name, tuple(shape), str(val.dtype).removeprefix("torch."), tuple(dynamic))


def partition(method: str, ep: ExportedProgram, input_names, output_names) -> fx.GraphModule:
    """The method's top-level graph: inputs -> call_delegate(exported graph) -> outputs, with qmoe_spec."""
    user_inputs = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    outputs = next(n for n in ep.graph.nodes if n.op == "output").args[0]
    user_outputs = [o for o, s in zip(outputs, ep.graph_signature.output_specs) if s.kind.name == "USER_OUTPUT"]
    graph = fx.Graph()
    inputs = []
    for name, arg in zip(input_names, user_inputs, strict=True):
        node = graph.placeholder(name)
        node.meta["qmoe_spec"] = _upper_bound_spec(name, placeholders[arg].meta["val"], ep)
        inputs.append(node)
    delegate = graph.call_function(call_delegate, tuple(inputs))
    delegate.name = "delegate"
    delegate.meta["qmoe_method"] = method
    results = []
    for i, (name, out) in enumerate(zip(output_names, user_outputs, strict=True)):
        node = graph.call_function(operator.getitem, (delegate, i))
        node.name = f"delegate_{name}"
        node.meta["qmoe_spec"] = _upper_bound_spec(node.name, out.meta["val"], ep)
        results.append(node)
    graph.output(tuple(results))
    gm = fx.GraphModule(torch.nn.Module(), graph, class_name=method)
    gm.meta["qmoe_method"] = method
    return gm


def _set_device(node: fx.Node, placement: str, delegate_device: str) -> None:
    node.meta["qmoe_placement"] = placement
    node.meta["qmoe_device"] = delegate_device if placement == "delegate" else "cpu"


def propagate_devices(gm: fx.GraphModule, settings: ExportSettings, delegate_device: str) -> fx.GraphModule:
    """Give every tensor a placement and device: method inputs on the host unless their H2D is skipped,
    the delegate and its outputs on the delegate device (on the host with planning off: the delegate copies
    its outputs out itself), copy nodes on their destination side."""
    method = gm.meta["qmoe_method"]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            _set_device(node, "delegate" if settings.skip_h2d(method) else "host", delegate_device)
        elif node.target is call_delegate:
            _set_device(node, "delegate", delegate_device)
            node.meta["qmoe_self_copies"] = not settings.device_memory_planning
        elif node.target is operator.getitem:
            placement = "delegate" if settings.device_memory_planning else "host"
            _set_device(node, placement, delegate_device)
        elif is_copy(node):
            _set_device(node, "delegate" if node.target is h2d_copy else "host", delegate_device)
    return gm


def _copy_node(graph: fx.Graph, target, src: fx.Node, delegate_device: str) -> fx.Node:
    node = graph.call_function(target, (src,))
    direction = COPY_DIRECTIONS[target]
    node.name = f"{direction}_{src.meta['qmoe_spec'].name.removeprefix('delegate_')}"
    node.meta["qmoe_spec"] = replace(src.meta["qmoe_spec"], name=node.name)
    _set_device(node, "delegate" if direction == "h2d" else "host", delegate_device)
    return node


def insert_copy_nodes(gm: fx.GraphModule, settings: ExportSettings, delegate_device: str) -> fx.GraphModule:
    """With device memory planning on: h2d before each delegate input from the host, d2h after each delegate
    output used on the host (method outputs are, unless their D2H is skipped). Off: nothing to insert."""
    if not settings.device_memory_planning:
        return gm
    method = gm.meta["qmoe_method"]
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is call_delegate:
            new_args = []
            for arg in node.args:
                if arg.meta["qmoe_placement"] == "host":
                    with graph.inserting_before(node):
                        arg = _copy_node(graph, h2d_copy, arg, delegate_device)
                new_args.append(arg)
            node.args = tuple(new_args)
        elif node.target is operator.getitem and not settings.skip_d2h(method):
            host_users = [u for u in node.users if u is output or u.meta.get("qmoe_placement") == "host"]
            if host_users:
                with graph.inserting_after(node):
                    copy = _copy_node(graph, d2h_copy, node, delegate_device)
                for user in host_users:
                    user.replace_input_with(node, copy)
    graph.lint()
    return gm


def lower_method(
    method: str, ep: ExportedProgram, input_names, output_names, settings: ExportSettings, delegate_device: str
) -> fx.GraphModule:
    """partition -> propagate_devices -> insert_copy_nodes."""
    gm = partition(method, ep, input_names, output_names)
    gm = propagate_devices(gm, settings, delegate_device)
    return insert_copy_nodes(gm, settings, delegate_device)


def copy_nodes(gm: fx.GraphModule) -> list[dict]:
    """[{direction, tensor, nbytes, src_device, dst_device}] of the method's copy nodes, in graph order."""
    return [
        {
            "direction": COPY_DIRECTIONS[n.target],
            "tensor": n.args[0].meta["qmoe_spec"].name,
            "nbytes": n.meta["qmoe_spec"].nbytes,
            "src_device": n.args[0].meta["qmoe_device"],
            "dst_device": n.meta["qmoe_device"],
        }
        for n in gm.graph.nodes
        if is_copy(n)
    ]
