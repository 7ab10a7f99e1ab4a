"""ModelConfig: the architecture numbers of a Qwen3.5-MoE text model, as in its Hugging Face config.json."""

from dataclasses import asdict, dataclass, field, fields

ATTENTION_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    full_attention_interval: int = 4
    layer_types: tuple[str, ...] = field(default=())
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self):
        if not self.layer_types:
            interval = self.full_attention_interval
            types = tuple(ATTENTION_TYPES[(i + 1) % interval == 0] for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError('model.<field>: ...') for numbers the architecture cannot take."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in (int, "int") and (not isinstance(value, int) or value < 1):
                raise ValueError(f"model.arch.{f.name}: must be a positive integer, got {value!r}")
        checks = [
            (len(self.layer_types) == self.num_hidden_layers, "layer_types", "needs one entry per layer"),
            (set(self.layer_types) <= set(ATTENTION_TYPES), "layer_types", f"entries must be {ATTENTION_TYPES}"),
            (
                self.num_attention_heads % self.num_key_value_heads == 0,
                "num_key_value_heads",
                "must divide num_attention_heads",
            ),
            (
                self.linear_num_value_heads % self.linear_num_key_heads == 0,
                "linear_num_key_heads",
                "must divide linear_num_value_heads",
            ),
            (self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok", "must be <= num_experts"),
            (
                self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
                "partial_rotary_factor",
                "head_dim * factor must be an even number in (0, head_dim]",
            ),
            (self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0"),
            (self.rope_theta > 0, "rope_theta", "must be > 0"),
        ]
        for ok, key, message in checks:
            if not ok:
                raise ValueError(f"model.arch.{key}: {message}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_value_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def decode_projections(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each dense projection of a layer (and lm_head), with the projections that read the same input
        fused into one (the model concatenates their weights): the shapes the GEMV kernel is tuned and measured on."""
        H, nv, Is = self.hidden_size, self.linear_num_value_heads, self.shared_expert_intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {
            "gdn_in": (self.conv_dim + self.linear_value_dim + 2 * nv, H),  # in_proj_qkv | z | b | a
            "gdn_out": (H, self.linear_value_dim),
            "attn_qkv": (2 * q + 2 * kv, H),  # q_proj (query and gate) | k_proj | v_proj
            "attn_o": (H, q),
            "moe_in": (self.num_experts + 2 * Is + 1, H),  # router | shared gate | shared up | shared-expert gate
            "shared_down": (H, Is),
            "lm_head": (self.vocab_size, H),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """From our config keys or a Hugging Face text config (extra keys ignored, rope nested or flat)."""
        d = dict(d)
        rope = d.get("rope_parameters") or {}
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in d and key in rope:
                d[key] = rope[key]
        if "eos_token_id" in d and "eos_token_ids" not in d:
            eos = d["eos_token_id"]
            d["eos_token_ids"] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    def to_hf_text_config(self) -> dict:
        """The `qwen3_5_moe_text` config.json dict for this architecture."""
        d = self.to_dict()
        eos = d.pop("eos_token_ids")
        d.pop("full_attention_interval")
        rope = {
            "rope_type": "default",
            "rope_theta": d.pop("rope_theta"),
            "partial_rotary_factor": d.pop("partial_rotary_factor"),
        }
        return {
            "model_type": "qwen3_5_moe_text",
            **d,
            "rope_parameters": rope,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        }

    def param_counts(self) -> dict:
        """Total and per-token active parameter counts (embedding excluded from active, lm_head included)."""
        H, E, K = self.hidden_size, self.num_experts, self.num_experts_per_tok
        expert = 3 * H * self.moe_intermediate_size
        shared = 3 * H * self.shared_expert_intermediate_size + H
        attn = (
            H * self.num_attention_heads * self.head_dim * 2
            + 2 * H * self.num_key_value_heads * self.head_dim
            + self.num_attention_heads * self.head_dim * H
            + 2 * self.head_dim
        )
        nv = self.linear_num_value_heads
        gdn = (
            H * self.conv_dim
            + 2 * H * self.linear_value_dim
            + 2 * H * nv
            + self.conv_dim * self.linear_conv_kernel_dim
            + 2 * nv
            + self.linear_value_head_dim
        )
        n_full = sum(t == "full_attention" for t in self.layer_types)
        mixers = n_full * attn + (self.num_hidden_layers - n_full) * gdn
        per_layer_dense = H * E + shared + 2 * H
        total = mixers + self.num_hidden_layers * (per_layer_dense + E * expert) + 2 * self.vocab_size * H + H
        active = mixers + self.num_hidden_layers * (per_layer_dense + K * expert) + self.vocab_size * H + H
        return {"total": total, "active": active}
