"""The program directory: round trip without weights, and refusal of anything changed since export."""

import json
import shutil

import pytest
import torch

from qmoe.export import ExportError, ExportSettings, export_program, load_program
from qmoe.export.artifact import _canonical, _sha256_bytes, sha256_file
from tests.test_export import tiny_model
from tests.test_model import TINY

B, S = 1, 16
IDENTITY = {"kind": "random", "seed": 0, "arch": "tiny"}
SETTINGS = ExportSettings(preset="device_planned", method_split="fused", device_memory_planning=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model(B, S)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    program = export_program(model, SETTINGS, B, S)
    directory = program.save(tmp_path_factory.mktemp("program"), IDENTITY)
    return program, directory


def greedy(step: int):
    z, zi = torch.zeros(B), torch.zeros(B, dtype=torch.int64)
    return z, zi, torch.ones(B), z, zi, torch.full((B,), step, dtype=torch.int64)


def generate(program, model, prompt, steps=3):
    model.reset_caches()
    (tok,) = program.methods["prefill"](prompt, torch.zeros(B, dtype=torch.int64), *greedy(0))
    out = [tok.clone()]
    for step in range(1, steps + 1):
        pos = torch.full((B,), prompt.shape[1] + step - 1, dtype=torch.int64)
        (tok,) = program.methods["decode"](out[-1][:, None], pos, *greedy(step))
        out.append(tok.clone())
    return torch.stack(out)


def test_round_trip(model, saved):
    program, directory = saved
    assert not any(p.stat().st_size > 1 << 20 for p in directory.rglob("*"))  # no weights inside
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and manifest["methods"] == ["prefill", "decode"]
    assert manifest["model_config"] == model.config.to_dict() and manifest["weights_identity"] == IDENTITY
    loaded = load_program(directory, model, IDENTITY)
    assert loaded.plan == program.plan and loaded.settings == program.settings
    # the loaded methods use the live model's weights and caches, not copies
    delegate = loaded.methods["decode"].delegate
    assert any(t is model.lm_head.weight for t in delegate.args)
    assert any(t is model.layers[1].self_attn.k_cache for t in delegate.args)
    prompt = torch.randint(0, TINY["vocab_size"], (B, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(generate(loaded, model, prompt), generate(program, model, prompt))


def copy_of(directory, tmp_path):
    return shutil.copytree(directory, tmp_path / "copy")


def edit_manifest(directory, change, keep_digest=False):
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    if not keep_digest:  # a consistent manifest: only the check that reads the field can refuse it
        manifest.pop("digest")
        manifest["digest"] = _sha256_bytes(_canonical(manifest).encode())
    path.write_text(json.dumps(manifest))


def append_byte(path):
    with open(path, "ab") as f:
        f.write(b"\0")


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda d: edit_manifest(d, lambda m: m.update(max_seq_len=8), keep_digest=True), "manifest.json was changed"),
        (lambda d: edit_manifest(d, lambda m: m.update(format_version=2)), "format version 2"),
        (lambda d: (d / "plan.json").write_text((d / "plan.json").read_text().replace("256", "128")), "plan.json"),
        (lambda d: append_byte(d / "methods" / "decode.pt2"), "methods/decode.pt2"),
        (lambda d: (d / "export_config.json").unlink(), "export_config.json is missing"),
        (lambda d: edit_manifest(d, lambda m: m["model_config"].update(hidden_size=128)), "model config differs"),
    ],
    ids=["manifest", "version", "plan", "method", "missing-file", "model-config"],
)
def test_changed_artifact_refused(model, saved, tmp_path, tamper, message):
    directory = copy_of(saved[1], tmp_path)
    tamper(directory)
    with pytest.raises(ExportError, match=message):
        load_program(directory, model, IDENTITY)


def test_other_weights_refused(model, saved):
    with pytest.raises(ExportError, match="are not the exported"):
        load_program(saved[1], model, {**IDENTITY, "seed": 1})


def test_plan_recomputed_on_load_must_match(model, saved, tmp_path):
    """A plan file that is self-consistent but not what this code plans for the methods is refused."""
    directory = copy_of(saved[1], tmp_path)
    plan = json.loads((directory / "plan.json").read_text())
    plan["alignment"] = 64
    (directory / "plan.json").write_text(json.dumps(plan, indent=1, sort_keys=True))
    edit_manifest(directory, lambda m: m["files"].update({"plan.json": sha256_file(directory / "plan.json")}))
    with pytest.raises(ExportError, match="plan.json is not the plan"):
        load_program(directory, model, IDENTITY)


def test_caches_must_match(saved):
    other = tiny_model(B + 1, S)
    with pytest.raises(ExportError, match="setup_caches"):
        load_program(saved[1], other, IDENTITY)
