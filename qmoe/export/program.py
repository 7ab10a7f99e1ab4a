"""Program: the exported methods after the device passes, their memory plan, and a minimal executor."""

import operator

import torch
from torch import fx
from torch.export import ExportedProgram

from qmoe.export.methods import INPUT_NAMES, OUTPUT_NAMES, export_methods
from qmoe.export.passes import COPY_DIRECTIONS, call_delegate, is_copy, lower_method
from qmoe.export.planning import ProgramPlan, plan_program
from qmoe.export.settings import ExportError, ExportSettings, device_name


class Delegate:
    """A method's exported graph bound to the live model's weights and caches (by name, never copied):
    delegate(*inputs on the delegate device) -> tuple of outputs. Caches are mutated in place."""

    def __init__(self, method: str, ep: ExportedProgram, model):
        self.graph_module = ep.graph_module
        live = dict(model.named_parameters()) | dict(model.named_buffers())
        placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
        self.args: list[torch.Tensor | None] = []  # None marks a user input slot
        for spec, node in zip(ep.graph_signature.input_specs, placeholders, strict=True):
            kind = spec.kind.name
            if kind == "USER_INPUT":
                self.args.append(None)
            elif kind in ("PARAMETER", "BUFFER"):
                self.args.append(_bind(method, spec.target, live, node.meta["val"], model.device))
            elif kind == "CONSTANT_TENSOR":
                self.args.append(ep.constants[spec.target].to(model.device))
            else:
                raise ExportError(f"method {method}: unsupported exported input kind {kind}")
        self.mutations = []  # (output index, live buffer): a functional graph returns new cache values
        self.user_outputs = []
        targets = [s.target for s in ep.graph_signature.input_specs]
        for i, spec in enumerate(ep.graph_signature.output_specs):
            if spec.kind.name == "BUFFER_MUTATION":
                self.mutations.append((i, self.args[targets.index(spec.target)]))
            elif spec.kind.name == "USER_OUTPUT":
                self.user_outputs.append(i)
            else:
                raise ExportError(f"method {method}: unsupported exported output kind {spec.kind.name}")

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        user = iter(inputs)
        outs = self.graph_module(*(next(user) if a is None else a for a in self.args))
        for i, buf in self.mutations:
            buf.copy_(outs[i])
        return tuple(outs[i] for i in self.user_outputs)


def _bind(method: str, target: str, live: dict, val, device) -> torch.Tensor:
    name = target.removeprefix("model.")
    tensor = live.get(name)
    if tensor is None:
        raise ExportError(f"method {method}: the model has no tensor {name!r} (did the model change since export?)")
    if tuple(tensor.shape) != tuple(val.shape) or tensor.dtype != val.dtype:
        raise ExportError(
            f"method {method}: model tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, "
            f"exported as {tuple(val.shape)} {val.dtype} (call model.setup_caches with the exported batch/length)"
        )
    return tensor


class Method:
    """One method of a Program: `method(*inputs, ledger=None) -> tuple of outputs`.

    Inputs are copied into their planned buffers (no copy when the caller passes the buffer itself: fill
    `input_buffer(name, shape)` in place); outputs are views into the planned arena, valid until this method
    runs again. Copy nodes copy between planned buffers and are recorded in the ledger ("copy_node"); with
    planning off the delegate moves its host inputs to its device and its outputs back itself, recorded as
    "delegate". A copy whose
    source already sits on its destination device (a CPU delegate) is a no-op: it moves no bytes and records
    nothing, exactly like the memcpy a profiler would (not) see. `delegate` may be swapped for any callable
    with the same signature (e.g. a CUDA graph replay): with planning on it is always called with the same
    planned buffers (`delegate_inputs`) when the shapes are static.
    """

    def __init__(self, name: str, graph: fx.GraphModule, plan: ProgramPlan, arenas, delegate, device: str):
        self.name, self.graph, self.plan, self.delegate = name, graph, plan, delegate
        self.device = device  # the delegate device
        self.arenas = arenas  # device -> uint8 tensor (the Program's dict: replacing an entry re-binds), or None
        self.allocations = {a.tensor: a for a in plan.allocations if a.method == name}
        self.nodes = list(graph.graph.nodes)
        self.inputs = [n for n in self.nodes if n.op == "placeholder"]
        self.delegate_node = next(n for n in self.nodes if n.target is call_delegate)

    @property
    def input_names(self) -> list[str]:
        return [n.name for n in self.inputs]

    def buffer(self, tensor: str, shape=None) -> torch.Tensor:
        """The planned buffer of node `tensor` (an input name, a copy node like "h2d_tokens", "delegate_logits")
        as a view of `shape` (default: its upper-bound shape)."""
        if self.arenas is None:
            raise ExportError(f"method {self.name}: plan only (delegate device {self.device} is not the model's)")
        a = self.allocations[tensor]
        dtype = getattr(torch, a.dtype)
        shape = torch.Size(a.shape if shape is None else shape)
        nbytes = shape.numel() * dtype.itemsize
        if nbytes > a.nbytes:
            raise ExportError(f"method {self.name}: {tensor} of shape {tuple(shape)} exceeds its plan {a.shape}")
        return self.arenas[a.device][a.offset : a.offset + nbytes].view(dtype).view(shape)

    def input_buffer(self, name: str, shape=None) -> torch.Tensor:
        """Where input `name` lives: fill it in place and pass it back to skip the input copy."""
        return self.buffer(name, shape)

    def delegate_inputs(self, shapes=None) -> list[torch.Tensor]:
        """The planned buffers the delegate reads (planning on), at their upper-bound shapes by default."""
        shapes = shapes or [None] * len(self.delegate_node.args)
        return [self.buffer(a.name, s) for a, s in zip(self.delegate_node.args, shapes)]

    def _check_input(self, node: fx.Node, x: torch.Tensor) -> None:
        spec, device = node.meta["qmoe_spec"], torch.device(node.meta["qmoe_device"])
        where = f"method {self.name} input {node.name}"
        if not isinstance(x, torch.Tensor):
            raise ExportError(f"{where}: expected a tensor, got {type(x).__name__}")
        if x.device != device:
            why = "export.skip_h2d_for_method_inputs is set" if node.meta["qmoe_placement"] == "delegate" else ""
            why = why or "inputs live on the CPU unless export.skip_h2d_for_method_inputs is set"
            raise ExportError(f"{where} must be on {device} ({why}), got {x.device}")
        if x.dtype != spec.torch_dtype or x.dim() != len(spec.shape):
            expected = f"{spec.dtype} of rank {len(spec.shape)}"
            raise ExportError(f"{where}: expected {expected}, got {x.dtype} {tuple(x.shape)}")
        for i, (size, bound) in enumerate(zip(x.shape, spec.shape)):
            if size > bound if i in spec.dynamic_dims else size != bound:
                raise ExportError(f"{where}: shape {tuple(x.shape)} does not fit {tuple(spec.shape)} at dim {i}")

    @torch.no_grad()
    def __call__(self, *inputs: torch.Tensor, ledger=None) -> tuple[torch.Tensor, ...]:
        if self.arenas is None:
            self.buffer(self.inputs[0].name)  # raises the plan-only error
        if len(inputs) != len(self.inputs):
            raise ExportError(f"method {self.name} takes {len(self.inputs)} inputs ({', '.join(self.input_names)})")
        env = {}
        for node, x in zip(self.inputs, inputs):
            self._check_input(node, x)
            buf = self.buffer(node.name, x.shape)
            if buf.data_ptr() != x.data_ptr():
                buf.copy_(x)
            env[node] = buf
        for node in self.nodes:
            if is_copy(node):
                src = env[node.args[0]]
                if self.allocations[node.name].alias_of is not None:
                    env[node] = src  # source and destination on one device: nothing to move
                    continue
                env[node] = node.target(src, self.buffer(node.name, src.shape))
                if ledger is not None:
                    ledger.record(COPY_DIRECTIONS[node.target], src.nbytes, self.name, "copy_node")
            elif node.target is call_delegate:
                env[node] = self.delegate(*(self._to_delegate(env[a], ledger) for a in node.args))
            elif node.target is operator.getitem:
                out = env[node.args[0]][node.args[1]]
                buf = self.buffer(node.name, out.shape)
                if ledger is not None and buf.device != out.device:  # planning off: the delegate copies out
                    ledger.record("d2h", out.nbytes, self.name, "delegate")
                env[node] = buf.copy_(out)
        return tuple(env[n] for n in self.nodes[-1].args[0])

    def _to_delegate(self, x: torch.Tensor, ledger) -> torch.Tensor:
        """Planning off: the delegate copies a host input to its device itself, on every call."""
        if x.device == torch.device(self.device):
            return x
        if ledger is not None:
            ledger.record("h2d", x.nbytes, self.name, "delegate")
        return x.to(self.device)


class Program:
    """The exported methods of one model, after the device passes, with their memory plan.

    .methods {name: Method}, .settings ExportSettings, .plan ProgramPlan, .graphs {name: fx.GraphModule}
    (the top-level method graphs with device metadata), .exported {name: ExportedProgram}, .save(dir, ...).
    """

    def __init__(self, exported: dict, model, settings: ExportSettings, batch_size: int, max_seq_len: int):
        self.exported, self.settings = exported, settings
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.model_config = model.config
        self.kernels = {group: module.__name__ for group, module in model.ops.items()}  # what the graphs call
        self.delegate_device = settings.resolve_delegate_device(model.device)
        self.graphs = {
            m: lower_method(m, ep, INPUT_NAMES[m], OUTPUT_NAMES[m], settings, self.delegate_device)
            for m, ep in exported.items()
        }
        self.plan = plan_program(self.graphs, self.delegate_device, settings.alignment)
        self.executable = self.delegate_device == device_name(model.device)
        self.arenas = None
        if self.executable:  # allocated once, at load: every call reuses these bytes
            self.arenas = {d: torch.empty(size, dtype=torch.uint8, device=d) for d, size in self.plan.arenas.items()}
        self.methods = {
            m: Method(
                m,
                gm,
                self.plan,
                self.arenas,
                Delegate(m, exported[m], model) if self.executable else None,
                self.delegate_device,
            )
            for m, gm in self.graphs.items()
        }

    def save(self, directory, weights_identity: dict):
        """Write the self-describing program directory (see artifact.py) -> its Path."""
        from qmoe.export.artifact import save_program  # artifact builds on Program

        return save_program(self, directory, weights_identity)


def export_program(model, settings: ExportSettings, batch_size: int, max_seq_len: int) -> Program:
    """Export every method of settings.method_split over `model` (caches set up by model.setup_caches(batch_size,
    max_seq_len)), run the device passes and plan memory -> Program. Runs where the model lives."""
    if model.batch_size != batch_size or model.max_seq_len < max_seq_len:
        raise ExportError(
            f"the model's caches are for batch {model.batch_size} x {model.max_seq_len} positions; "
            f"call model.setup_caches({batch_size}, {max_seq_len}) before exporting"
        )
    return Program(
        export_methods(model, settings.method_split, batch_size, max_seq_len), model, settings, batch_size, max_seq_len
    )
