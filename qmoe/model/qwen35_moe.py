"""Qwen3.5-MoE text model (transformers `qwen3_5_moe_text`), gpt-fast style: static caches held as buffers.

Parameter names equal the Hugging Face text-model keys without their prefix (`layers.3.mlp.experts.gate_up_proj`,
`lm_head.weight`), so checkpoints map one to one. A projection or expert tensor kept in FP8 (`use_fp8_`) is
float8_e4m3fn with a sibling `<name>_scale` fp32 [..., N, ceil(K / 128)] (kernels/fp8.py). Every hot op goes
through `self.ops[<group>]`, a module of `kernels/` picked by `set_kernels` (`kernels.<group>=torch|triton`).
"""

import math
from types import SimpleNamespace

import torch
from torch import nn

import kernels
from kernels.fp8 import FP8, quantize_into, scale_shape
from kernels.linear import aligned_rows
from qmoe.model.config import ModelConfig
from qmoe.parallel import collectives, sampling
from qmoe.parallel.layout import SINGLE, Layout

KERNEL_GROUPS = kernels.OPS
# What model.weights=fp8 keeps in the model's dtype: the lm_head (as FP8 releases do) and the router and the
# shared-expert gate, whose logits pick the experts (and, fused with them, the shared expert's gate and up).
FP8_KEPT_DENSE = ("lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight")


def fp8_capable(name: str) -> bool:
    """Whether a linear or MoE kernel reads the parameter (every projection, the router, lm_head, the experts):
    the ones that can be held in FP8."""
    path, _, leaf = name.rpartition(".")
    module = path.rpartition(".")[2]
    if module == "experts":
        return leaf in ("gate_up_proj", "down_proj")
    return leaf == "weight" and ("proj" in module or module in ("gate", "shared_expert_gate", "lm_head"))


def scale_of(module: nn.Module, name: str = "weight") -> torch.Tensor | None:
    """The fp8 scale of module.<name>, or None when it is held in the model's dtype."""
    # a parameter (use_fp8_) or a buffer (fuse_projections_), read from those registries: getattr on a dense module
    # costs ~1 µs (nn.Module.__getattr__ raises the AttributeError getattr catches), ~160 times a 35B decode step
    key = f"{name}_scale"
    scale = module._parameters.get(key)
    return scale if scale is not None else module._buffers.get(key)


def rope_inv_freq(cfg: ModelConfig, device) -> torch.Tensor:
    """RoPE inverse frequencies of the rotary part of each head, fp32 [rotary_dim / 2]."""
    rot = cfg.rotary_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))


class Weight(nn.Module):
    """Holds one parameter named `weight` (norms, router, conv) so state-dict keys match the checkpoints."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)


def linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False)
    layer.weight.requires_grad_(False)
    return layer


def fuse_rows_(module: nn.Module, parts: tuple[str, ...], attr: str = "weight") -> torch.Tensor:
    """Re-seat the `attr` of each sub-module in `parts` ([n_i, K]) as consecutive row slices of one new
    [sum n_i, K] tensor, and return it (values kept). One GEMV then reads what several projections of the same
    input read; the state-dict keys, and the loader that copies into the parameters, are unchanged, and once the
    old tensors are freed no memory is added but the padding: the storage holds zero rows up to a multiple of 16
    bytes of elements (kernels/linear/triton.padded_rows: cuBLAS runs a prefill GEMM over an N that is one at
    its aligned speed, the 35B MoE in-projection's 1,281 rows as 1,288: 73.5 -> 50.0 us at 4,096 tokens,
    results/gemm_alignment.json; 7 rows x 2,048 x 2 bytes per layer). attr="weight_scale" fuses fp8 scales the
    same way (per row)."""
    subs = [module.get_submodule(part) for part in parts]
    tensors = [getattr(sub, attr).data for sub in subs]
    rows = sum(t.shape[0] for t in tensors)
    storage = tensors[0].new_zeros((aligned_rows(rows, tensors[0].element_size()), *tensors[0].shape[1:]))
    fused = torch.cat(tensors, out=storage[:rows])  # [sum n_i, K]
    start = 0
    for sub, t in zip(subs, tensors):
        setattr(sub, attr, nn.Parameter(fused[start : start + t.shape[0]], requires_grad=False))
        start += t.shape[0]
    return fused


class GatedAttention(nn.Module):
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    IN_PROJ = "qkv_proj"  # the in-projection the layer runs (fused with its input norm) before forward

    def __init__(self, cfg: ModelConfig, layout: Layout):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        (q0, self.num_heads), (kv0, self.num_kv_heads) = (
            layout.heads(cfg.num_attention_heads),
            layout.heads(cfg.num_key_value_heads),
        )
        self.head_dim, self.eps = D, cfg.rms_norm_eps
        self.group = "tp" if layout.tp > 1 else None  # the partial sums of o_proj's row-parallel slices
        # {parameter: {dim: [(first, count), ...]}}: this rank's rows / columns of the full tensor
        self.shards = {
            "q_proj.weight": {0: [(q0 * 2 * D, self.num_heads * 2 * D)]},
            "k_proj.weight": {0: [(kv0 * D, self.num_kv_heads * D)]},
            "v_proj.weight": {0: [(kv0 * D, self.num_kv_heads * D)]},
            "o_proj.weight": {1: [(q0 * D, self.num_heads * D)]},
        }
        self.q_proj = linear(H, self.num_heads * D * 2)  # query and output gate interleaved per head
        self.k_proj = linear(H, self.num_kv_heads * D)
        self.v_proj = linear(H, self.num_kv_heads * D)
        self.o_proj = linear(self.num_heads * D, H)
        self.q_norm, self.k_norm = Weight(D), Weight(D)

    CACHES = ("k_cache", "v_cache")  # the buffers setup_cache makes, zeroed by Qwen35MoE.reset_caches

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype, device) -> None:
        shape = (batch_size, self.num_kv_heads, max_seq_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def forward(self, proj, positions, inv_freq, ops):  # proj = qkv_proj(x) [B, T, N], positions [B, T]
        B, T, _ = proj.shape
        q_size, kv_size = self.num_heads * self.head_dim * 2, self.num_kv_heads * self.head_dim
        q, k, v = proj.split_with_sizes([q_size, kv_size, kv_size], dim=-1)  # Tensor.split's Python: ~1 us more
        q, gate = q.view(B, T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # strided views, no copies
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        norms, caches = (self.q_norm.weight, self.k_norm.weight), (self.k_cache, self.v_cache)
        scale = self.head_dim**-0.5
        out = ops["attention"].gated_attention(q, gate, k, v, *norms, *caches, positions, inv_freq, self.eps, scale)
        out = ops["linear"].linear(out, self.o_proj.weight, scale_of(self.o_proj))  # out [B, T, Hq * D]
        return collectives.reduced(out, self.group)


class GatedDeltaNet(nn.Module):
    FUSED = {"in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
    IN_PROJ = "in_proj"

    def __init__(self, cfg: ModelConfig, layout: Layout):
        super().__init__()
        H = cfg.hidden_size
        (k0, self.nk), (v0, self.nv) = layout.heads(cfg.linear_num_key_heads), layout.heads(cfg.linear_num_value_heads)
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv_dim = 2 * self.nk * self.dk + self.nv * self.dv
        self.kernel_size, self.eps = cfg.linear_conv_kernel_dim, cfg.rms_norm_eps
        self.group = "tp" if layout.tp > 1 else None  # the partial sums of out_proj's row-parallel slices
        qk = cfg.linear_num_key_heads * self.dk  # the full [q | k | v] channels: this rank's heads of each part
        channels = [(k0 * self.dk, self.nk * self.dk), (qk + k0 * self.dk, self.nk * self.dk)]
        channels.append((2 * qk + v0 * self.dv, self.nv * self.dv))
        values, heads = [(v0 * self.dv, self.nv * self.dv)], [(v0, self.nv)]
        self.shards = {
            "in_proj_qkv.weight": {0: channels},
            "conv1d.weight": {0: channels},
            "in_proj_z.weight": {0: values},
            "in_proj_b.weight": {0: heads},
            "in_proj_a.weight": {0: heads},
            "A_log": {0: heads},
            "dt_bias": {0: heads},
            "out_proj.weight": {1: values},
        }
        self.in_proj_qkv = linear(H, self.conv_dim)  # [q | k | v]
        self.in_proj_z = linear(H, self.nv * self.dv)
        self.in_proj_b = linear(H, self.nv)
        self.in_proj_a = linear(H, self.nv)
        self.conv1d = Weight(self.conv_dim, 1, self.kernel_size)
        self.A_log = nn.Parameter(torch.empty(self.nv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nv), requires_grad=False)
        self.norm = Weight(self.dv)
        self.out_proj = linear(self.nv * self.dv, H)

    CACHES = ("conv_state", "recurrent_state")

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype, device) -> None:
        conv = torch.zeros(batch_size, self.conv_dim, self.kernel_size - 1, dtype=dtype, device=device)
        state = torch.zeros(batch_size, self.nv, self.dk, self.dv, dtype=torch.float32, device=device)
        self.register_buffer("conv_state", conv, persistent=False)
        self.register_buffer("recurrent_state", state, persistent=False)

    def forward(self, proj, positions, inv_freq, ops):  # proj = in_proj(x) [B, T, N]
        sizes = [self.conv_dim, self.nv * self.dv, self.nv, self.nv]
        mixed_qkv, z, b, a = proj.split_with_sizes(sizes, dim=-1)
        core = ops["gdn"].gated_delta_net(
            mixed_qkv,
            z,
            a,
            b,
            self.conv1d.weight,
            self.A_log,
            self.dt_bias,
            self.norm.weight,
            self.conv_state,
            self.recurrent_state,
            self.nk,
            self.eps,
        )
        return collectives.reduced(
            ops["linear"].linear(core, self.out_proj.weight, scale_of(self.out_proj)), self.group
        )


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: Layout):
        super().__init__()
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        (self.first, E), (i0, Il) = layout.experts(cfg.num_experts), layout.tp_part(I)
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Il, H), requires_grad=False)  # gate rows first
        self.down_proj = nn.Parameter(torch.empty(E, H, Il), requires_grad=False)
        self.shards = {
            "gate_up_proj": {0: [(self.first, E)], 1: [(i0, Il), (I + i0, Il)]},
            "down_proj": {0: [(self.first, E)], 2: [(i0, Il)]},
        }


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, intermediate: int, layout: Layout):
        super().__init__()
        first, count = layout.world_part(intermediate)
        self.gate_proj, self.up_proj = linear(hidden, count), linear(hidden, count)
        self.down_proj = linear(count, hidden)
        rows = {0: [(first, count)]}
        self.shards = {"gate_proj.weight": rows, "up_proj.weight": rows, "down_proj.weight": {1: [(first, count)]}}


class SparseMoE(nn.Module):
    FUSED = {"in_proj": ("gate", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert_gate")}

    def __init__(self, cfg: ModelConfig, layout: Layout):
        super().__init__()
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.num_experts
        self.gate = Weight(cfg.num_experts, cfg.hidden_size)  # the router: replicated, every rank routes
        self.experts = Experts(cfg, layout)
        self.shared_expert = SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size, layout)
        self.shared_expert_gate = linear(cfg.hidden_size, 1)
        self.group = "world" if layout.sharded else None  # every rank's experts and slices: partial sums

    def forward(self, x, proj, ops):  # x [B, T, H], proj = in_proj(x) [B, T, E + 2 Is + 1]: the ops take them as is
        e, shared_down = self.experts, self.shared_expert.down_proj
        scales = scale_of(e, "gate_up_proj"), scale_of(e, "down_proj"), scale_of(shared_down)
        scales = scales if any(s is not None for s in scales) else ()  # the dense call as it was (exported graphs)
        w13 = e.gate_up_proj
        args = (x, proj, w13, e.down_proj, shared_down.weight, self.top_k)
        if w13.shape[0] < self.num_experts:  # expert parallel: this rank's experts' share
            out = ops["moe"].moe_block_ep(*args, e.first, *scales)
        else:
            out = ops["moe"].moe_block(*args, *scales)
        return collectives.reduced(out, self.group)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, layout: Layout):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layout)
        else:
            self.self_attn = GatedAttention(cfg, layout)
        self.mlp = SparseMoE(cfg, layout)
        self.input_layernorm = Weight(cfg.hidden_size)
        self.post_attention_layernorm = Weight(cfg.hidden_size)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.layer_type == "linear_attention" else self.self_attn

    def forward(self, h, residual, positions, inv_freq, ops, eps):
        """h: the previous block's output (the embedding for the first layer), not yet in the residual stream
        -> (this layer's MoE output, the residual stream). Each add + RMSNorm runs inside the projection that
        reads it (`linear.add_rms_norm_linear`), so a decode layer is 6 launches."""
        linear, mixer, mlp = ops["linear"], self.mixer, self.mlp
        in_proj = getattr(mixer, mixer.IN_PROJ), getattr(mixer, f"{mixer.IN_PROJ}_scale")
        proj, _, residual = linear.add_rms_norm_linear(h, residual, self.input_layernorm.weight, eps, *in_proj)
        mixed = mixer(proj, positions, inv_freq, ops)
        post_norm = self.post_attention_layernorm.weight
        proj, x, residual = linear.add_rms_norm_linear(mixed, residual, post_norm, eps, mlp.in_proj, mlp.in_proj_scale)
        return mlp(x, proj, ops), residual


def configured_sampler(module, greedy: bool, filters: sampling.Filters | None):
    """`module` (a kernels.sampling implementation) as the run's config fixes it for every row, which the caller
    knows and the parameters (device tensors) do not say: greedy (every temperature 0) -> `sample(logits, *params)`
    is `module.greedy(logits)`, one launch; else `filters` (every row's top-k and top-p) -> vocab-parallel ranks
    skip the cut search where those allow (qmoe.parallel.sampling.Filters). Exported methods bake the choice in;
    the name carries it (it keys the export cache and the saved artifact's manifest)."""
    if greedy:
        sample = lambda logits, *params: module.greedy(logits)  # noqa: E731
        return SimpleNamespace(sample=sample, greedy=module.greedy, general=module, all_greedy=True, filters=None,
                               __name__=f"{module.__name__}[greedy]")  # fmt: skip
    if filters is None:
        return module
    return SimpleNamespace(sample=module.sample, greedy=module.greedy, general=module, all_greedy=False,
                           filters=filters, __name__=f"{module.__name__}[{filters}]")  # fmt: skip


class Qwen35MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: Layout = SINGLE):
        super().__init__()
        self.config, self.layout = cfg, layout
        # given its weight, nn.Embedding skips its normal_ init, which on the meta device imports torch._dynamo
        # (~1.1 s of every build and checkpoint plan in a fresh process); init_random_ or the loader fills it
        table = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table, _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, layout) for t in cfg.layer_types)
        self.norm = Weight(cfg.hidden_size)
        self.vocab_start, vocab = layout.world_part(cfg.vocab_size)  # lm_head is vocab-parallel
        self.lm_head = linear(cfg.hidden_size, vocab)
        self.shards = {"lm_head.weight": {0: [(self.vocab_start, vocab)]}}
        self.ops = {group: kernels.resolve(group, "torch") for group in KERNEL_GROUPS}
        self.batch_size = self.max_seq_len = 0

    def fused_groups(self) -> list[tuple[str, ...]]:
        """The parameter names of each group of projections fused into one buffer (fuse_projections_)."""
        groups = []
        for path, module in self.named_modules():
            for parts in getattr(module, "FUSED", {}).values():
                groups.append(tuple(f"{path}.{part}.weight" for part in parts))
        return groups

    def fp8_names(self, candidates) -> frozenset:
        """Of the parameter names `candidates`, those the model can hold in FP8: tensors a linear or MoE kernel
        reads, and a fused group only whole (its parts share one buffer, so one dtype)."""
        names = {name for name in candidates if fp8_capable(name)}
        for group in self.fused_groups():
            if not set(group) <= names:
                names -= set(group)
        return frozenset(names)

    def use_fp8_(self, names) -> None:
        """Re-declare each named parameter as float8_e4m3fn with its `<leaf>_scale` fp32 [..., N, ceil(K / 128)]
        beside it, on the parameter's device (meta before materialisation: build_model calls it there)."""
        for name in names:
            path, _, leaf = name.rpartition(".")
            module, p = self.get_submodule(path), self.get_parameter(name)
            setattr(module, leaf, nn.Parameter(torch.empty(p.shape, dtype=FP8, device=p.device), requires_grad=False))
            scale = torch.empty(scale_shape(p.shape), dtype=torch.float32, device=p.device)
            module.register_parameter(f"{leaf}_scale", nn.Parameter(scale, requires_grad=False))

    def shard_specs(self) -> dict[str, dict[int, list[tuple[int, int]]]]:
        """{parameter name: {dim: [(first, count), ...]}} of every parameter this rank holds a slice of: its local
        tensor is, along each named dim, the concatenation of those ranges of the full tensor. Empty unsharded."""
        if not self.layout.sharded:
            return {}
        specs = {}
        for prefix, module in self.named_modules():
            for name, dims in getattr(module, "shards", {}).items():
                specs[f"{prefix}.{name}" if prefix else name] = dims
        return specs

    def fuse_projections_(self) -> None:
        """Concatenate the weights of the projections that read the same input (each block's FUSED groups) into
        one non-persistent buffer per group, the parameters becoming row slices of it; fp8 groups get a
        `<name>_scale` buffer the same way (None for the others). Call once the parameters are materialised
        (build_model does): moving the model afterwards would split them apart again."""
        for module in self.modules():
            for name, parts in getattr(module, "FUSED", {}).items():
                module.register_buffer(name, fuse_rows_(module, parts), persistent=False)
                fp8 = scale_of(module.get_submodule(parts[0])) is not None
                scale = fuse_rows_(module, parts, "weight_scale") if fp8 else None
                module.register_buffer(f"{name}_scale", scale, persistent=False)

    def set_kernels(self, choice: dict, greedy: bool = False, filters: sampling.Filters | None = None) -> None:
        """choice: {group: 'torch' | 'triton'} for any of KERNEL_GROUPS; groups not named stay as they are.
        greedy: the run samples every row at temperature 0 (its config says so), so `sample` is the sampler's
        argmax entry point (one launch) instead of its general path. filters: every row's top-k and top-p (its
        config): with vocab-parallel logits the Triton sampler finds no cut without a filter, and under a top-k
        up to CANDIDATES_MAX its cuts from each rank's k best logits, where it would search (`configured_sampler`)."""
        for group, impl in choice.items():
            self.ops[group] = kernels.resolve(group, impl)
        sampler = getattr(self.ops["sampling"], "general", self.ops["sampling"])  # undo an earlier choice
        triton = sampler is not kernels.resolve("sampling", "torch")  # the torch form always searches
        skips = triton and self.layout.sharded and filters is not None and filters.cuts != "search"
        self.ops["sampling"] = configured_sampler(sampler, greedy, filters if skips else None)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # the activations' dtype (norms are never fp8)

    def setup_caches(self, batch_size: int, max_seq_len: int) -> None:
        """(Re)allocate the static caches for `batch_size` rows of up to `max_seq_len` positions, zeroed."""
        cfg = self.config
        for layer in self.layers:
            layer.mixer.setup_cache(batch_size, max_seq_len, self.dtype, self.device)
        self.register_buffer("inv_freq", rope_inv_freq(cfg, self.device), persistent=False)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len

    def reset_caches(self) -> None:
        """Zero every cache in place, in one multi-tensor call: a zero_() per buffer after a walk over every
        module's buffers took ~0.5 ms of host time on this project's CPU machine at 40 layers, and 80 launches,
        before a prefill's first kernel could start."""
        torch._foreach_zero_([getattr(layer.mixer, name) for layer in self.layers for name in layer.mixer.CACHES])

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """tokens [B, T] int64 at positions input_pos[b] + t -> fp32 logits [B, V] of the last token
        ([B, T, V] with all_logits). Caches are read and updated in place."""
        eps = self.config.rms_norm_eps
        # h [B, T, H]; the first layer's norm adds it to an empty residual stream (exactly); positions [B, T]
        h, residual, positions = self.ops["embedding"].embed(tokens, input_pos, self.embed_tokens.weight)
        for layer in self.layers:
            h, residual = layer(h, residual, positions, self.inv_freq, self.ops, eps)
        x, _ = self.ops["norm"].add_rms_norm(h, residual, self.norm.weight, eps)
        if not all_logits:
            x = x[:, -1]
        # sharded: this rank's vocabulary slice
        return self.ops["linear"].logits(x, self.lm_head.weight, scale_of(self.lm_head))

    def sample(self, logits, temperature, top_k, top_p, min_p, seed, step) -> torch.Tensor:
        """logits [B, V] -> token ids int64 [B] through the `kernels.sampling` implementation; vocab-parallel
        logits [B, V / world] are sampled without gathering them (qmoe.parallel.sampling)."""
        if self.layout.sharded:
            impl = self.ops["sampling"]
            # each implementation's vocab-parallel form equals its own one-process sampler
            triton = getattr(impl, "general", impl) is not kernels.resolve("sampling", "torch")
            if getattr(impl, "all_greedy", False):
                return sampling.greedy(logits, self.vocab_start, triton)
            params = (temperature, top_k, top_p, min_p, seed, step)
            return sampling.sample(logits, self.vocab_start, *params, triton, getattr(impl, "filters", None))
        return self.ops["sampling"].sample(logits, temperature, top_k, top_p, min_p, seed, step)


@torch.no_grad()
def init_random_(model: Qwen35MoE, seed: int, progress: bool = False) -> None:
    """Fill every parameter in place on its own device from `seed`: matrices ~ N(0, 1/fan_in) (activations
    stay O(1), so logits are spread and greedy decoding is not decided by rounding), norms near their
    identity, DeltaNet decay parameters in their published ranges. An fp8 parameter gets the quantized values of
    what its dense twin would get (drawn in the model's dtype one tensor at a time, so the draws, and every other
    tensor, equal the dense model's)."""
    from tqdm import tqdm

    gen = torch.Generator(device=model.device).manual_seed(seed)
    params = sorted((kv for kv in model.named_parameters() if not kv[0].endswith("_scale")), key=lambda kv: kv[0])
    specs = model.shard_specs()
    shapes = full_shapes(model.config) if specs else {}
    for name, p in tqdm(params, desc="init weights", disable=not progress, unit="tensor"):
        fp8 = p.dtype == FP8  # matrices and experts only (fp8_capable): drawn dense in the model's dtype
        if not fp8 and name not in specs:
            fill_random_(name, p, gen)
            continue
        # the full tensor from the same generator stream, then this rank's slice of it
        full = torch.empty(shapes.get(name, p.shape), dtype=model.dtype if fp8 else p.dtype, device=p.device)
        fill_random_(name, full, gen)
        if name in specs:  # into p, or (fp8) into a dense tensor to quantize
            local = torch.empty(p.shape, dtype=full.dtype, device=p.device) if fp8 else p
            for src, dst in shard_blocks(specs[name]):
                local[dst] = full[src]
            full = local
        if fp8:  # with every K split on the scale blocks (fp8_layout_errors): the slice of the quantized tensor
            quantize_into(p, model.get_parameter(f"{name}_scale"), full)
        del full


def fill_random_(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    """Parameter `name`'s random init, drawn from `gen` (see init_random_)."""
    leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
    if name == "embed_tokens.weight":
        p.normal_(0.0, 1.0, generator=gen)
    elif leaf == "A_log":
        p.uniform_(0.01, 16.0, generator=gen).log_()
    elif leaf == "dt_bias":
        p.uniform_(0.5, 1.5, generator=gen)
    elif leaf == "norm" and "linear_attn" in name:  # plain-weight gated norm, identity at 1
        p.normal_(1.0, 0.1, generator=gen)
    elif p.dim() == 1:  # zero-centred norms: scale is (1 + w)
        p.normal_(0.0, 0.1, generator=gen)
    else:  # matrices, experts, conv taps
        p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)


def full_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every parameter's unsharded shape (a meta model: nothing is allocated)."""
    with torch.device("meta"):
        return {name: p.shape for name, p in Qwen35MoE(cfg).named_parameters()}


def shard_blocks(dims: dict) -> list[tuple[tuple, tuple]]:
    """(full-tensor index, local index) pairs that together copy this rank's slice: one per combination of the
    ranges along each sharded dim."""
    blocks = [((), ())]
    for dim in range(max(dims) + 1):
        ranges = dims.get(dim)
        if ranges is None:
            blocks = [(src + (slice(None),), dst + (slice(None),)) for src, dst in blocks]
            continue
        out, at = [], 0
        for first, count in ranges:
            out += [(src + (slice(first, first + count),), dst + (slice(at, at + count),)) for src, dst in blocks]
            at += count
        blocks = out
    return blocks


def fp8_weight_names(cfg: ModelConfig, weights: str, stored_fp8=frozenset()) -> frozenset:
    """The parameters a model built for `model.weights` holds in FP8: auto -> those stored in FP8 (`stored_fp8`,
    from a checkpoint), dense -> none, fp8 -> every projection and expert but FP8_KEPT_DENSE, and those stored in
    FP8. Both then as Qwen35MoE.fp8_names allows (a fused group is FP8 only whole)."""
    if weights == "dense":
        return frozenset()
    with torch.device("meta"):
        model = Qwen35MoE(cfg)
    candidates = set(stored_fp8)
    if weights == "fp8":
        candidates |= {name for name, _ in model.named_parameters() if not name.endswith(FP8_KEPT_DENSE)}
    return model.fp8_names(candidates)


def _meta_params(cfg: ModelConfig, dtype: torch.dtype, fp8) -> dict:
    with torch.device("meta"):
        model = Qwen35MoE(cfg).to(dtype=dtype)
    model.use_fp8_(model.fp8_names(fp8))
    return dict(model.named_parameters())


def fp8_parameters(model: nn.Module) -> frozenset:
    """The names of a model's parameters held in float8."""
    return frozenset(name for name, p in model.named_parameters() if p.dtype == FP8)


def weight_nbytes(cfg: ModelConfig, dtype: torch.dtype, fp8=frozenset()) -> int:
    """Bytes of every parameter (scales included) of build_model(cfg, dtype, fp8=fp8): what it allocates."""
    return sum(p.nbytes for p in _meta_params(cfg, dtype, fp8).values())


def active_weight_nbytes(cfg: ModelConfig, dtype: torch.dtype, fp8=frozenset()) -> int:
    """Bytes one decode step at batch 1 reads of build_model(cfg, dtype, fp8=fp8)'s parameters: all of them (scales
    included) but the embedding (a row gather), the routed experts' top-k of E."""
    total = 0
    for name, p in _meta_params(cfg, dtype, fp8).items():
        if name == "embed_tokens.weight":
            continue
        routed = ".mlp.experts." in name
        total += p.nbytes * cfg.num_experts_per_tok // cfg.num_experts if routed else p.nbytes
    return total


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device,
    seed: int | None = 0,
    progress=False,
    fp8=frozenset(),
    layout: Layout = SINGLE,
) -> Qwen35MoE:
    """The model's parameters (this rank's shards under `layout`) allocated directly on `device` in `dtype` (no
    host copy); random when seed is set (a shard equals the slice of the unsharded model with that seed), left
    uninitialised (for a checkpoint loader to fill) when seed is None. The parameters named in `fp8` (see
    Qwen35MoE.fp8_names) are float8_e4m3fn with their scales instead (sharded: each rank's slice of the unsharded
    FP8 model, given fp8_layout_errors' alignment)."""
    with torch.device("meta"):
        model = Qwen35MoE(cfg, layout)
    model = model.to(dtype=dtype)
    model.use_fp8_(model.fp8_names(fp8))
    # torch.empty, not to_empty's empty_like: on meta tensors that runs a Python reference which imports sympy
    # (2.8 s of the first build in a fresh process on the H200 host, where sympy's bytecode is not cached)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.fuse_projections_()
    if seed is not None:
        init_random_(model, seed, progress)
    return model.eval()
