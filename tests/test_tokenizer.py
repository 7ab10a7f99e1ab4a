"""The checkpoint tokenizer: a byte-level BPE tokenizer.json trained here drives text in, text out, the ChatML
prompt and the EOS ids."""

import json
import unicodedata

import pytest
import torch

from qmoe.checkpoint import CheckpointError, load_tokenizer, special_token_ids, write_tokenizer
from qmoe.checkpoint.synth import write_configs
from tests.helpers import tiny_config

VOCAB = 512
CFG = tiny_config(num_hidden_layers=2)
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",  # words seen in training: merged tokens
    "zyxwvut qqq",  # unseen: falls back to single bytes
    "naïve café — 東京 🦊",  # multi-byte UTF-8, an emoji outside every merge
    "  leading spaces\nand\ttabs  ",  # whitespace kept exactly (no prefix space added)
    "",
]


@pytest.fixture
def ckpt(tmp_path):
    write_configs(CFG, tmp_path, "model.language_model.", torch.float32)
    write_tokenizer(tmp_path, VOCAB)
    return tmp_path


def test_special_tokens_sit_at_their_ids_inside_the_vocab(ckpt):
    tok = load_tokenizer(ckpt)
    special = special_token_ids(VOCAB)
    assert sorted(special.values()) == list(range(VOCAB - 5, VOCAB))
    for token, token_id in special.items():
        assert tok.encode(token) == [token_id]
        assert tok.decode([token_id], skip_special_tokens=False) == token
    assert tok.vocab_size == VOCAB


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips(ckpt, text):
    tok = load_tokenizer(ckpt)
    ids = tok.encode(text)
    assert all(0 <= i < VOCAB for i in ids)
    assert tok.decode(ids) == text


def test_trained_merges_shorten_seen_text(ckpt):
    tok = load_tokenizer(ckpt)
    seen = "The quick brown fox jumps over the lazy dog."
    assert len(tok.encode(seen)) < len(seen.encode()) / 2
    assert len(tok.encode("zyxwvut")) == len("zyxwvut")


def test_nfc_normalisation(ckpt):
    tok = load_tokenizer(ckpt)
    decomposed = unicodedata.normalize("NFD", "café")
    assert decomposed != "café"
    assert tok.encode(decomposed) == tok.encode("café")
    assert tok.decode(tok.encode(decomposed)) == "café"


def test_chat_prompt_is_chatml_with_think_generation_prompt(ckpt):
    tok = load_tokenizer(ckpt)
    special = special_token_ids(VOCAB)
    ids = tok.encode("Hello fox", chat=True)
    expected = "<|im_start|>user\nHello fox<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert tok.decode(ids, skip_special_tokens=False) == expected
    assert ids[0] == special["<|im_start|>"] and ids[-2:] == [special["<think>"], tok.encode("\n")[0]]
    assert ids.count(special["<|im_start|>"]) == 2 and ids.count(special["<|im_end|>"]) == 1
    assert ids[1 : ids.index(special["<|im_end|>"])] == tok.encode("user\nHello fox")
    # control tokens are dropped from output text, think tags are kept (as in Qwen's tokenizer)
    assert tok.decode(ids) == "user\nHello fox\nassistant\n<think>\n"


def test_eos_ids_unite_config_generation_config_and_tokenizer_config(ckpt):
    special = special_token_ids(VOCAB)
    both = (special["<|endoftext|>"], special["<|im_end|>"])
    assert load_tokenizer(ckpt).eos_token_ids == both
    (ckpt / "generation_config.json").unlink()  # config.json has <|endoftext|>, tokenizer_config <|im_end|>
    assert load_tokenizer(ckpt).eos_token_ids == both
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert load_tokenizer(ckpt).eos_token_ids == both[:1]


def test_generated_ids_decode_up_to_eos(ckpt):
    """What the app does with a generation: cut at the first EOS id, decode the rest."""
    tok = load_tokenizer(ckpt)
    answer = tok.encode("The lazy dog.")
    generated = answer + [special_token_ids(VOCAB)["<|im_end|>"]] + tok.encode("ignored")
    stop = next(i for i, t in enumerate(generated) if t in tok.eos_token_ids)
    assert tok.decode(generated[:stop]) == "The lazy dog."


def test_qwen_sized_vocab_uses_released_ids(tmp_path):
    big = tiny_config(num_hidden_layers=2, vocab_size=248320)
    write_configs(big, tmp_path, "model.", torch.bfloat16)
    write_tokenizer(tmp_path, big.vocab_size)
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_ids == (248044, 248046)
    assert tok.encode("x", chat=True)[:1] == [248045] and tok.encode("x", chat=True)[-2] == 248068


def test_no_tokenizer_json_gives_none(tmp_path):
    write_configs(CFG, tmp_path, "model.", torch.float32)
    assert load_tokenizer(tmp_path) is None


def test_invalid_tokenizer_json_names_the_file(ckpt):
    (ckpt / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(CheckpointError, match=rf"{ckpt / 'tokenizer.json'}: not a valid tokenizer.json"):
        load_tokenizer(ckpt)


def test_vocab_too_small_for_bytes_and_specials(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 260 cannot hold"):
        write_tokenizer(tmp_path, 260)
