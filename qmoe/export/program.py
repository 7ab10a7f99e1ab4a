"""Program: the exported methods after the device passes, their memory plan, and a minimal executor."""

import copy
import operator

import torch
from torch import fx
from torch.export import ExportedProgram

from qmoe.export.artifact import read_program, save_program
from qmoe.export.methods import INPUT_NAMES, OUTPUT_NAMES, export_methods
from qmoe.export.passes import call_delegate, is_copy, lower_method
from qmoe.export.planning import ProgramPlan, plan_program
from qmoe.export.settings import ExportError, ExportSettings, device_name, torch_device
from qmoe.runtime.ledger import HOST, transfer

DELEGATE_RANGE = "qmoe::delegate"  # profiler range of a delegate call: the memcpys inside it are its own work


CASTS = (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default)


def _out_variants() -> dict:
    """Exported op -> its out-variant f(*op args, out). ExecuTorch runs every op as an out-variant into planned
    memory; here only the op that produces a method output needs one, so that it writes the planned buffer."""
    from kernels.linear import naive, triton  # the triton modules register the qmoe ops
    from kernels.sampling import triton as sampling

    return {
        torch.ops.aten.linear.default: naive.linear_out,
        torch.ops.qmoe.linear.default: triton.linear_out,
        torch.ops.qmoe.logits.default: triton.logits_out,
        torch.ops.qmoe.greedy.default: sampling.greedy_out,
    }


def eager_custom_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose custom-op nodes (the Triton ops: torch.library.custom_op, there for the tracer's fakes)
    call the Python functions they wrap, as the eager model does (kernels.tracing): the dispatcher's round trip
    costs ~7 us of host time per call on this project's CPU machine (`torch.ops.qmoe.linear` 16.7 us, the function
    it wraps 9.9, launches stubbed as in experiments/host_overhead_cpu.py), about twice that on the H200 host,
    which a prefill (~300 op calls) and every step outside a CUDA graph pay. A qmoe::all_reduce of a fresh tensor
    that nothing else reads (a module's partial sums) reduces it in its own memory, without the copy the custom op
    makes (`collectives.all_reduce_consumed`: 80 kernels fewer in a TP2 step of the 35B)."""
    from torch._library.custom_ops import OPDEFS  # qualified name -> CustomOpDef: the function it was made from

    from qmoe.parallel import collectives

    graph = copy.deepcopy(gm.graph)
    consumed = {n for n in graph.nodes if n.target is torch.ops.qmoe.all_reduce.default and _fresh_and_only(n.args[0])}
    for node in graph.nodes:
        if node in consumed:  # a module's partial sums: reduced in their own memory, not in a copy
            node.target = collectives.all_reduce_consumed
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            opdef = OPDEFS.get(node.target._schema.name)
            if opdef is not None:
                node.target = opdef._init_fn
    return fx.GraphModule(gm, graph)


def _fresh_and_only(node: fx.Node) -> bool:
    """`node` is an op's result that aliases nothing (no view, input, weight or cache) and has one reader."""
    op = node.target
    fresh = node.op == "call_function" and isinstance(op, torch._ops.OpOverload)
    return fresh and not any(r.alias_info for r in op._schema.returns) and _uses(node) == 1


def _cast_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(x)  # the cast kernel itself writes the planned buffer


def _dtype(node: fx.Node) -> torch.dtype:
    return node.meta["val"].dtype


ASSERT = torch.ops.aten._assert_tensor_metadata.default  # export's metadata check: reads none of the value


def _uses(node: fx.Node) -> int:
    """How many nodes consume `node`'s value."""
    return sum(u.target is not ASSERT for u in node.users)


def outputs_in_place(gm: fx.GraphModule, user_outputs: list[int]) -> tuple[fx.GraphModule, list[bool]]:
    """A copy of `gm` that takes one more input per user output (its planned buffer) and computes each output
    whose last op has an out-variant, or is a dtype cast, straight into it -> (graph module, which outputs are
    written in place). The others are returned as before, and the executor copies them (a counted d2d copy)."""
    graph = copy.deepcopy(gm.graph)
    variants = _out_variants()
    result = next(n for n in graph.nodes if n.op == "output")
    values = list(result.args[0])
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    written = []
    for j, i in enumerate(user_outputs):
        with graph.inserting_after(last_input):
            last_input = buf = graph.placeholder(f"planned_out_{j}")
        chain = [values[i]]
        while (
            chain[-1].target in CASTS
            and _dtype(chain[-1].args[0]) == _dtype(chain[-1])
            and _uses(chain[-1].args[0]) == 1
        ):
            chain.append(chain[-1].args[0])  # a cast to the dtype it already has returns its input
        node = chain[-1]
        if _uses(node) == 1 and node.target in CASTS and _dtype(node.args[0]) != _dtype(node):
            writer, args = _cast_into, node.args[:1]
        elif _uses(node) == 1 and node.target in variants and not node.kwargs:
            writer, args = variants[node.target], node.args
        else:
            written.append(False)
            continue
        with graph.inserting_after(node):
            values[i] = graph.call_function(writer, (*args, buf))
        for check in [u for c in chain for u in c.users if u.target is ASSERT]:  # else they keep the replaced op
            graph.erase_node(check)  # alive, and it would run a second time
        written.append(True)
    result.args = (tuple(values),)
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph), written


class Delegate:
    """A method's exported graph bound to the live model's weights and caches (by name, never copied):
    delegate(*inputs on the delegate device, out=buffers) -> tuple of outputs. Caches are mutated in place.
    Given its outputs' planned buffers (`out`), the delegate computes each output whose last op has an
    out-variant straight into its buffer (`outputs_in_place`); the others come back as the graph's own tensors,
    and the executor copies them into their buffers, a device-to-device copy it records."""

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
        # which outputs are written in place needs no record: Method compares each output with its buffer
        in_place, _ = outputs_in_place(self.graph_module, self.user_outputs)
        self.graph_module, self.graph_module_in_place = eager_custom_ops(self.graph_module), eager_custom_ops(in_place)

    def __call__(self, *inputs: torch.Tensor, out=()) -> tuple[torch.Tensor, ...]:
        user = iter(inputs)
        args = [next(user) if a is None else a for a in self.args]
        planned = bool(out) and all(buf is not None for buf in out)
        outs = self.graph_module_in_place(*args, *out) if planned else self.graph_module(*args)
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


def memory_space(t: torch.Tensor, arenas: dict | None) -> str:
    """The memory space of `t`: the planned arena that holds its bytes, else its device ("cpu", "cuda:0")."""
    ptr = t.data_ptr()
    for space, arena in (arenas or {}).items():
        if arena.device == t.device and arena.data_ptr() <= ptr < arena.data_ptr() + arena.numel():
            return space
    return device_name(t.device)


class Method:
    """One method of a Program: `method(*inputs, ledger=None) -> tuple of outputs`.

    Inputs are copied into their planned buffers (no copy when the caller passes the buffer itself: fill
    `input_buffer(name, shape)` in place); outputs are views into the planned arena, valid until this method
    (or, for a fed output, the method it feeds) runs again. Copy nodes copy between planned buffers and are
    recorded in the ledger ("copy_node"); with planning off the delegate moves its host inputs to its device and
    its outputs back itself, recorded as "delegate"; an input passed on the delegate device but not in its
    planned buffer costs a device-to-device copy, recorded as "runner". A copy whose source already sits on its
    destination device (a CPU delegate) is a no-op: it moves no bytes and records nothing, exactly like the
    memcpy a profiler would (not) see. `delegate` may be swapped for any callable with the same signature (e.g.
    a CUDA graph replay): with planning on it is always called with the same planned buffers (`delegate_inputs`,
    and `out`) when the shapes are static.
    """

    def __init__(self, name: str, graph: fx.GraphModule, plan: ProgramPlan, arenas, delegate, device: str):
        self.name, self.graph, self.plan, self.delegate = name, graph, plan, delegate
        self.device = device  # the delegate device (memory space)
        self.arenas = arenas  # device -> uint8 tensor (the Program's dict: replacing an entry re-binds), or None
        self.allocations = {a.tensor: a for a in plan.allocations if a.method == name}
        self.nodes = list(graph.graph.nodes)
        self.inputs = [n for n in self.nodes if n.op == "placeholder"]
        self.delegate_node = next(n for n in self.nodes if n.target is call_delegate)
        self.results = [n for n in self.nodes if n.target is operator.getitem]  # the delegate's outputs
        for node in self.results:
            if node.meta["qmoe_spec"].dynamic_dims:
                raise ExportError(f"method {name}: output {node.name} has a dynamic shape; outputs are planned static")

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
        spec, space = node.meta["qmoe_spec"], node.meta["qmoe_device"]
        where = f"method {self.name} input {node.name}"
        if not isinstance(x, torch.Tensor):
            raise ExportError(f"{where}: expected a tensor, got {type(x).__name__}")
        if memory_space(x, self.arenas) != space:
            why = "export.skip_h2d_for_method_inputs is set" if node.meta["qmoe_placement"] == "delegate" else ""
            why = why or "inputs live on the CPU unless export.skip_h2d_for_method_inputs is set"
            raise ExportError(f"{where} must be on {space} ({why}), got {memory_space(x, self.arenas)}")
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
            buf, space = self.buffer(node.name, x.shape), node.meta["qmoe_device"]
            if buf.data_ptr() != x.data_ptr():  # not passed in its planned buffer: one more copy, the caller's
                transfer(buf, x, space, space, ledger, self.name, "runner")
            env[node] = buf
        for node in self.nodes:
            if is_copy(node):
                src, src_space = env[node.args[0]], node.args[0].meta["qmoe_device"]
                dst_space = node.meta["qmoe_device"]
                if src_space == dst_space:
                    env[node] = src  # a CPU delegate: planned in its source's bytes, nothing to move
                    continue
                dst = self.buffer(node.name, src.shape)
                env[node] = transfer(dst, src, src_space, dst_space, ledger, self.name, "copy_node")
            elif node.target is call_delegate:
                args = [self._to_delegate(a, env[a], ledger) for a in node.args]
                # an output on the delegate's side is computed into its planned buffer where its last op allows
                out = [self.buffer(r.name) if r.meta["qmoe_device"] == self.device else None for r in self.results]
                with torch.profiler.record_function(DELEGATE_RANGE):
                    outs = self.delegate(*args, out=out)
                for r, buf, value in zip(self.results, out, outs):
                    if buf is None:  # planning off: the delegate copies its output out to the host
                        buf = transfer(self.buffer(r.name), value, self.device, HOST, ledger, self.name, "delegate")
                    elif value.data_ptr() != buf.data_ptr():  # no out-variant: one more copy on the device
                        transfer(buf, value, self.device, self.device, ledger, self.name, "delegate")
                    env[r] = buf
        return tuple(env[n] for n in self.nodes[-1].args[0])

    def _to_delegate(self, node: fx.Node, x: torch.Tensor, ledger) -> torch.Tensor:
        """Planning off: the delegate copies a host input to its own memory itself, on every call."""
        if node.meta["qmoe_device"] == self.device:
            return x
        dst = torch.empty_like(x, device=torch_device(self.device))
        return transfer(dst, x, node.meta["qmoe_device"], self.device, ledger, self.name, "delegate")


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
        self.executable = torch_device(self.delegate_device) == torch_device(device_name(model.device))
        self.arenas = None
        if self.executable:  # allocated once, at load: every call reuses these bytes
            self.arenas = {
                d: torch.empty(size, dtype=torch.uint8, device=torch_device(d)) for d, size in self.plan.arenas.items()
            }
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

    def space_of(self, t: torch.Tensor) -> str:
        """The memory space that holds `t`: one of the planned arenas, else its device."""
        return memory_space(t, self.arenas)

    def save(self, directory, weights_identity: dict):
        """Write the self-describing program directory (see artifact.py) -> its Path."""
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


def load_program(directory, model, weights_identity: dict) -> Program:
    """The program saved in `directory`, bound to `model` (caches set up for the saved batch and length);
    ExportError on anything changed since export (artifact.py)."""
    saved = read_program(directory, model, weights_identity)
    program = Program(saved.exported, model, saved.settings, saved.batch_size, saved.max_seq_len)
    program.kernels = saved.kernels  # the ops the saved graphs call, whatever the model selects now
    if program.plan.to_json() != saved.plan_json:
        raise ExportError(
            f"refusing program {directory}: plan.json is not the plan of the saved methods under this code"
        )
    return program
