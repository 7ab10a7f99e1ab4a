"""The generation loop shared by every runner, and the `reference` runner (the plain model, no export).

A runner owns the device state: `start(prompt [B, L])` prefills positions 0..L-1 and returns the sampled next
token per row; `step(forced)` feeds one token per row at the next position and returns the next sample;
`launch(forced)` queues that step and returns a function that waits for its sample. Rows of a batch advance
together; a row whose prompt is longer than the shortest one is fed its own prompt tokens (`forced`) until its
prompt is consumed, so ragged batches give each row what it would get alone.

The heap that exists when a generation starts (the model, the imports: ~230,000 objects) is frozen out of the garbage
collector while it runs (`gc.freeze`): a full collection scans it in ~135 ms on the project's CPU machine, so one
landing in a measured prefill or decode step would be charged to it (a 4096-token TTFT of 314 ms against 66-70 in
every other start on the same H200 host, 098cecc). Objects made during the generation are collected as usual.

The loop keeps one step queued ahead: step t + 1 is launched before step t's token ids are read, so the device
runs the steps back to back while the host reads, checks and records the ids (a runner whose next step takes
its input from the host, like `host` sampling, runs each step whole in `launch`: nothing overlaps). The step
queued when the last row stops on an EOS id runs and is dropped; with max_new_tokens reached none is queued.
"""

import gc
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
        pinned = model.device.type == "cuda"
        # two read-back buffers: a queued step's copy must not overwrite the ids the host has not read yet
        self.read_buffers = [torch.empty(batch, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.token_host = self.read_buffers[0]  # the ids read back last
        self.decode_steps = 0
        # a stream for the read-backs (set by a runner whose token buffer persists): the copy then waits for its
        # step on that stream, and the next step, queued behind nothing, overlaps it; whatever next writes the
        # token buffer waits for the copy (`await_read_back`)
        self.read_stream: torch.cuda.Stream | None = None
        self.read_done: torch.cuda.Event | None = None

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

    def put(self, method: str, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """dst <- src (nothing when they are one buffer); a copy across memory spaces is recorded."""
        if dst.data_ptr() == src.data_ptr() and dst.shape == src.shape:
            return dst
        return transfer(dst, src, self.space_of(src), self.space_of(dst), self.ledger, method, "runner", non_blocking)

    def read_back(self, method: str, token: torch.Tensor) -> torch.Tensor:
        """Token ids [B] -> host (for EOS checks and streaming): the one read-back a step needs."""
        return self.read_back_later(method, token)()

    def read_back_later(self, method: str, token: torch.Tensor):
        """Queue the read-back of token ids [B] (asynchronous into pinned memory from a GPU) -> a function that
        waits for it and returns the ids."""
        buffer = self.read_buffers[self.decode_steps % 2]
        stream = self.read_stream if token.is_cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # None: the current stream
            self.put(method, buffer, token, non_blocking=True)
            copied = torch.cuda.Event() if token.is_cuda else None
            if copied is not None:
                copied.record()
        self.read_done = copied if stream is not None else None

        def ids() -> torch.Tensor:
            if copied is not None:
                copied.synchronize()
            self.token_host = buffer
            return buffer.clone()

        return ids

    def await_read_back(self) -> None:
        """The current stream waits for the last read-back queued on `read_stream` (before it overwrites what the
        copy reads)."""
        if self.read_done is not None:
            torch.cuda.current_stream().wait_event(self.read_done)
            self.read_done = None

    def launch(self, forced: torch.Tensor | None):
        """Queue one decode step -> a function returning its token ids. Here the whole step runs now."""
        tokens = self.step(forced)
        return lambda: tokens


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
    """Run prefill + decode until every row has max_new_tokens tokens or has produced an EOS id, with the heap
    made before it frozen out of the garbage collector (the module docstring; a caller's own freeze is kept)."""
    unfreeze = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        return _generate(runner, prompts, max_new_tokens, eos_ids, progress)
    finally:
        if unfreeze:
            gc.unfreeze()


def _generate(runner, prompts: list[list[int]], max_new_tokens: int, eos_ids, progress: bool) -> Generation:
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

    def forced_at(pos: int) -> torch.Tensor | None:
        """The prompt ids fed at `pos` to rows still reading their prompt (-1: the row's own sample)."""
        if pos >= longest:
            return None
        return torch.tensor([p[pos] if pos < len(p) else -1 for p in prompts], dtype=torch.int64)

    t0 = time.perf_counter()
    tokens = runner.start(prompt)
    ttft_ms = (time.perf_counter() - t0) * 1e3
    _check_tokens(tokens, 0)
    take(tokens, shortest)
    gen = Generation(out, ttft_ms)
    total_steps = longest - shortest + max_new_tokens - 1
    bar = tqdm(total=total_steps, desc="decode", disable=not progress, unit="step")
    pos = shortest
    prefill_tokens = sum(map(len, out))
    t0 = time.perf_counter()
    queued = None if all(done) else runner.launch(forced_at(pos))
    before = None  # while a step's tokens are being taken: (rows' lengths, done) before it, to undo a half-taken step
    try:
        while queued is not None:
            # Queue the next step before reading this one's ids. A forced step merges prompt ids with the last
            # sample on the host, so it is queued only once this step's ids are read.
            launched = len(gen.decode_ms) + 1
            ahead = launched < total_steps and forced_at(pos + 1) is None
            following = runner.launch(None) if ahead else None
            tokens = queued()  # waits for the step's ids (the device runs on through `following`)
            now = time.perf_counter()
            step_ms, t0 = (now - t0) * 1e3, now
            pos += 1
            _check_tokens(tokens, launched)
            before = [len(row) for row in out], list(done)
            take(tokens, pos)
            gen.decode_ms.append(step_ms)  # a step counts once its tokens are taken
            before = None
            bar.update()
            if all(done):
                break
            queued = following if ahead else runner.launch(forced_at(pos))
    except KeyboardInterrupt:  # (a Ctrl-C between a step's take and its record: the step is undone)
        gen.interrupted = True
        if before is not None and len(gen.decode_ms) < launched:
            lengths, done[:] = before
            for row, n in zip(out, lengths):
                del row[n:]
    finally:
        bar.close()
        gen.decode_tokens = sum(map(len, out)) - prefill_tokens
    return gen
