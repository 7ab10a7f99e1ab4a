"""Checkpoint loading and writing: round trips through every published key layout, a transformers-written
checkpoint against the transformers oracle, and every error case naming its culprit."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qmoe.checkpoint import CheckpointError, load_checkpoint, write_checkpoint
from qmoe.checkpoint.synth import model_config, write_configs
from qmoe.model import ModelConfig, build_model
from qmoe.model.hf import to_transformers
from tests.helpers import tiny_config

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = tiny_config()
MM, TEXT = "model.language_model.", "model."
SHARD_BYTES = 300_000  # the tiny fp32 model (~1.6 MB) spreads over several shards


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """All prefill logits, then one decode step's: exercises weights through both cache paths."""
    model.setup_caches(tokens.shape[0], 32)
    prefill = model(tokens[:, :-1], torch.zeros(tokens.shape[0], dtype=torch.long), all_logits=True)
    decode = model(tokens[:, -1:], torch.full((tokens.shape[0],), tokens.shape[1] - 1))
    return torch.cat([prefill.flatten(), decode.flatten()])


def tokens_for(cfg: ModelConfig, batch=2, length=12, seed=0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def shard_of(ckpt: Path, key: str) -> str:
    return json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][key]


def edit_shard(ckpt: Path, shard: str, drop=(), put=None) -> None:
    """Rewrite one shard without the `drop` keys and with `put` tensors added or replaced; keep the index true."""
    tensors = {k: v for k, v in load_file(ckpt / shard).items() if k not in drop}
    tensors.update(put or {})
    save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if k not in drop}
    index["weight_map"].update(dict.fromkeys(put or {}, shard))
    index_file.write_text(json.dumps(index))


@pytest.fixture(scope="module")
def reference():
    return build_model(TINY, torch.float32, "cpu", seed=3)


def write(tmp_path, layout="fused", prefix=MM, dtype=torch.float32) -> Path:
    return write_checkpoint(
        TINY, tmp_path / "ckpt", seed=3, dtype=dtype, expert_layout=layout, prefix=prefix, shard_bytes=SHARD_BYTES
    )


# Both expert layouts x both key prefixes, with the MTP head and (multimodal prefix) vision tensors present.
@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("prefix", [MM, TEXT])
def test_round_trip_gives_identical_logits(tmp_path, reference, layout, prefix):
    ckpt = write(tmp_path, layout, prefix)
    extra = {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.randn(64)}
    if prefix == MM:
        extra["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    save_file(extra, ckpt / "extra.safetensors")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(extra, "extra.safetensors"))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert len(set(index["weight_map"].values())) > 3  # really sharded

    model, info = load_checkpoint(ckpt, dtype=torch.float32, device="cpu")

    for (name, p), (ref_name, ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert name == ref_name and torch.equal(p, ref), name
    tokens = tokens_for(TINY)
    assert torch.equal(logits_of(model, tokens), logits_of(reference, tokens))
    assert (info.prefix, info.expert_layout) == (prefix, layout)
    assert info.skipped == {"mtp": 2, "visual": 1 if prefix == MM else 0}
    assert info.eos_token_ids == (507, 509)  # <|endoftext|> (config.json) and <|im_end|> (generation_config.json)
    assert info.load_seconds > 0 and info.peak_rss_bytes >= info.start_rss_bytes > 0
    assert set(info.phase_seconds) == {"check", "build", "fill"} and min(info.phase_seconds.values()) > 0
    assert abs(sum(info.phase_seconds.values()) - info.load_seconds) < 1e-6  # the phases are the whole load
    assert info.tokenizer_path is None


def test_fp32_checkpoint_loads_cast_to_bf16(tmp_path, reference):
    model, _ = load_checkpoint(write(tmp_path), dtype=torch.bfloat16, device="cpu")
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, ref.to(torch.bfloat16)), name


def test_bf16_synthetic_weights_equal_build_model(tmp_path):
    model, _ = load_checkpoint(write(tmp_path, dtype=torch.bfloat16), dtype=torch.bfloat16, device="cpu")
    ref = build_model(TINY, torch.bfloat16, "cpu", seed=3)
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters(), strict=True))


def test_transformers_save_pretrained_checkpoint_matches_transformers(tmp_path):
    source = build_model(TINY, torch.float32, "cpu", seed=5)
    hf = to_transformers(source)
    hf.save_pretrained(tmp_path / "hf")  # single model.safetensors, per-expert keys

    model, info = load_checkpoint(tmp_path / "hf", dtype=torch.float32, device="cpu")

    assert info.expert_layout == "per_expert"
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), source.parameters(), strict=True))
    tokens = tokens_for(TINY, batch=1, length=9)
    model.setup_caches(1, 32)
    ours = model(tokens, torch.zeros(1, dtype=torch.long), all_logits=True)
    with torch.no_grad():
        theirs = hf(tokens).logits.float()
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5
    # greedy continuation: ours through the caches, transformers re-reading the whole sequence each step
    generated, hf_ids = [], tokens
    next_token = ours[:, -1].argmax(-1)
    for step in range(8):
        generated.append(next_token.item())
        with torch.no_grad():
            hf_ids = torch.cat([hf_ids, hf(hf_ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        next_token = model(next_token[:, None], torch.tensor([tokens.shape[1] + step])).argmax(-1)
    assert generated == hf_ids[0, tokens.shape[1] :].tolist()


def test_hashes_identify_config_index_and_shards(tmp_path):
    ckpt = write(tmp_path)
    _, stat_info = load_checkpoint(ckpt, dtype=torch.float32, device="cpu")
    _, full_info = load_checkpoint(ckpt, dtype=torch.float32, device="cpu", shard_identity="sha256")
    shard = shard_of(ckpt, f"{MM}norm.weight")
    assert full_info.file_hashes[shard] == hashlib.sha256((ckpt / shard).read_bytes()).hexdigest()
    assert full_info.file_hashes["config.json"] == hashlib.sha256((ckpt / "config.json").read_bytes()).hexdigest()
    assert stat_info.shard_identity == "size+mtime" and stat_info.file_hashes[shard] != full_info.file_hashes[shard]
    edit_shard(ckpt, shard, put={f"{MM}norm.weight": torch.ones(64)})  # new content, new size/mtime
    _, edited = load_checkpoint(ckpt, dtype=torch.float32, device="cpu")
    assert edited.weights_id != stat_info.weights_id


def test_big_vocab_configs_carry_qwen_eos_ids(tmp_path):
    big = tiny_config(vocab_size=248320)
    write_configs(big, tmp_path, MM, torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["text_config"]["eos_token_id"] == 248044
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [248044, 248046]


def test_synth_cli_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "qmoe.checkpoint.synth", "model=qwen35_moe_tiny", "layers=2", f"out={out}"]
    cmd += ["seed=7", "dtype=float32", "expert_layout=per_expert", "prefix=model.", "shard_gb=0.0005"]
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, capture_output=True)
    model, info = load_checkpoint(out, dtype=torch.float32, device="cpu")
    cfg = model_config("qwen35_moe_tiny", layers=2)
    assert cfg.num_hidden_layers == 2 and (info.prefix, info.expert_layout) == (TEXT, "per_expert")
    ref = build_model(cfg, torch.float32, "cpu", seed=7)
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters(), strict=True))


def test_arch_overrides_equal_pass_conflicting_fail_naming_both(tmp_path):
    ckpt = write(tmp_path)
    load_checkpoint(ckpt, dtype=torch.float32, device="cpu", arch_overrides={"hidden_size": 64, "num_experts": 8})
    with pytest.raises(CheckpointError, match=r"model\.arch\.hidden_size=128 conflicts with hidden_size=64"):
        load_checkpoint(ckpt, dtype=torch.float32, device="cpu", arch_overrides={"hidden_size": 128})
    with pytest.raises(CheckpointError, match=r"model\.arch\.layer_types=.*conflicts"):
        load_checkpoint(ckpt, dtype=torch.float32, device="cpu", arch_overrides={"layer_types": ["full_attention"] * 4})
    with pytest.raises(CheckpointError, match=r"model\.arch\.hidden: not a ModelConfig field"):
        load_checkpoint(ckpt, dtype=torch.float32, device="cpu", arch_overrides={"hidden": 64})


def _missing(ckpt, prefix):
    key = f"{prefix}layers.2.mlp.shared_expert.up_proj.weight"
    edit_shard(ckpt, shard_of(ckpt, key), drop=[key])
    return rf"missing tensor {key}$"


def _missing_expert(ckpt, prefix):
    key = f"{prefix}layers.1.mlp.experts.5.up_proj.weight"
    edit_shard(ckpt, shard_of(ckpt, key), drop=[key])
    return rf"missing tensor {key}$"


def _missing_lm_head(ckpt, prefix):
    edit_shard(ckpt, shard_of(ckpt, "lm_head.weight"), drop=["lm_head.weight"])
    return r"missing tensor lm_head\.weight$"


def _unexpected(ckpt, prefix):
    key = f"{prefix}layers.0.mlp.router_bias"
    edit_shard(ckpt, shard_of(ckpt, f"{prefix}norm.weight"), put={key: torch.zeros(8)})
    return rf"unexpected tensor {key} in model-"


def _unexpected_expert(ckpt, prefix):  # expert 8 of 8
    key = f"{prefix}layers.0.mlp.experts.8.down_proj.weight"
    edit_shard(ckpt, shard_of(ckpt, f"{prefix}norm.weight"), put={key: torch.zeros(64, 32)})
    return rf"unexpected tensor {key} in"


def _unexpected_prefix(ckpt, prefix):  # a text-only key in a multimodal checkpoint
    key = "model.layers.0.input_layernorm.weight"
    edit_shard(ckpt, shard_of(ckpt, f"{MM}norm.weight"), put={key: torch.zeros(64)})
    return rf"unexpected tensor {key} in"


def _both_layouts(ckpt, prefix):
    key = f"{prefix}layers.3.mlp.experts.2.down_proj.weight"
    edit_shard(ckpt, shard_of(ckpt, f"{prefix}norm.weight"), put={key: torch.zeros(64, 32)})
    return rf"{prefix}layers\.3\.mlp\.experts\.down_proj: stored both fused and per expert"


def _wrong_shape(ckpt, prefix):
    key = f"{prefix}layers.1.self_attn.q_norm.weight"
    edit_shard(ckpt, shard_of(ckpt, key), put={key: torch.zeros(33)})
    return rf"{key}: shape \[33\] in model-\d+-of-\d+\.safetensors, expected \[32\]"


def _wrong_expert_shape(ckpt, prefix):
    key = f"{prefix}layers.0.mlp.experts.gate_up_proj"
    edit_shard(ckpt, shard_of(ckpt, key), put={key: torch.zeros(8, 32, 64)})
    return rf"{key}: shape \[8, 32, 64\] in .*, expected \[8, 64, 64\]"


def _int_dtype(ckpt, prefix):
    key = f"{prefix}layers.0.linear_attn.A_log"
    edit_shard(ckpt, shard_of(ckpt, key), put={key: torch.zeros(4, dtype=torch.int32)})
    return rf"{key}: dtype I32 in .* cannot be cast to torch.float32"


def _bool_dtype(ckpt, prefix):
    key = f"{prefix}norm.weight"
    edit_shard(ckpt, shard_of(ckpt, key), put={key: torch.zeros(64, dtype=torch.bool)})
    return rf"{key}: dtype BOOL in"


def _truncated(ckpt, prefix):
    shard = ckpt / shard_of(ckpt, "lm_head.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    return rf"{shard}: corrupt or truncated safetensors file"


def _corrupt_header(ckpt, prefix):
    shard = ckpt / shard_of(ckpt, f"{prefix}embed_tokens.weight")
    data = bytearray(shard.read_bytes())
    data[8:24] = b"\x00garbage-header!"
    shard.write_bytes(bytes(data))
    return rf"{shard}: corrupt or truncated safetensors file"


def _absent_shard(ckpt, prefix):
    shard = ckpt / shard_of(ckpt, "lm_head.weight")
    shard.unlink()
    return rf"{shard}: shard named by model\.safetensors\.index\.json is absent"


def _index_points_elsewhere(ckpt, prefix):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    other = index["weight_map"][f"{prefix}embed_tokens.weight"]
    index["weight_map"]["lm_head.weight"] = other
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return rf"lm_head\.weight: model\.safetensors\.index\.json puts it in {other}, which does not hold it"


def _no_config(ckpt, prefix):
    (ckpt / "config.json").unlink()
    return rf"{ckpt / 'config.json'}: missing"


def _bad_json_config(ckpt, prefix):
    (ckpt / "config.json").write_text("{not json")
    return rf"{ckpt / 'config.json'}: invalid JSON"


def _wrong_model_type(ckpt, prefix):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    return r"config\.json: model_type 'llama' is not qwen3_5_moe"


def _config_lacks_field(ckpt, prefix):
    config = json.loads((ckpt / "config.json").read_text())
    del config["text_config"]["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(config))
    return r"config\.json: .*hidden_size"


def _config_invalid_value(ckpt, prefix):
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["num_experts_per_tok"] = 9
    (ckpt / "config.json").write_text(json.dumps(config))
    return r"config\.json: .*num_experts_per_tok: must be <= num_experts"


def _no_weights(ckpt, prefix):
    for file in ckpt.glob("model*"):
        file.unlink()
    return rf"{ckpt}: has neither model\.safetensors\.index\.json nor model\.safetensors"


ERRORS = [
    _missing,
    _missing_expert,
    _missing_lm_head,
    _unexpected,
    _unexpected_expert,
    _unexpected_prefix,
    _both_layouts,
    _wrong_shape,
    _wrong_expert_shape,
    _int_dtype,
    _bool_dtype,
    _truncated,
    _corrupt_header,
    _absent_shard,
    _index_points_elsewhere,
    _no_config,
    _bad_json_config,
    _wrong_model_type,
    _config_lacks_field,
    _config_invalid_value,
    _no_weights,
]
PER_EXPERT_ONLY = {_missing_expert}
FUSED_ONLY = {_both_layouts, _wrong_expert_shape, _unexpected_prefix, _config_lacks_field, _config_invalid_value}


@pytest.mark.parametrize("damage", ERRORS, ids=lambda f: f.__name__.strip("_"))
def test_bad_checkpoint_raises_one_line_naming_culprit(tmp_path, damage):
    layout = "per_expert" if damage in PER_EXPERT_ONLY else "fused"
    ckpt = write(tmp_path, layout, MM)
    pattern = damage(ckpt, MM)
    with pytest.raises(CheckpointError, match=pattern) as raised:
        load_checkpoint(ckpt, dtype=torch.float32, device="cpu")
    assert isinstance(raised.value, ValueError) and "\n" not in str(raised.value)


def test_missing_tensor_named_under_text_prefix(tmp_path):
    ckpt = write(tmp_path, "fused", TEXT)
    with pytest.raises(CheckpointError, match=_missing(ckpt, TEXT)):
        load_checkpoint(ckpt, dtype=torch.float32, device="cpu")


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'nope'}: not a checkpoint directory"):
        load_checkpoint(tmp_path / "nope", dtype=torch.float32, device="cpu")


@pytest.mark.gpu
def test_loads_to_cuda_equal_to_cpu(tmp_path):
    ckpt = write(tmp_path, "per_expert", MM)
    cpu_model, _ = load_checkpoint(ckpt, dtype=torch.bfloat16, device="cpu")
    gpu_model, info = load_checkpoint(ckpt, dtype=torch.bfloat16, device="cuda")
    assert gpu_model.device.type == "cuda"
    for (name, g), c in zip(gpu_model.named_parameters(), cpu_model.parameters(), strict=True):
        assert torch.equal(g.cpu(), c), name
