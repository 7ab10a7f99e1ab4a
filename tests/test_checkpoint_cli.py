"""`python run.py model.checkpoint=DIR` on checkpoints written by transformers and by qmoe's writer."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from qmoe.checkpoint import write_checkpoint, write_tokenizer
from qmoe.model import build_model
from qmoe.model.hf import to_transformers
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
# vocab 512 holds the 256 byte tokens, the BPE merges and Qwen's special tokens at the top ids
TINY = tiny_config()


def run_cli(tmp_path, *args, stdout: list | None = None) -> dict:
    out = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "run.py", "logger=none", f"hydra.run.dir={out}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr
    if stdout is not None:
        stdout.append(p.stdout)
    return json.loads((out / "results.json").read_text())


@torch.no_grad()
def test_save_pretrained_checkpoint_generates_like_transformers(tmp_path):
    hf = to_transformers(build_model(TINY, torch.float32, "cpu", seed=11))
    hf.save_pretrained(tmp_path / "ckpt")
    prompt = [5, 77, 300, 12, 9, 140]
    results = run_cli(
        tmp_path, f"model.checkpoint={tmp_path / 'ckpt'}", f"prompt.token_ids={prompt}", "generation.max_new_tokens=10"
    )
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert results["generated"]["token_ids"][0] == expected[0, len(prompt) :].tolist()
    assert results["model"]["weights"]["kind"] == "checkpoint"
    assert results["generated"]["text"] is None  # no tokenizer.json: no text is invented


def test_text_prompt_through_tokenizer_and_eos_stop(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_checkpoint(
        TINY,
        ckpt,
        seed=0,
        dtype=torch.float32,
        expert_layout="fused",
        prefix="model.language_model.",
        shard_bytes=1 << 20,
    )
    tok = write_tokenizer(ckpt, TINY.vocab_size)
    assert tok.exists()
    printed = []
    free = run_cli(
        tmp_path,
        f"model.checkpoint={ckpt}",
        "prompt.text=hello world",
        "prompt.chat=true",
        "generation.stop_on_eos=false",
        "generation.max_new_tokens=6",
        stdout=printed,
    )
    ids = free["generated"]["token_ids"][0]
    assert isinstance(free["generated"]["text"][0], str) and len(ids) == 6
    from qmoe.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(ckpt)
    assert free["prompt"]["token_ids"][0] == tokenizer.encode("hello world", chat=True)
    assert free["generated"]["text"][0] == tokenizer.decode(ids)
    text_rows = [line for line in printed[0].splitlines() if line.startswith("text[0]")]
    assert text_rows[0].endswith(repr(tokenizer.decode(ids)))  # the summary prints the generated text
    # Declare a token the model produces as EOS in generation_config.json: generation stops right after it.
    stop_at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    gen_cfg = json.loads((ckpt / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [ids[stop_at]]
    (ckpt / "generation_config.json").write_text(json.dumps(gen_cfg))
    stopped = run_cli(
        tmp_path,
        f"model.checkpoint={ckpt}",
        "prompt.text=hello world",
        "prompt.chat=true",
        "generation.max_new_tokens=6",
    )
    assert stopped["generated"]["token_ids"][0] == ids[: stop_at + 1]
