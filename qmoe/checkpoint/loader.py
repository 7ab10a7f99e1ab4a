"""Load a Hugging Face Qwen3.5-MoE checkpoint directory (config.json + safetensors) into Qwen35MoE.

Everything is checked from config.json and the safetensors headers before any weight is read: a bad checkpoint
raises CheckpointError (one line naming the tensor or file) and no model is returned. Then each shard is read in
turn (positioned reads on several threads, staging.py) and every tensor goes straight into its parameter on the
target device, moved in its stored dtype and cast there, so host RAM never holds a second copy of the weights: to
the CPU into the parameter itself (or a host tensor cast into it), to a GPU through pinned staging buffers with the
copies overlapped; a sharded model reads each parameter's slices through safetensors.

FP8 checkpoints (config.json `quantization_config`): `quant_method: fp8` (fine-grained blocks, `<w>_scale_inv`
[ceil(N / bn), ceil(K / bk)]) and `compressed-tensors` (`<w>_scale`, per channel [N, 1] or per block). Which tensors
are FP8 is read from the checkpoint (a float8 tensor and its scale), checked against the config's
`modules_to_not_convert` / `ignore`. Each FP8 tensor is held in FP8 (kernels/fp8.py's layout, its scale expanded
per row) where the model can (fp8_weight_names), else dequantized on the device as it is read; with
model.weights=fp8 dense tensors are quantized on the device as they are read.
"""

import hashlib
import json
import logging
import re
import resource
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from kernels.fp8 import BLOCK_K, FP8, dequantize, quantize_into, rows_from_blocks, rows_from_channels
from qmoe.checkpoint.staging import ShardReader, Stager
from qmoe.model.config import ModelConfig
from qmoe.model.qwen35_moe import Qwen35MoE, build_model, fp8_weight_names, shard_blocks
from qmoe.parallel.layout import SINGLE, Layout, fp8_layout_errors

CONFIG, GENERATION_CONFIG = "config.json", "generation_config.json"
INDEX, SINGLE_FILE, TOKENIZER = "model.safetensors.index.json", "model.safetensors", "tokenizer.json"
MULTIMODAL_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
SKIPPED_PREFIXES = {"mtp": "mtp.", "visual": "model.visual."}  # multi-token-prediction head, vision tower
PER_EXPERT_KEY = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
CASTABLE_DTYPES = {"F16", "BF16", "F32", "F64"}  # safetensors dtype names a float model can take
FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # `<weight key><suffix>`: fp8's weight_scale_inv, compressed-tensors'
SHARD_IDENTITIES = ("size+mtime", "sha256")
log = logging.getLogger("qmoe")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line naming the tensor or file."""


@dataclass
class CheckpointInfo:
    path: str
    prefix: str  # "model.language_model." (multimodal releases) or "model." (text-only)
    expert_layout: str  # "fused", "per_expert" or "mixed" (layers differ)
    num_tensors: int  # checkpoint tensors read into the model (fp8 scales included)
    quantization: dict  # method, and counts of parameters: stored fp8, held fp8, dequantized, quantized on load
    skipped: dict  # {"mtp": n, "visual": n}: tensors present and deliberately not loaded
    eos_token_ids: tuple
    load_seconds: float
    phase_seconds: dict  # "check" (config, headers, plan, hashes), "build" (the model allocated), "fill" (copies)
    start_rss_bytes: int  # host RSS when loading began
    peak_rss_bytes: int  # host RSS high-water mark (VmHWM)
    peak_rss_scope: str  # "load": the mark was reset when loading began; "process": since the process started
    file_hashes: dict  # file name -> sha256 hex: config/index/generation config of their content, shards per below
    shard_identity: str  # "size+mtime": sha256 of "<bytes>:<mtime_ns>" (cheap); "sha256": of the whole file
    weights_id: str  # sha256 over file_hashes: one identity for config + weights
    tokenizer_path: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return data


def _ids(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def read_eos_token_ids(path) -> tuple[int, ...]:
    """EOS ids of config.json (top level and text_config) and generation_config.json, united and sorted."""
    path = Path(path)
    config = _read_json(path / CONFIG)
    ids = _ids(config.get("eos_token_id")) + _ids((config.get("text_config") or {}).get("eos_token_id"))
    if (path / GENERATION_CONFIG).is_file():
        ids += _ids(_read_json(path / GENERATION_CONFIG).get("eos_token_id"))
    return tuple(sorted(set(ids)))


def read_config(path, arch_overrides: dict | None = None) -> ModelConfig:
    """The checkpoint's ModelConfig (EOS ids from both config files), checked against explicit overrides: an
    override that differs from the checkpoint's value is an error naming both."""
    path = Path(path)
    file = path / CONFIG
    config = _read_json(file)
    model_type = config.get("model_type")
    if model_type == "qwen3_5_moe" and isinstance(config.get("text_config"), dict):
        text = config["text_config"]
    elif model_type == "qwen3_5_moe_text":
        text = config
    else:
        raise CheckpointError(
            f"{file}: model_type {model_type!r} is not qwen3_5_moe (with text_config) or qwen3_5_moe_text"
        )
    try:
        cfg = ModelConfig.from_dict({**text, "eos_token_ids": read_eos_token_ids(path)})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: {e}") from None
    names = {f.name for f in fields(ModelConfig)}
    for key, value in (arch_overrides or {}).items():
        if key not in names:
            raise CheckpointError(f"model.arch.{key}: not a ModelConfig field")
        if isinstance(value, Sequence) and not isinstance(value, str):
            value = tuple(value)
        if value != getattr(cfg, key):
            raise CheckpointError(f"model.arch.{key}={value!r} conflicts with {key}={getattr(cfg, key)!r} in {file}")
    return cfg


def _shard_files(path: Path) -> tuple[dict | None, list[str]]:
    """(index weight map or None, shard file names) of a sharded or single-file checkpoint."""
    index_file = path / INDEX
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_file}: no weight_map")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (path / name).is_file():
                raise CheckpointError(f"{path / name}: shard named by {INDEX} is absent")
        return weight_map, files
    if (path / SINGLE_FILE).is_file():
        return None, [SINGLE_FILE]
    raise CheckpointError(f"{path}: has neither {INDEX} nor {SINGLE_FILE}")


def _read_headers(path: Path, files: list[str], weight_map: dict | None) -> dict[str, tuple[str, str, tuple]]:
    """key -> (shard file, safetensors dtype, shape), from the headers alone (no tensor data is read)."""
    tensors = {}
    for name in files:
        try:
            with safe_open(path / name, framework="pt") as f:
                header = {key: (f.get_slice(key).get_dtype(), tuple(f.get_slice(key).get_shape())) for key in f.keys()}
        except Exception as e:  # safetensors' own error type: bad header, offsets past the end of a short file
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{path / name}: corrupt or truncated safetensors file ({message})") from None
        for key, (dtype, shape) in header.items():
            if key in tensors:
                raise CheckpointError(f"{key}: stored twice, in {tensors[key][0]} and {name}")
            tensors[key] = (name, dtype, shape)
    for key, name in (weight_map or {}).items():
        if tensors.get(key, (None,))[0] != name:
            raise CheckpointError(f"{key}: {INDEX} puts it in {name}, which does not hold it")
    return tensors


@dataclass(frozen=True)
class Quantization:
    """config.json's quantization_config, checked: which scale layout the checkpoint's FP8 tensors carry and which
    modules it says stay in high precision."""

    method: str | None = None  # None (no quantization_config), "fp8" or "compressed-tensors"
    block: tuple | None = None  # (rows, cols) of a block scale; None: per output channel [N, 1]
    dense_modules: tuple = ()  # modules_to_not_convert (substrings) or ignore (names, suffixes, "re:" patterns)

    @property
    def scale_suffix(self) -> str:
        return "_scale_inv" if self.method == "fp8" else "_scale"

    @property
    def dense_key(self) -> str:
        return "modules_to_not_convert" if self.method == "fp8" else "ignore"

    def kept_dense(self, module: str) -> bool:
        """Whether the config names `module` (a key without its last part) as not quantized."""
        if self.method == "fp8":  # transformers' rule: a listed name anywhere in the module's name
            return any(entry in module for entry in self.dense_modules)
        return any(
            re.match(entry[3:], module) if entry.startswith("re:") else module == entry or module.endswith("." + entry)
            for entry in self.dense_modules
        )

    def scale_shape(self, shape: tuple) -> tuple:
        *lead, N, K = shape
        if self.block is None:
            return (*lead, N, 1)
        return (*lead, -(-N // self.block[0]), -(-K // self.block[1]))

    def scale_rows(self, scale: torch.Tensor, shape: tuple) -> torch.Tensor:
        """The stored scale -> kernels/fp8.py's [..., N, ceil(K / 128)] fp32."""
        N, K = shape[-2:]
        return rows_from_channels(scale, K) if self.block is None else rows_from_blocks(scale, N, K, self.block)


def _block(value, where: str) -> tuple:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)
    if not ok or value[1] % BLOCK_K:
        raise CheckpointError(f"{where}: {value!r} must be [rows, cols] with cols a multiple of {BLOCK_K}")
    return tuple(value)


def read_quantization(path) -> Quantization:
    """The checkpoint's Quantization from config.json."""
    file = Path(path) / CONFIG
    return parse_quantization(_read_json(file).get("quantization_config"), f"{file}: quantization_config")


def parse_quantization(q: dict | None, where: str) -> Quantization:
    """A quantization_config -> Quantization; anything this loader cannot run is one line naming the key."""
    if q is None:
        return Quantization()
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"{where}.fmt {q['fmt']!r} is not supported; allowed: e4m3")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise CheckpointError(f"{where}.activation_scheme {q['activation_scheme']!r}: allowed: dynamic")
        block = _block(q.get("weight_block_size", [128, 128]), f"{where}.weight_block_size")
        return Quantization("fp8", block, tuple(q.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        groups = q.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise CheckpointError(f"{where}.config_groups: missing or empty")
        blocks = set()
        for name, group in groups.items():
            w = (group or {}).get("weights") or {}
            at = f"{where}.config_groups.{name}.weights"
            if (w.get("num_bits"), w.get("type")) != (8, "float"):
                raise CheckpointError(f"{at}: num_bits {w.get('num_bits')!r} type {w.get('type')!r}; allowed: 8, float")
            if w.get("strategy") == "block":
                blocks.add(_block(w.get("block_structure"), f"{at}.block_structure"))
            elif w.get("strategy") == "channel":
                blocks.add(None)
            else:
                raise CheckpointError(f"{at}.strategy {w.get('strategy')!r} is not supported; allowed: channel, block")
            act = (group or {}).get("input_activations")
            if act is not None and not act.get("dynamic", False):
                raise CheckpointError(f"{where}.config_groups.{name}.input_activations: static; allowed: dynamic")
        if len(blocks) > 1:
            raise CheckpointError(f"{where}.config_groups: mixes scale strategies; one per checkpoint is supported")
        return Quantization("compressed-tensors", blocks.pop(), tuple(q.get("ignore") or ()))
    raise CheckpointError(f"{where}.quant_method {method!r} is not supported; allowed: fp8, compressed-tensors")


@dataclass
class _Plan:
    prefix: str
    expert_layout: str
    reads: dict  # checkpoint key -> (parameter name, expert index or None, "gate" | "up" | "down" | None)
    skipped: dict
    quantization: Quantization = field(default_factory=Quantization)
    scales: dict = field(default_factory=dict)  # fp8 weight key -> its scale's key
    stored_fp8: frozenset = frozenset()  # parameter names stored in FP8


def _param_name(key: str, prefix: str) -> str | None:
    if key.startswith("lm_head."):
        return key
    name = key[len(prefix) :] if key.startswith(prefix) else None
    return None if name is None or name.startswith("lm_head.") else name


def _plan(cfg: ModelConfig, tensors: dict, dtype: torch.dtype, quant: Quantization = Quantization()) -> _Plan:
    """Map every checkpoint key to its parameter (or a skipped prefix) and check names, shapes and dtypes."""
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in Qwen35MoE(cfg).named_parameters()}
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    prefix = MULTIMODAL_PREFIX if any(k.startswith(MULTIMODAL_PREFIX) for k in tensors) else TEXT_PREFIX
    skipped = dict.fromkeys(SKIPPED_PREFIXES, 0)
    reads, unexpected, scale_of = {}, [], {}
    for key in tensors:
        kind = next((kind for kind, p in SKIPPED_PREFIXES.items() if key.startswith(p)), None)
        name = _param_name(key, prefix)
        expert = PER_EXPERT_KEY.fullmatch(name or "")
        scale_suffix = next((suffix for suffix in SCALE_SUFFIXES if key.endswith(suffix)), None)
        if kind:
            skipped[kind] += 1
        elif scale_suffix and name not in shapes:
            if quant.method is None:
                raise CheckpointError(f"{key}: an FP8 scale, but {CONFIG} has no quantization_config")
            if scale_suffix != quant.scale_suffix:
                raise CheckpointError(f"{key}: quant_method {quant.method} names scales <weight>{quant.scale_suffix}")
            weight_key = key.removesuffix(scale_suffix)
            if weight_key not in tensors:
                raise CheckpointError(f"{key}: the scale of {weight_key}, which the checkpoint does not hold")
            scale_of[weight_key] = key
        elif name in shapes:
            reads[key] = (name, None, None)
        elif expert and int(expert[1]) < cfg.num_hidden_layers and int(expert[2]) < E:
            fused = "down_proj" if expert[3] == "down" else "gate_up_proj"
            reads[key] = (f"layers.{expert[1]}.mlp.experts.{fused}", int(expert[2]), expert[3])
        else:
            unexpected.append(key)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"unexpected tensor {unexpected[0]} in {tensors[unexpected[0]][0]}{more}")

    precision = {}  # parameter name -> (a key stored in it, whether fp8): the parts of one tensor must agree
    for key, (name, expert, part) in reads.items():
        file, stored_dtype, shape = tensors[key]
        want = shapes[name] if expert is None else (H, I) if part == "down" else (I, H)
        if shape != want:
            raise CheckpointError(f"{key}: shape {list(shape)} in {file}, expected {list(want)}")
        fp8 = stored_dtype == FP8_DTYPE
        if fp8:
            _check_fp8(key, shape, tensors, quant, scale_of)
        elif stored_dtype not in CASTABLE_DTYPES:
            raise CheckpointError(f"{key}: dtype {stored_dtype} in {file} cannot be cast to {dtype}")
        elif key in scale_of:
            raise CheckpointError(f"{scale_of[key]}: a scale for {key}, which is stored in {stored_dtype}, not float8")
        other, other_fp8 = precision.setdefault(name, (key, fp8))
        if other_fp8 != fp8:
            raise CheckpointError(
                f"{key}: {stored_dtype} but {other} of the same tensor is {tensors[other][1]}: one precision per tensor"
            )

    pieces: dict[str, set] = {}
    for name, expert, part in reads.values():
        pieces.setdefault(name, set()).add((expert, part))
    missing = []
    for name in shapes:
        have = pieces.get(name, set())
        key = name if name.startswith("lm_head.") else prefix + name
        if (None, None) in have and len(have) > 1:
            raise CheckpointError(f"{key}: stored both fused and per expert")
        if not have:
            missing.append(key)
        elif (None, None) not in have:  # per expert: every part of every expert
            parts = ("down",) if name.endswith("down_proj") else ("gate", "up")
            base = key.removesuffix("gate_up_proj").removesuffix("down_proj")
            missing += [f"{base}{e}.{p}_proj.weight" for e in range(E) for p in parts if (e, p) not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]}{more}")

    layouts = {"fused" if expert is None else "per_expert" for name, expert, _ in reads.values() if ".experts." in name}
    layout = layouts.pop() if len(layouts) == 1 else "mixed"
    stored_fp8 = frozenset(name for name, (_, fp8) in precision.items() if fp8)
    return _Plan(prefix, layout, reads, skipped, quant, scale_of, stored_fp8)


def _check_fp8(key: str, shape: tuple, tensors: dict, quant: Quantization, scale_of: dict) -> None:
    """A float8 weight: the config declares FP8, does not keep its module dense, and its scale has the shape and
    dtype of the config's scale layout."""
    file = tensors[key][0]
    if quant.method is None:
        raise CheckpointError(f"{key}: float8 ({FP8_DTYPE}) in {file}, but {CONFIG} has no quantization_config")
    if len(shape) < 2:
        raise CheckpointError(f"{key}: float8 ({FP8_DTYPE}) in {file}; only matrices can be float8")
    module = key.rpartition(".")[0]
    if quant.kept_dense(module):
        raise CheckpointError(
            f"{key}: float8 in {file}, but quantization_config.{quant.dense_key} keeps {module} in high precision"
        )
    scale_key = scale_of.get(key)
    if scale_key is None:
        raise CheckpointError(f"{key}: float8 in {file} without its scale {key}{quant.scale_suffix}")
    scale_file, scale_dtype, scale_shape = tensors[scale_key]
    want = quant.scale_shape(shape)
    if scale_shape != want:
        layout = "per output channel" if quant.block is None else f"{quant.block[0]}x{quant.block[1]} blocks"
        raise CheckpointError(
            f"{scale_key}: shape {list(scale_shape)} in {scale_file}, expected {list(want)} "
            f"({layout} of {key} {list(shape)})"
        )
    if scale_dtype not in CASTABLE_DTYPES:
        raise CheckpointError(f"{scale_key}: dtype {scale_dtype} in {scale_file}; a scale must be a float dtype")


def _by_file(keys, tensors: dict) -> dict[str, list]:
    by_file: dict[str, list] = {}
    for key in keys:
        by_file.setdefault(tensors[key][0], []).append(key)
    return by_file


def _read_scales(path: Path, plan: _Plan, tensors: dict, device) -> dict:
    """fp8 weight key -> its scale in kernels/fp8.py's per-row layout on `device` (all of them are 1/16384 to 1/128
    of the fp8 bytes, so they are read first and a weight never waits on another shard)."""
    weight_of = {scale: weight for weight, scale in plan.scales.items()}
    rows = {}
    for file, keys in _by_file(weight_of, tensors).items():
        with safe_open(path / file, framework="pt") as f:
            for key in keys:
                weight = weight_of[key]
                rows[weight] = plan.quantization.scale_rows(f.get_tensor(key).to(device), tensors[weight][2])
    return rows


def key_blocks(full_shape: tuple, dims: dict | None, expert: int | None, part: str | None, I: int):
    """(index into the checkpoint tensor, index into the local parameter) of every piece of this rank's slice
    that one checkpoint tensor holds: the tensor covers its whole parameter, or (per expert) one expert's gate,
    up or down block of it (then dim 0, the expert, is absent from the tensor)."""
    region = [(0, n) for n in full_shape]
    if expert is not None:
        region[0] = (expert, expert + 1)
        if part in ("gate", "up"):
            region[1] = (0, I) if part == "gate" else (I, 2 * I)
    blocks = shard_blocks(dims) if dims else [((), ())]
    for src, dst in blocks:
        src = src + (slice(None),) * (len(full_shape) - len(src))
        dst = dst + (slice(None),) * (len(full_shape) - len(dst))
        read, write = [], []
        for d, (s, t, (lo_r, hi_r)) in enumerate(zip(src, dst, region)):
            lo, hi = (s.start, s.stop) if s.start is not None else (0, full_shape[d])
            a, b = max(lo, lo_r), min(hi, hi_r)
            if a >= b:
                break  # this piece of the slice lies outside the tensor
            at = (t.start or 0) + a - lo
            if expert is not None and d == 0:
                write.append(at)  # the expert's own index; the tensor has no expert dim
            else:
                read.append(slice(a - lo_r, b - lo_r))
                write.append(slice(at, at + b - a))
        else:
            yield tuple(read), tuple(write)


def read_slice(f: ShardReader, key: str, index: tuple, stager: Stager) -> torch.Tensor:
    """The part `index` of tensor `key` on the stager's device, through its buffers: the slice's runs, or the span
    between its first and last byte where the runs are short (staging.py)."""
    return stager.slice_to_device(f, key, index)


@torch.no_grad()
def _fill(model: Qwen35MoE, path: Path, plan: _Plan, tensors: dict, progress: bool) -> None:
    """Copy every planned tensor into its parameter (or one expert's rows of a fused one), shard by shard: fp8 into
    fp8 (and its scale), fp8 into a dense parameter dequantized on the device, dense into fp8 quantized there. A
    sharded model (tensor / expert parallel) reads only its slices (_fill_slices)."""
    params = dict(model.named_parameters())
    specs = model.shard_specs()
    I = model.config.moe_intermediate_size
    scales = _read_scales(path, plan, tensors, model.device)
    full = _full_shapes(model)
    bar = tqdm(total=len(plan.reads), desc="load weights", unit="tensor", disable=not progress)
    if specs:
        _fill_slices(params, specs, full, I, path, plan, tensors, scales, bar, Stager(model.device))
        bar.close()
        return
    # to a GPU through pinned buffers (one host copy per byte, copies overlapped); to the CPU straight into the
    # parameter where it holds the stored dtype
    stager = Stager(model.device) if model.device.type == "cuda" else None
    for file, keys in _by_file(plan.reads, tensors).items():
        with ShardReader(path / file) as f:
            for key in keys:
                name, expert, part = plan.reads[key]
                rows = slice(None, I) if part == "gate" else slice(I, None) if part == "up" else slice(None)
                dest = (params[name] if expert is None else params[name][expert])[rows]
                dest_scale = params.get(f"{name}_scale")  # [..., N, Kb] like the weight's rows
                if dest_scale is not None:
                    dest_scale = (dest_scale if expert is None else dest_scale[expert])[rows]
                direct = stager is None and dest.dtype == f.spec(key)[0] and dest.is_contiguous()
                try:  # moved in its stored dtype, converted on the device
                    if direct:
                        f.read_into(key, dest)
                    else:
                        stored = f.host_tensor(key) if stager is None else stager.to_device(f, key)
                except Exception as e:
                    raise CheckpointError(f"{key}: cannot be read from {path / file} ({e})") from None
                if direct:
                    if key in scales:
                        dest_scale.copy_(scales[key])
                elif key in scales and dest.dtype == FP8:
                    dest.copy_(stored)
                    dest_scale.copy_(scales[key])
                elif key in scales:
                    dest.copy_(dequantize(stored, scales[key], dest.dtype))
                elif dest.dtype == FP8:
                    quantize_into(dest, dest_scale, stored)
                else:
                    dest.copy_(stored)
                bar.update()
    bar.close()


def _fill_slices(params, specs, full, I, path, plan, tensors, scales, bar, stager: Stager) -> None:
    """_fill for a sharded model: each parameter's slices of its checkpoint tensors, read through the stager
    (read_slice), FP8 as in _fill: a stored FP8 slice with its scale's rows and column blocks (every K split falls
    on the 128-column blocks: load_checkpoint checks fp8_layout_errors), kept or dequantized; a dense slice
    quantized into an FP8 parameter (the blocks of a row, so the slice of the quantized full tensor)."""
    for file, keys in _by_file(plan.reads, tensors).items():
        with ShardReader(path / file) as f:
            for key in keys:
                name, expert, part = plan.reads[key]
                dest_all, dest_scales = params[name], params.get(f"{name}_scale")
                for index, dst in key_blocks(full[name], specs.get(name), expert, part, I):
                    try:  # moved in its stored dtype, converted on the device
                        piece = read_slice(f, key, index, stager)
                    except Exception as e:
                        raise CheckpointError(f"{key}: cannot be read from {path / file} ({e})") from None
                    dest = dest_all[dst]
                    if key in scales:  # stored fp8: the scale rows and column blocks of the piece
                        scale = scales[key][scale_index(index, tensors[key][2])]
                        if dest.dtype == FP8:
                            dest.copy_(piece)
                            dest_scales[scale_index(dst, dest_all.shape)].copy_(scale)
                        else:
                            dest.copy_(dequantize(piece, scale, dest.dtype))
                    elif dest.dtype == FP8:
                        dest_scale = dest_scales[scale_index(dst, dest_all.shape)]
                        for d, sc, w in (
                            [(dest, dest_scale, piece)] if dest.is_contiguous() else zip(dest, dest_scale, piece)
                        ):  # a slice of rows of every expert: each expert's rows are contiguous
                            quantize_into(d, sc, w)
                    else:
                        dest.copy_(piece)
                bar.update()


def scale_index(index: tuple, shape: tuple) -> tuple:
    """The index of a weight [..., N, K] -> the index of its per-row scale [..., N, ceil(K / 128)]: the same rows,
    the 128-column blocks of its columns (which start on a block)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    cols = index[-1]
    lo, hi = cols.start or 0, shape[-1] if cols.stop is None else cols.stop
    assert lo % BLOCK_K == 0, f"a K split at column {lo}, off the fp8 scale blocks"
    return index[:-1] + (slice(lo // BLOCK_K, -(-hi // BLOCK_K)),)


def _full_shapes(model: Qwen35MoE) -> dict[str, tuple]:
    """The unsharded shape of every parameter (its own shape when the model is not sharded)."""
    from qmoe.model.qwen35_moe import full_shapes

    if not model.layout.sharded:
        return {name: tuple(p.shape) for name, p in model.named_parameters()}
    return {name: tuple(shape) for name, shape in full_shapes(model.config).items()}


def _status_bytes(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field_name)


def _reset_peak_rss() -> str:
    """Reset the kernel's RSS high-water mark (Linux clear_refs 5) so the peak measured is the load's own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return "load"
    except OSError:
        return "process"


def _peak_rss() -> int:
    try:
        return _status_bytes("VmHWM")
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _current_rss() -> int:
    try:
        return _status_bytes("VmRSS")
    except (OSError, KeyError):
        return 0


def _sha256_file(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(path, shard_files: list[str], shard_identity: str = "size+mtime") -> dict[str, str]:
    """sha256 of the config files' content and of each shard's identity (see CheckpointInfo.shard_identity)."""
    path = Path(path)
    if shard_identity not in SHARD_IDENTITIES:
        raise ValueError(f"shard_identity must be one of {SHARD_IDENTITIES}, got {shard_identity!r}")
    hashes = {name: _sha256_file(path / name) for name in (CONFIG, GENERATION_CONFIG, INDEX) if (path / name).is_file()}
    for name in shard_files:
        if shard_identity == "sha256":
            hashes[name] = _sha256_file(path / name)
        else:
            stat = (path / name).stat()
            hashes[name] = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return hashes


def _checked_plan(path: Path, cfg: ModelConfig, dtype: torch.dtype) -> tuple[_Plan, dict, list[str]]:
    """(plan, headers, shard files) of a checkpoint: everything checked, nothing read but config and headers."""
    weight_map, files = _shard_files(path)
    tensors = _read_headers(path, files, weight_map)
    return _plan(cfg, tensors, dtype, read_quantization(path)), tensors, files


def lacks_fp8(device) -> bool:
    """A GPU without FP8 (compute capability < 8.9): FP8 checkpoints are dequantized on load there."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def held_fp8(cfg: ModelConfig, plan: _Plan, weights: str, device) -> frozenset:
    """The parameters the loaded model holds in FP8 (fp8_weight_names of model.weights and the stored FP8 set);
    none on a GPU without FP8."""
    return frozenset() if lacks_fp8(device) else fp8_weight_names(cfg, weights, plan.stored_fp8)


def checkpoint_fp8_names(path, cfg: ModelConfig, weights: str = "auto", device="cpu") -> frozenset:
    """The parameters load_checkpoint(path, weights=weights) will hold in FP8 (for sizing it before loading)."""
    plan, _, _ = _checked_plan(Path(path), cfg, torch.float32)
    return held_fp8(cfg, plan, weights, device)


def load_checkpoint(
    path,
    *,
    dtype: torch.dtype,
    device,
    arch_overrides: dict | None = None,
    progress: bool = False,
    shard_identity: str = "size+mtime",
    weights: str = "auto",
    layout: Layout = SINGLE,
) -> tuple[Qwen35MoE, CheckpointInfo]:
    """Build the checkpoint's model on `device` in `dtype` and fill every parameter from its safetensors (this
    rank's slices of them under `layout`, each read once: its runs of bytes, or the span between its first and last
    byte where its runs are short: qmoe/checkpoint/staging.py).
    weights (model.weights): auto -> FP8 where the checkpoint stores it, dense -> every tensor in `dtype` (FP8
    dequantized on load), fp8 -> the projections and experts in FP8 (dense ones quantized on load).

    Raises CheckpointError before any weight is copied for a bad config, missing/unexpected tensors, wrong shapes,
    uncastable dtypes, FP8 tensors without (or with wrong) scales or against the quantization_config, corrupt or
    truncated shards and index entries naming absent shards."""
    start = time.perf_counter()
    rss_scope = _reset_peak_rss()
    start_rss = _current_rss()
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    cfg = read_config(path, arch_overrides)
    plan, tensors, files = _checked_plan(path, cfg, dtype)
    hashes = file_hashes(path, files, shard_identity)

    fp8 = held_fp8(cfg, plan, weights, device)
    if layout.sharded and (plan.stored_fp8 or fp8):  # each rank's K slices must hold whole scale blocks
        errors = fp8_layout_errors(cfg.to_dict(), layout.tp, layout.ep)
        if errors:
            raise CheckpointError(f"{path}: {errors[0]}")
    if plan.stored_fp8 and lacks_fp8(device):
        log.warning(f"{torch.cuda.get_device_name(device)} has no FP8 support: FP8 weights dequantized on load")
    built = time.perf_counter()
    model = build_model(cfg, dtype, device, seed=None, fp8=fp8, layout=layout)
    filled = time.perf_counter()
    _fill(model, path, plan, tensors, progress)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    end = time.perf_counter()

    info = CheckpointInfo(
        path=str(path.resolve()),
        prefix=plan.prefix,
        expert_layout=plan.expert_layout,
        num_tensors=len(plan.reads) + len(plan.scales),
        quantization={
            "method": plan.quantization.method,
            "stored_fp8": len(plan.stored_fp8),
            "held_fp8": len(fp8),
            "dequantized": len(plan.stored_fp8 - fp8),
            "quantized": len(fp8 - plan.stored_fp8),
        },
        skipped=plan.skipped,
        eos_token_ids=cfg.eos_token_ids,
        load_seconds=end - start,
        phase_seconds={"check": built - start, "build": filled - built, "fill": end - filled},
        start_rss_bytes=start_rss,
        peak_rss_bytes=_peak_rss(),
        peak_rss_scope=rss_scope,
        file_hashes=hashes,
        shard_identity=shard_identity,
        weights_id=hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest(),
        tokenizer_path=str(path / TOKENIZER) if (path / TOKENIZER).is_file() else None,
    )
    return model, info
