"""The generation loop shared by every runner, and the `reference` runner (the plain model, no export).

A runner owns the device state: `start(prompt [B, L])` prefills positions 0..L-1 and returns the sampled next
token per row; `step(forced)` feeds one token per row at the next position and returns the next sample.
Rows of a batch advance together; a row whose prompt is longer than the shortest one is fed its own prompt
tokens (`forced`) until its prompt is consumed, so ragged batches give each row what it would get alone.
"""

import time
from dataclasses import dataclass, field

import torch

from kernels.sampling.naive import INVALID_TOKEN
from qmoe.export.settings import device_name
from qmoe.parallel.collectives import recording
from qmoe.runtime.ledger import TransferLedger, transfer
from qmoe.settings import SamplingSettings


class GenerationError(RuntimeError):
    """A generation that cannot go on (e.g. NaN logits): one line naming the row and step."""


def sampling_tensors(s: SamplingSettings, batch: int, device) -> dict:
    """Per-row sampling parameters as device tensors (what the sampler and exported methods take)."""

    def full(value, dtype):
        return torch.full((batch,), value, dtype=dtype, device=device)

    return {
        "temperature": full(s.temperature, torch.float32),
        "top_k": full(s.top_k, torch.int64),
        "top_p": full(s.top_p, torch.float32),
        "min_p": full(s.min_p, torch.float32),
        "seed": full(s.seed, torch.int64),
    }


class Runner:
    """What every runner shares: the ledger's phase and step tags, and the copies it makes itself (`put`,
    `read_back`), recorded under source "runner" whenever they cross memory spaces."""

    name = "runner"

    def __init__(self, model, batch: int, ledger: TransferLedger):
        self.model, self.batch, self.ledger = model, batch, ledger
        self.token_host = torch.empty(batch, dtype=torch.int64, pin_memory=model.device.type == "cuda")
        self.decode_steps = 0

    def space_of(self, t: torch.Tensor) -> str:
        """The memory space that holds `t` ("cpu", "cuda:0", or a program's planned arena)."""
        return device_name(t.device)

    def begin_prefill(self) -> None:
        self.model.reset_caches()
        self.ledger.at("prefill", 0)
        self.decode_steps = 0

    def begin_decode(self) -> None:
        self.decode_steps += 1
        self.ledger.at("decode", self.decode_steps)

    def put(self, method: str, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """dst <- src (nothing when they are one buffer); a copy across memory spaces is recorded."""
        if dst.data_ptr() == src.data_ptr() and dst.shape == src.shape:
            return dst
        return transfer(dst, src, self.space_of(src), self.space_of(dst), self.ledger, method, "runner")

    def read_back(self, method: str, token: torch.Tensor) -> torch.Tensor:
        """Token ids [B] -> host (for EOS checks and streaming): the one read-back a step needs."""
        return self.put(method, self.token_host, token).clone()


class ReferenceRunner(Runner):
    """The eager PyTorch model: forward + sample on the model's device, token ids read back every step."""

    name = "reference"

    def __init__(self, model, sampling: SamplingSettings, batch: int, ledger: TransferLedger):
        super().__init__(model, batch, ledger)
        self.device = model.device
        self.params = sampling_tensors(sampling, batch, self.device)
        self.pos = 0

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        step = torch.full_like(self.params["seed"], self.pos - 1)
        self.last = self.model.sample(logits, step=step, **self.params)
        return self.read_back("forward", self.last)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return self.put("forward", torch.empty_like(t, device=self.device), t)

    @torch.no_grad()
    def start(self, prompt: torch.Tensor) -> torch.Tensor:
        self.begin_prefill()
        B, L = prompt.shape
        input_pos = torch.zeros(B, dtype=torch.int64, device=self.device)
        with recording(self.ledger, "forward"):  # collectives of a sharded model
            logits = self.model(self._to_device(prompt), input_pos)
            self.pos = L
            return self._sample(logits)

    @torch.no_grad()
    def step(self, forced: torch.Tensor | None) -> torch.Tensor:
        self.begin_decode()
        token = self.last
        if forced is not None:
            forced = self._to_device(forced)
            token = torch.where(forced >= 0, forced, token)
        input_pos = torch.full_like(token, self.pos)
        with recording(self.ledger, "forward"):
            logits = self.model(token[:, None], input_pos)
            self.pos += 1
            return self._sample(logits)


@dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per row
    ttft_ms: float
    decode_ms: list[float] = field(default_factory=list)  # one entry per decode step
    decode_tokens: int = 0  # generated tokens produced by decode steps, all rows
    interrupted: bool = False  # Ctrl-C during decode: what was generated and timed until then


def _check_tokens(tokens: torch.Tensor, step: int) -> None:
    bad = (tokens == INVALID_TOKEN).nonzero().flatten().tolist()
    if bad:
        raise GenerationError(f"logits: NaN in batch row {bad[0]} at generation step {step}; no token can be sampled")


def generate(runner, prompts: list[list[int]], max_new_tokens: int, eos_ids=(), progress: bool = False) -> Generation:
    """Run prefill + decode until every row has max_new_tokens tokens or has produced an EOS id."""
    from tqdm import tqdm

    B = len(prompts)
    lengths = [len(p) for p in prompts]
    shortest, longest = min(lengths), max(lengths)
    prompt = torch.tensor([p[:shortest] for p in prompts], dtype=torch.int64)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    eos = set(eos_ids)

    def take(tokens: torch.Tensor, pos: int) -> None:
        """Record the token sampled for position `pos` in the rows whose prompts are consumed."""
        for b, t in enumerate(tokens.tolist()):
            if not done[b] and pos >= lengths[b]:
                out[b].append(t)
                done[b] = len(out[b]) >= max_new_tokens or t in eos

    t0 = time.perf_counter()
    tokens = runner.start(prompt)
    ttft_ms = (time.perf_counter() - t0) * 1e3
    _check_tokens(tokens, 0)
    take(tokens, shortest)
    gen = Generation(out, ttft_ms)
    total_steps = longest - shortest + max_new_tokens - 1
    bar = tqdm(total=total_steps, desc="decode", disable=not progress, unit="step")
    pos = shortest
    try:
        while not all(done):
            forced = None
            if pos < longest:  # some rows are still reading their prompt
                forced = torch.tensor([p[pos] if pos < len(p) else -1 for p in prompts], dtype=torch.int64)
            t0 = time.perf_counter()
            tokens = runner.step(forced)  # the host read of the token ids synchronises the device
            step_ms = (time.perf_counter() - t0) * 1e3
            pos += 1
            _check_tokens(tokens, len(gen.decode_ms) + 1)
            before = sum(map(len, out))
            take(tokens, pos)
            gen.decode_ms.append(step_ms)  # a step counts once its tokens are taken: the record stays consistent
            gen.decode_tokens += sum(map(len, out)) - before
            bar.update()
    except KeyboardInterrupt:
        gen.interrupted = True
    finally:
        bar.close()
    return gen
