"""Prompts -> token id rows: explicit ids, text through the checkpoint's tokenizer, or random ids from a seed."""

import torch
from omegaconf import DictConfig, OmegaConf

from qmoe.settings import ConfigError, require


def build_prompts(prompt: DictConfig, batch_size: int, vocab_size: int, tokenizer=None) -> list[list[int]]:
    """One list of token ids per batch row (rows may differ in length)."""
    ids = OmegaConf.to_container(prompt.token_ids) if OmegaConf.is_config(prompt.token_ids) else prompt.token_ids
    text = prompt.text
    if ids is not None:
        require(isinstance(ids, list) and len(ids) > 0, "prompt.token_ids", "must be a non-empty list of ids")
        rows = ids if isinstance(ids[0], list) else [ids] * batch_size
        require(
            len(rows) == batch_size,
            "prompt.token_ids",
            f"has {len(rows)} rows but generation.batch_size is {batch_size}",
        )
        for row in rows:
            require(len(row) > 0, "prompt.token_ids", "rows must not be empty")
            for t in row:
                require(
                    isinstance(t, int) and 0 <= t < vocab_size,
                    "prompt.token_ids",
                    f"ids must be integers in [0, {vocab_size})",
                    t,
                )
        return [list(r) for r in rows]
    if text is not None:
        require(
            tokenizer is not None,
            "prompt.text",
            "needs a checkpoint with tokenizer.json (set model.checkpoint) or use prompt.token_ids / prompt.length",
        )
        texts = list(text) if OmegaConf.is_list(text) else [text] * batch_size
        require(
            len(texts) == batch_size, "prompt.text", f"has {len(texts)} rows but generation.batch_size is {batch_size}"
        )
        rows = [tokenizer.encode(t, chat=bool(prompt.chat)) for t in texts]
        require(all(rows), "prompt.text", "encodes to no tokens")
        top = max(max(r) for r in rows)
        require(
            top < vocab_size, "prompt.text", f"the tokenizer gives id {top}, outside the model's vocab {vocab_size}"
        )
        return rows
    length = prompt.length
    require(isinstance(length, int) and length >= 1, "prompt.length", "must be an integer >= 1", length)
    gen = torch.Generator().manual_seed(int(prompt.seed))
    return torch.randint(0, vocab_size, (batch_size, length), generator=gen).tolist()


def check_fits(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > max_seq_len:
        raise ConfigError(
            f"prompt: {longest} tokens + generation.max_new_tokens {max_new_tokens} exceed "
            f"model.max_seq_len {max_seq_len}"
        )
