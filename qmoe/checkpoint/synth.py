"""Write random Qwen3.5-MoE checkpoints in the published Hugging Face layout, and a small byte-level BPE tokenizer.

    python -m qmoe.checkpoint.synth model=qwen35_moe layers=4 out=DIR [seed=0] [dtype=bfloat16]
        [expert_layout=fused|per_expert] [prefix=model.language_model.|model.] [shard_gb=5] [device=cpu]
        [tokenizer=false] [quant=none|fp8_block|fp8_channel] [config_dir=configs]

`model=` names <config_dir>/model/<name>.yaml, composed through Hydra; its `arch:` holds the ModelConfig fields.
`tokenizer=true` also writes a small byte-level BPE tokenizer.json with Qwen's special tokens.
`quant=fp8_block` writes Qwen's FP8 release format (float8_e4m3fn weights, 128x128 `weight_scale_inv`; lm_head,
router and shared-expert gate in high precision), `quant=fp8_channel` llm-compressor's FP8_DYNAMIC (per-channel
`weight_scale`; lm_head, router, shared-expert gate, shared expert and DeltaNet in high precision).
The weights are those of build_model(cfg, dtype, device, seed): a checkpoint written here loads into a model
equal to that one. The model is built once on `device`; shards are written one at a time (host RAM holds at most
one shard's copy when device is a GPU, none when it is the CPU).
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tqdm import tqdm

from kernels.fp8 import FP8, FP8_MAX
from qmoe.checkpoint.loader import (
    CONFIG,
    GENERATION_CONFIG,
    INDEX,
    MULTIMODAL_PREFIX,
    TEXT_PREFIX,
    TOKENIZER,
    Quantization,
    parse_quantization,
)
from qmoe.checkpoint.tokenizer import TOKENIZER_CONFIG, special_token_ids
from qmoe.model.config import ModelConfig
from qmoe.model.qwen35_moe import Qwen35MoE, build_model, fp8_capable

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPERT_LAYOUTS = ("fused", "per_expert")
# quant= -> config.json's quantization_config, as the published FP8 checkpoints write it
QUANT_CONFIGS = {
    "none": None,
    "fp8_block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "mlp.gate", "shared_expert_gate"],
    },
    "fp8_channel": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
        "ignore": [
            "lm_head",
            "re:.*mlp.gate$",
            "re:.*shared_expert_gate$",
            r"re:.*shared_expert\..*",
            "re:.*linear_attn.*",
        ],
    },
}
SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Qwen answers in ChatML, thinking first.",
    "Mixture-of-experts models route every token to a few experts.",
    "naïve café, 東京, Ωmega: bytes cover every character.",
)


def checkpoint_tensors(model: Qwen35MoE, expert_layout: str, prefix: str):
    """(checkpoint key, tensor) for every weight of `model` in the given layout (per-expert tensors are views)."""
    I = model.config.moe_intermediate_size
    for name, p in model.named_parameters():
        key = name if name.startswith("lm_head.") else prefix + name
        if expert_layout == "per_expert" and name.endswith("mlp.experts.gate_up_proj"):
            base = key.removesuffix("gate_up_proj")
            for e in range(p.shape[0]):
                yield f"{base}{e}.gate_proj.weight", p[e, :I]
                yield f"{base}{e}.up_proj.weight", p[e, I:]
        elif expert_layout == "per_expert" and name.endswith("mlp.experts.down_proj"):
            base = key.removesuffix("down_proj")
            for e in range(p.shape[0]):
                yield f"{base}{e}.down_proj.weight", p[e]
        else:
            yield key, p


def quantize_blocks(w: torch.Tensor, block: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (fp8 [..., N, K], scale) in a checkpoint's layout: block (bn, bk) -> scale_inv
    [..., ceil(N / bn), ceil(K / bk)]; None -> per output channel [..., N, 1]; scale = amax / 448 (1 for zeros)."""
    if block is None:
        amax = w.float().abs().amax(-1, keepdim=True)  # [..., N, 1]
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    N, K = w.shape[-2:]
    bn, bk = block
    padded = torch.nn.functional.pad(w.float(), (0, -K % bk, 0, -N % bn))
    tiles = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., Nb, bn, Kb, bk]
    amax = tiles.abs().amax((-3, -1))  # [..., Nb, Kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).flatten(-4, -3).flatten(-2)[..., :N, :K]
    return q.to(FP8), scale


def quantized_tensors(tensors, quant: Quantization):
    """(key, tensor) -> the checkpoint's tensors under `quant`: every matrix a linear or MoE kernel reads that the
    config does not keep in high precision becomes (key, fp8) and (key + scale suffix, scale)."""
    for key, tensor in tensors:
        if quant.method is None or not fp8_capable(key) or quant.kept_dense(key.rpartition(".")[0]):
            yield key, tensor
            continue
        q, scale = quantize_blocks(tensor, quant.block)
        yield key, q
        yield key + quant.scale_suffix, scale


def write_configs(
    cfg: ModelConfig, out: Path, prefix: str, dtype: torch.dtype, quantization_config: dict | None = None
) -> None:
    """config.json (multimodal `qwen3_5_moe` wrapper for the multimodal prefix, `qwen3_5_moe_text` otherwise) and
    generation_config.json, with EOS split between them as in the Qwen3.5 releases."""
    special = special_token_ids(cfg.vocab_size)
    endoftext, im_end = special["<|endoftext|>"], special["<|im_end|>"]
    text = dataclasses.replace(cfg, eos_token_ids=(endoftext,)).to_hf_text_config()
    dtype_name = str(dtype).removeprefix("torch.")
    if prefix == MULTIMODAL_PREFIX:
        config = {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": {**text, "dtype": dtype_name},
            "tie_word_embeddings": False,
        }
    else:
        config = {"architectures": ["Qwen3_5MoeForCausalLM"], **text, "dtype": dtype_name}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": [endoftext, im_end], "do_sample": False}
    (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")


def save_model(
    model: Qwen35MoE,
    out,
    *,
    expert_layout: str = "fused",
    prefix: str = MULTIMODAL_PREFIX,
    shard_bytes: int = 5 * 10**9,
    progress: bool = False,
    quant: str = "none",
) -> Path:
    """Write `model`'s weights as safetensors shards of <= shard_bytes (a larger single tensor gets its own shard),
    model.safetensors.index.json, config.json and generation_config.json; quant (QUANT_CONFIGS) writes FP8."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    if quant not in QUANT_CONFIGS:
        raise ValueError(f"quant must be one of {tuple(QUANT_CONFIGS)}, got {quant!r}")
    if prefix not in (MULTIMODAL_PREFIX, TEXT_PREFIX):
        raise ValueError(f"prefix must be {MULTIMODAL_PREFIX!r} or {TEXT_PREFIX!r}, got {prefix!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards, size = [[]], 0
    quantization = parse_quantization(QUANT_CONFIGS[quant], "quant")
    for key, tensor in quantized_tensors(checkpoint_tensors(model, expert_layout, prefix), quantization):
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards, size = [*shards, []], 0
        shards[-1].append((key, tensor))
        size += tensor.nbytes
    weight_map = {}
    for i, shard in enumerate(tqdm(shards, desc="write shards", disable=not progress)):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {key: t.to("cpu") for key, t in shard}  # no copy on the CPU; per-expert views do not overlap
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    total = sum(t.nbytes for shard in shards for _, t in shard)
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    write_configs(model.config, out, prefix, model.dtype, QUANT_CONFIGS[quant])
    return out


def write_checkpoint(
    cfg: ModelConfig,
    out,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    expert_layout: str = "fused",
    prefix: str = MULTIMODAL_PREFIX,
    shard_bytes: int = 5 * 10**9,
    device="cpu",
    progress: bool = False,
    quant: str = "none",
) -> Path:
    """A random checkpoint holding the weights of build_model(cfg, dtype, device, seed), in the published layout
    (quantized by `quant`, QUANT_CONFIGS)."""
    model = build_model(cfg, dtype, device, seed=seed, progress=progress)
    return save_model(
        model, out, expert_layout=expert_layout, prefix=prefix, shard_bytes=shard_bytes, progress=progress, quant=quant
    )


def write_tokenizer(out, vocab_size: int, texts=SAMPLE_TEXTS) -> Path:
    """tokenizer.json + tokenizer_config.json: a byte-level BPE (NFC, no BOS, like Qwen's) trained on `texts`,
    with Qwen's special tokens at special_token_ids(vocab_size) (eos_token `<|im_end|>`)."""
    special = special_token_ids(vocab_size)
    if min(special.values()) < 256:
        raise ValueError(f"vocab_size {vocab_size} cannot hold the 256 byte tokens and {len(special)} special tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(special.values()), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    data = json.loads(tokenizer.to_str())
    # `tokenizers` appends added tokens after the vocabulary; placing them in the vocabulary pins their ids.
    data["model"]["vocab"].update(special)
    data["added_tokens"] = [
        {
            "id": token_id,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": token not in ("<think>", "</think>"),  # as in Qwen's tokenizer: think tags survive decoding
        }
        for token, token_id in special.items()
    ]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / TOKENIZER).write_text(json.dumps(data, ensure_ascii=False) + "\n")
    (out / TOKENIZER_CONFIG).write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}, indent=2) + "\n")
    return out / TOKENIZER


def model_config(name: str, layers: int | None = None, config_dir=REPO_ROOT / "configs") -> ModelConfig:
    """ModelConfig of configs/model/<name>.yaml (its `arch:`), composed by Hydra; `layers` keeps the first layers."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
        composed = compose(overrides=[f"+model={name}"])
    arch = OmegaConf.to_container(composed.model.arch, resolve=True)
    if layers:
        arch["num_hidden_layers"] = layers
        types = arch.pop("layer_types", None)
        if types and layers <= len(types):
            arch["layer_types"] = types[:layers]  # else rebuilt from full_attention_interval
    return ModelConfig.from_dict(arch)


USAGE = __doc__.split("\n\n")[1]
DEFAULTS = {
    "layers": "0",
    "seed": "0",
    "dtype": "bfloat16",
    "expert_layout": "fused",
    "prefix": MULTIMODAL_PREFIX,
    "shard_gb": "5",
    "device": "cpu",
    "tokenizer": "false",
    "quant": "none",
    "config_dir": str(REPO_ROOT / "configs"),
}
BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: list[str]) -> dict:
    """key=value arguments -> typed options; any bad one is a one-line error naming the key (exit code 2)."""
    args = dict(DEFAULTS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in {"model", "out", *DEFAULTS}:
            fail(f"unknown argument {arg!r}; allowed: model=, out=, {'=, '.join(DEFAULTS)}= (--help for usage)")
        args[key] = value
    for key in ("model", "out"):
        if not args.get(key):
            fail(f"{key}= is required (--help for usage)")
    models = sorted(p.stem for p in (Path(args["config_dir"]) / "model").glob("*.yaml"))
    if args["model"] not in models:
        fail(f"model={args['model']}: not in {args['config_dir']}/model; allowed: {', '.join(models) or 'none'}")
    opts = {"model": args["model"], "out": args["out"], "device": args["device"], "config_dir": args["config_dir"]}
    for key, minimum in (("layers", 0), ("seed", 0)):
        try:
            opts[key] = int(args[key])
        except ValueError:
            fail(f"{key}={args[key]}: must be an integer >= {minimum}")
        if opts[key] < minimum:
            fail(f"{key}={args[key]}: must be an integer >= {minimum}")
    try:
        opts["shard_bytes"] = int(float(args["shard_gb"]) * 10**9)
    except ValueError:
        fail(f"shard_gb={args['shard_gb']}: must be a number of GB > 0")
    if opts["shard_bytes"] <= 0:
        fail(f"shard_gb={args['shard_gb']}: must be a number of GB > 0")
    dtype = getattr(torch, args["dtype"], None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        fail(f"dtype={args['dtype']}: not a torch floating-point dtype (e.g. bfloat16, float16, float32)")
    opts["dtype"] = dtype
    if args["expert_layout"] not in EXPERT_LAYOUTS:
        fail(f"expert_layout={args['expert_layout']}: allowed: {', '.join(EXPERT_LAYOUTS)}")
    opts["expert_layout"] = args["expert_layout"]
    if args["prefix"] not in (MULTIMODAL_PREFIX, TEXT_PREFIX):
        fail(f"prefix={args['prefix']}: allowed: {MULTIMODAL_PREFIX}, {TEXT_PREFIX}")
    opts["prefix"] = args["prefix"]
    if args["quant"] not in QUANT_CONFIGS:
        fail(f"quant={args['quant']}: allowed: {', '.join(QUANT_CONFIGS)}")
    opts["quant"] = args["quant"]
    if args["tokenizer"].lower() not in BOOLS:
        fail(f"tokenizer={args['tokenizer']}: must be true or false")
    opts["tokenizer"] = BOOLS[args["tokenizer"].lower()]
    try:
        torch.device(args["device"])
    except RuntimeError:
        fail(f"device={args['device']}: must be cpu, cuda or cuda:N")
    return opts


def main(argv: list[str]) -> None:
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage:{USAGE}\n\n{__doc__.split(chr(10) * 2, 2)[2]}")
        return
    opts = parse_args(argv)
    try:
        cfg = model_config(opts["model"], opts["layers"] or None, opts["config_dir"])
    except ValueError as e:  # the architecture numbers of the chosen config
        fail(str(e).splitlines()[0])
    start = time.perf_counter()
    out = write_checkpoint(
        cfg,
        opts["out"],
        seed=opts["seed"],
        dtype=opts["dtype"],
        expert_layout=opts["expert_layout"],
        prefix=opts["prefix"],
        shard_bytes=opts["shard_bytes"],
        device=opts["device"],
        progress=True,
        quant=opts["quant"],
    )
    if opts["tokenizer"]:
        write_tokenizer(out, cfg.vocab_size)
    total = json.loads((out / INDEX).read_text())["metadata"]["total_size"]
    print(f"wrote {out} ({total / 1e9:.2f} GB, {cfg.num_hidden_layers} layers) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
