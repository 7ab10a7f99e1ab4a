"""The checkpoint's tokenizer.json (byte-level BPE) through the `tokenizers` library, with Qwen's ChatML prompt."""

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from qmoe.checkpoint.loader import TOKENIZER, CheckpointError, read_eos_token_ids

TOKENIZER_CONFIG = "tokenizer_config.json"
# Qwen3.5's special tokens and their ids in the released 248320-token vocabulary.
QWEN_SPECIAL_TOKENS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<think>": 248068,
    "</think>": 248069,
}
CHAT_TEMPLATE = "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n<think>\n"  # ChatML + generation prompt


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Qwen's special-token ids, or, for a vocabulary too small to hold them, the same tokens in the same order
    at its last ids (synthetic checkpoints and test tokenizers use these)."""
    if vocab_size > max(QWEN_SPECIAL_TOKENS.values()):
        return dict(QWEN_SPECIAL_TOKENS)
    first = vocab_size - len(QWEN_SPECIAL_TOKENS)
    return {token: first + i for i, token in enumerate(QWEN_SPECIAL_TOKENS)}


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, eos_token_ids: tuple[int, ...], path: str):
        self.tokenizer, self.eos_token_ids, self.path = tokenizer, eos_token_ids, path

    @property
    def vocab_size(self) -> int:
        """One past the largest id the tokenizer can produce."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of `text` (no BOS: Qwen has none); with chat, wrapped as one ChatML user turn followed by the
        assistant generation prompt."""
        text = CHAT_TEMPLATE.format(text=text) if chat else text
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(checkpoint_dir) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it has no tokenizer.json. EOS ids: those of config.json and
    generation_config.json plus tokenizer_config.json's eos_token (Qwen3.5: 248044 and 248046)."""
    path = Path(checkpoint_dir)
    file = path / TOKENIZER
    if not file.is_file():
        return None
    try:
        tokenizer = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
        raise CheckpointError(f"{file}: not a valid tokenizer.json ({str(e).splitlines()[0]})") from None
    eos = set(read_eos_token_ids(path))
    if (path / TOKENIZER_CONFIG).is_file():
        token = json.loads((path / TOKENIZER_CONFIG).read_text()).get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None and tokenizer.token_to_id(token) is not None:
            eos.add(tokenizer.token_to_id(token))
    return Tokenizer(tokenizer, tuple(sorted(eos)), str(file))
