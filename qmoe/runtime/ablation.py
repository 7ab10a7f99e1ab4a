"""One ablation row without Hydra: a runner over a live model, warmed up, timed, its ledger checked against the
profiler and its per-step device allocations counted. Used by experiments/runtime_acceptance.py and the GPU
tests; the Hydra app (qmoe/app.py) builds the same runners from a composed config."""

import time

import torch

from qmoe.metrics.measure import latency_stats
from qmoe.runtime.generate import generate
from qmoe.runtime.ledger import TransferLedger
from qmoe.runtime.profile import ledger_totals, profiled_memcpys
from qmoe.runtime.runners import make_runner


def decode_allocations(runner, prompt: torch.Tensor, steps: int) -> dict:
    """CUDA caching-allocator requests and cudaMallocs (segments) over `steps` decode steps after a prefill."""
    runner.start(prompt)
    runner.step(None)  # a first step of its own: lazily built state is not a per-step cost
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    for _ in range(steps):
        runner.step(None)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    return {
        key: (after.get(f"{key}.all.allocated", 0) - before.get(f"{key}.all.allocated", 0)) / steps
        for key in ("allocation", "segment")
    }


def measure(model, runtime, export, sampling, prompts, new_tokens, cuda_graph, warmup_steps=2, profile_steps=8):
    """-> row: tokens, latency, ledger summary, profiler vs ledger per phase, allocations per decode step."""
    ledger = TransferLedger()
    runner = make_runner(model, runtime, export, sampling, len(prompts), ledger, cuda_graph)
    t0 = time.perf_counter()
    generate(runner, prompts, warmup_steps + 1)  # compiles, autotunes, captures the CUDA graphs
    torch.cuda.synchronize()
    warmup_ms = (time.perf_counter() - t0) * 1e3
    ledger.clear()
    gen = generate(runner, prompts, new_tokens)
    row = {
        "tokens": gen.tokens,
        "latency": latency_stats(gen.ttft_ms, gen.decode_ms, gen.decode_tokens, warmup_ms),
        "transfers": ledger.summary(gen.decode_tokens),
    }
    prompt = torch.tensor(prompts, dtype=torch.int64)
    ledger.clear()
    _, prof_prefill = profiled_memcpys(lambda: runner.start(prompt))
    _, prof_decode = profiled_memcpys(lambda: [runner.step(None) for _ in range(profile_steps)])
    profile = {
        "decode_steps": profile_steps,
        "prefill": {"profiler": prof_prefill, "ledger": ledger_totals(ledger, "prefill")},
        "decode": {"profiler": prof_decode, "ledger": ledger_totals(ledger, "decode")},
    }
    profile["agree"] = all(p["profiler"] == p["ledger"] for p in (profile["prefill"], profile["decode"]))
    row["profile"] = profile
    row["allocations_per_decode_step"] = decode_allocations(runner, prompt, profile_steps)
    return row
