"""FP8 checkpoints (Qwen's fine-grained block format and compressed-tensors' per-channel one): loaded models equal
the model of the weights dequantized by the published formula, greedy tokens included; model.weights converts on
load; every malformed FP8 checkpoint is one line naming the tensor, before anything is allocated."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qmoe.checkpoint import CheckpointError, load_checkpoint, write_checkpoint
from qmoe.checkpoint.synth import parse_args
from qmoe.model import build_model, fp8_weight_names
from tests.helpers import rel_err, tiny_config
from tests.test_checkpoint import edit_shard, logits_of, shard_of, tokens_for

# N and K not multiples of 128: hidden 144 = one full and one 16-wide block (K of most projections, N of o_proj,
# out_proj, the down projections), expert gate_up 80 rows and down K 40 (one partial block each), lm_head N 512.
ODD = tiny_config(hidden_size=144, moe_intermediate_size=40, shared_expert_intermediate_size=24)
MM = "model.language_model."
SEED = 5


def write(tmp_path, quant, layout="fused", shard_bytes=400_000):
    return write_checkpoint(
        ODD,
        tmp_path / quant,
        seed=SEED,
        dtype=torch.float32,
        quant=quant,
        expert_layout=layout,
        shard_bytes=shard_bytes,
    )


def published_dequantization(ckpt, out):
    """The checkpoint with every FP8 tensor replaced by its fp32 dequantization, computed here from the formats'
    definitions (w[i, j] = weight[i, j] * scale_inv[i // 128, j // 128]; per channel w[i, j] * scale[i]), and no
    quantization_config: a dense checkpoint, which the loader reads like any other (the transformers-checked path)."""
    config = json.loads((ckpt / "config.json").read_text())
    q = config.pop("quantization_config")
    suffix = "_scale_inv" if q["quant_method"] == "fp8" else "_scale"
    out.mkdir()
    weight_map = {}
    for shard in sorted({*json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values()}):
        tensors = {}
        for file in {shard, *(p.name for p in ckpt.glob("*.safetensors"))}:
            tensors.update(load_file(ckpt / file))
        mine = {k for k in load_file(ckpt / shard) if not k.endswith(suffix)}
        dense = {}
        for key in mine:
            t = tensors[key]
            if t.dtype == torch.float8_e4m3fn:
                s = tensors[key + suffix].float()
                if suffix == "_scale_inv":
                    i = torch.arange(t.shape[-2])[:, None] // 128
                    j = torch.arange(t.shape[-1])[None, :] // 128
                    s = s[..., i, j]
                t = t.float() * s
            dense[key] = t
        save_file(dense, out / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(dense, shard))
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text((ckpt / "generation_config.json").read_text())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def greedy_tokens(model, prompt, steps=8):
    model.setup_caches(prompt.shape[0], 32)
    logits = model(prompt, torch.zeros(prompt.shape[0], dtype=torch.long))
    tokens = [logits.argmax(-1)]
    for t in range(steps - 1):
        logits = model(tokens[-1][:, None], torch.full((prompt.shape[0],), prompt.shape[1] + t))
        tokens.append(logits.argmax(-1))
    return torch.stack(tokens, 1)


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("quant", ["fp8_block", "fp8_channel"])
def test_fp8_checkpoint_equals_its_published_dequantization(tmp_path, quant, layout):
    ckpt = write(tmp_path, quant, layout)
    oracle, _ = load_checkpoint(published_dequantization(ckpt, tmp_path / "dense"), dtype=torch.float32, device="cpu")
    model, info = load_checkpoint(ckpt, dtype=torch.float32, device="cpu")
    stored = {"fp8_block": 38, "fp8_channel": 16}[quant]  # block: all but lm_head, router, shared-expert gate
    dequantized = {"fp8_block": 8, "fp8_channel": 0}[quant]  # the shared expert's gate/up, fused with the router
    assert info.quantization == {
        "method": {"fp8_block": "fp8", "fp8_channel": "compressed-tensors"}[quant],
        "stored_fp8": stored,
        "held_fp8": stored - dequantized,
        "dequantized": dequantized,
        "quantized": 0,
    }
    assert model.layers[1].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    assert model.layers[1].mlp.experts.down_proj.dtype == torch.float8_e4m3fn
    tokens = tokens_for(ODD)
    assert rel_err(logits_of(model, tokens), logits_of(oracle, tokens)) < 1e-6
    assert torch.equal(greedy_tokens(model, tokens), greedy_tokens(oracle, tokens))
    # and the files hold FP8 of the synthetic weights, not something else consistently written and read: e4m3 keeps
    # 3 mantissa bits, so each element is within 2^-4 relative (rms about 2^-4 / sqrt(3) = 3.6 %)
    dense = build_model(ODD, torch.float32, "cpu", seed=SEED)
    errors = {name: rel_err(o, d) for (name, o), d in zip(oracle.named_parameters(), dense.parameters(), strict=True)}
    assert max(errors.values()) < 0.045
    assert errors["layers.1.self_attn.q_proj.weight"] > 1e-3 and errors["layers.0.mlp.experts.down_proj"] > 1e-3


def test_weights_dense_dequantizes_and_weights_fp8_quantizes_on_load(tmp_path):
    ckpt = write(tmp_path, "fp8_channel")
    auto, _ = load_checkpoint(ckpt, dtype=torch.float32, device="cpu")
    dense, info = load_checkpoint(ckpt, dtype=torch.float32, device="cpu", weights="dense")
    assert info.quantization["held_fp8"] == 0 and all(p.dtype == torch.float32 for p in dense.parameters())
    tokens = tokens_for(ODD)
    assert rel_err(logits_of(dense, tokens), logits_of(auto, tokens)) < 1e-6
    # fp8: what the channel checkpoint keeps dense (DeltaNet, shared expert down) is quantized as build_model does
    fp8, info = load_checkpoint(ckpt, dtype=torch.float32, device="cpu", weights="fp8")
    assert info.quantization["quantized"] == 14 and info.quantization["held_fp8"] == 30
    built = build_model(ODD, torch.float32, "cpu", seed=SEED, fp8=fp8_weight_names(ODD, "fp8"))
    params = dict(fp8.named_parameters())
    for name, p in built.named_parameters():
        if "linear_attn" in name or "shared_expert.down_proj" in name:
            assert params[name].dtype == p.dtype and torch.equal(params[name], p), name


def test_bf16_checkpoint_with_weights_fp8_equals_fp8_init(tmp_path):
    ckpt = write_checkpoint(ODD, tmp_path / "dense", seed=SEED, dtype=torch.float32)
    loaded, info = load_checkpoint(ckpt, dtype=torch.float32, device="cpu", weights="fp8")
    built = build_model(ODD, torch.float32, "cpu", seed=SEED, fp8=fp8_weight_names(ODD, "fp8"))
    assert info.quantization["quantized"] == 30
    for (name, p), (_, b) in zip(loaded.named_parameters(), built.named_parameters(), strict=True):
        assert p.dtype == b.dtype and torch.equal(p, b), name


def _missing_scale(ckpt):
    key = f"{MM}layers.1.self_attn.q_proj.weight"
    edit_shard(ckpt, shard_of(ckpt, key + "_scale_inv"), drop=[key + "_scale_inv"])
    return rf"{key}: float8 in model-\d+-of-\d+.safetensors without its scale {key}_scale_inv$"


def _wrong_scale_shape(ckpt):  # o_proj is [144, 128]: 2 x 1 blocks
    key = f"{MM}layers.1.self_attn.o_proj.weight_scale_inv"
    edit_shard(ckpt, shard_of(ckpt, key), put={key: torch.ones(1, 1)})
    return rf"{key}: shape \[1, 1\] in .*, expected \[2, 1\] \(128x128 blocks of .*o_proj.weight \[144, 128\]\)$"


def _wrong_expert_scale_shape(ckpt):  # fused gate_up [8, 80, 144]: [8, 1, 2]
    key = f"{MM}layers.0.mlp.experts.gate_up_proj_scale_inv"
    edit_shard(ckpt, shard_of(ckpt, key), put={key: torch.ones(8, 2, 2)})
    return rf"{key}: shape \[8, 2, 2\] in .*, expected \[8, 1, 2\]"


def _unknown_method(ckpt):
    config(ckpt, quant_method="awq")
    return r"quantization_config.quant_method 'awq' is not supported; allowed: fp8, compressed-tensors$"


def _e5m2(ckpt):
    config(ckpt, fmt="e5m2")
    return r"quantization_config.fmt 'e5m2' is not supported; allowed: e4m3$"


def _narrow_k_blocks(ckpt):
    config(ckpt, weight_block_size=[128, 64])
    return r"weight_block_size: \[128, 64\] must be \[rows, cols\] with cols a multiple of 128$"


def _no_quantization_config(ckpt):
    config(ckpt, drop=True)
    return r"_scale_inv: an FP8 scale, but config.json has no quantization_config$"


def _scale_of_a_dense_tensor(ckpt):
    key = f"{MM}layers.0.mlp.gate.weight_scale_inv"
    edit_shard(ckpt, shard_of(ckpt, f"{MM}layers.0.mlp.gate.weight"), put={key: torch.ones(1, 2)})
    return rf"{key}: a scale for {MM}layers.0.mlp.gate.weight, which is stored in F32, not float8$"


def _scale_without_weight(ckpt):
    key = f"{MM}layers.1.self_attn.k_proj.weight"
    edit_shard(ckpt, shard_of(ckpt, key), drop=[key])
    return rf"{key}_scale_inv: the scale of {key}, which the checkpoint does not hold$"


def _fp8_in_modules_to_not_convert(ckpt):
    config(ckpt, modules_to_not_convert=["lm_head", "self_attn.v_proj"])
    return rf"{MM}layers.1.self_attn.v_proj.weight: float8 in .*, but quantization_config.modules_to_not_convert keeps"


def _mixed_expert_precision(ckpt):  # per-expert layout: expert 3's gate stored fp32, its sibling experts fp8
    key = f"{MM}layers.2.mlp.experts.3.gate_proj.weight"
    edit_shard(ckpt, shard_of(ckpt, key), drop=[key + "_scale_inv"], put={key: torch.zeros(40, 144)})
    return r"experts\.\d\.(gate|up)_proj.weight: .* of the same tensor is .*: one precision per tensor$"


def config(ckpt, drop=False, **changes):
    file = ckpt / "config.json"
    data = json.loads(file.read_text())
    if drop:
        del data["quantization_config"]
    data.get("quantization_config", {}).update(changes)
    file.write_text(json.dumps(data))


ERRORS = [
    _missing_scale,
    _wrong_scale_shape,
    _wrong_expert_scale_shape,
    _unknown_method,
    _e5m2,
    _narrow_k_blocks,
    _no_quantization_config,
    _scale_of_a_dense_tensor,
    _scale_without_weight,
    _fp8_in_modules_to_not_convert,
    _mixed_expert_precision,
]


@pytest.mark.parametrize("damage", ERRORS, ids=lambda f: f.__name__.strip("_"))
def test_bad_fp8_checkpoint_raises_one_line_naming_culprit(tmp_path, damage, monkeypatch):
    layout = "per_expert" if damage is _mixed_expert_precision else "fused"
    ckpt = write(tmp_path, "fp8_block", layout, shard_bytes=10**9)
    pattern = damage(ckpt)
    monkeypatch.setattr("qmoe.checkpoint.loader.build_model", None)  # nothing may be allocated before the check
    with pytest.raises(CheckpointError, match=pattern) as raised:
        load_checkpoint(ckpt, dtype=torch.float32, device="cpu")
    assert "\n" not in str(raised.value)


def _channel_scale_shape(ckpt):
    key = f"{MM}layers.1.self_attn.q_proj.weight_scale"
    edit_shard(ckpt, shard_of(ckpt, key), put={key: torch.ones(256, 2)})
    return rf"{key}: shape \[256, 2\] in .*, expected \[256, 1\] \(per output channel of"


def _fp8_in_ignore(ckpt):
    config(ckpt, ignore=["lm_head", "re:.*self_attn.o_proj$"])
    return r"layers.1.self_attn.o_proj.weight: float8 in .*, but quantization_config.ignore keeps .* in high precision"


def _static_activations(ckpt):
    file = ckpt / "config.json"
    data = json.loads(file.read_text())
    data["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    file.write_text(json.dumps(data))
    return r"config_groups.group_0.input_activations: static; allowed: dynamic$"


def _inverse_scale_name(ckpt):
    key = f"{MM}layers.1.self_attn.q_proj.weight_scale"
    edit_shard(ckpt, shard_of(ckpt, key), drop=[key], put={key + "_inv": torch.ones(256, 1)})
    return rf"{key}_inv: quant_method compressed-tensors names scales <weight>_scale$"


@pytest.mark.parametrize(
    "damage", [_channel_scale_shape, _fp8_in_ignore, _static_activations, _inverse_scale_name], ids=lambda f: f.__name__
)
def test_bad_compressed_tensors_checkpoint_raises_one_line(tmp_path, damage):
    ckpt = write(tmp_path, "fp8_channel", shard_bytes=10**9)
    with pytest.raises(CheckpointError, match=damage(ckpt)) as raised:
        load_checkpoint(ckpt, dtype=torch.float32, device="cpu")
    assert "\n" not in str(raised.value)


def test_synth_quant_option_is_checked(capsys):
    assert parse_args(["model=qwen35_moe_tiny", "out=x", "quant=fp8_channel"])["quant"] == "fp8_channel"
    with pytest.raises(SystemExit) as raised:
        parse_args(["model=qwen35_moe_tiny", "out=x", "quant=int4"])
    assert raised.value.code == 2
    assert capsys.readouterr().err == "error: quant=int4: allowed: none, fp8_block, fp8_channel\n"


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["fp8_block", "fp8_channel"])
def test_fp8_checkpoint_loads_to_cuda_equal_to_cpu(tmp_path, quant):
    """Scales expanded, fp8 copied, shared expert dequantized, on the device as on the CPU."""
    ckpt = write(tmp_path, quant, "per_expert")
    cpu_model, _ = load_checkpoint(ckpt, dtype=torch.bfloat16, device="cpu")
    gpu_model, info = load_checkpoint(ckpt, dtype=torch.bfloat16, device="cuda")
    assert info.quantization["held_fp8"] > 0
    for (name, g), c in zip(gpu_model.named_parameters(), cpu_model.parameters(), strict=True):
        assert g.dtype == c.dtype and torch.equal(g.cpu().view(torch.uint8), c.view(torch.uint8)), name
