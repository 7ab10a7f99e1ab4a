"""Tensor and expert parallel on the CPU (gloo): 2 and 4 processes on the tiny model in fp32 give one process's
tokens (greedy and sampled) and logits; every shard is the slice of the unsharded weights (random init and the
sharded checkpoint loader, which reads each slice once); the vocab-parallel sampler equals the reference on
ties, cuts and special rows; the ledger counts every collective; torchrun errors are one line."""

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import rel_err, tiny_config

from kernels.sampling import naive as naive_sampling
from kernels.sampling import triton as fused_sampling
from qmoe.model import build_model
from qmoe.model.qwen35_moe import shard_blocks
from qmoe.parallel import fp8_layout_errors, layout_errors
from qmoe.parallel.layout import Layout
from qmoe.parallel.sampling import Filters
from qmoe.runtime.generate import ReferenceRunner, generate
from qmoe.runtime.ledger import TransferLedger
from qmoe.settings import SamplingSettings

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingSettings(0.0, 0, 1.0, 0.0, 0)
SAMPLED = SamplingSettings(0.8, 20, 0.9, 0.02, 3)  # every filter on, so every global cut is exercised
UNFILTERED = SamplingSettings(1.1, 0, 1.0, 0.05, 4)  # temperature and min-p alone: no cut to find
PROMPTS = [[5, 17, 300, 2, 9], [44, 1, 8, 250, 13, 77, 6, 31]]  # ragged: row 1 reads its prompt while row 0 decodes
NEW = 5
LAYOUTS = {  # (tp, ep, also run the exported cuda_native loop, the checkpoint's expert layout)
    "tp2": (2, 1, True, "fused"),
    "tp4": (4, 1, False, "per_expert"),  # more ranks than kv heads (2) and DeltaNet key heads (2): replicated
    "ep2": (1, 2, False, "fused"),
    "tp2xep2": (2, 2, False, "per_expert"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sampler_cases(V: int) -> tuple[torch.Tensor, dict]:
    """Logits [B, V] whose rows put the reference's edge cases across rank boundaries: ties of the maximum on
    two ranks, a top-k cut inside a run of ties, +inf on a later rank, NaN on one rank, a row of -inf, k >= V,
    and per-row parameters (greedy, sampled)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, V, generator=gen, dtype=torch.float64) * 3
    logits[1, [3, V - 2]] = 50.0  # the max tied on the first and the last rank: the lowest index wins
    logits[2, : V // 2] = 1.0  # ties at every cut
    logits[3, [V - 1, V // 2 + 1]] = float("inf")
    logits[4, V - 5] = float("nan")
    logits[5] = float("-inf")
    params = {
        "temperature": torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.7, 1.3]),
        "top_k": torch.tensor([0, 0, V // 4 + 1, 5, 0, 0, 10**6, 7]),
        "top_p": torch.tensor([1.0, 1.0, 0.5, 1.0, 0.9, 1.0, 0.8, 0.95]),
        "min_p": torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.3]),
        "seed": torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]),
        "step": torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]),
    }
    return logits, params


def llm_cases(V: int) -> tuple[torch.Tensor, dict]:
    """Rows like a model's (N(0, 2^2) with 16 candidates lifted well above it, the lifted ones on every rank) under
    the filters users set: top-k 50 + top-p 0.9, top-p alone, min-p alone, top-k over the vocabulary, a low and a
    high temperature; the cuts fall among the lifted tokens and in the tail. Rows 8-9: min-p 0.3 at T = 3 drops
    ~40 % of the mass (a min-p left out changes their tokens); rows 10-11: every logit negative (a cut whose key
    orders negative floats backwards keeps the wrong tokens)."""
    gen = torch.Generator().manual_seed(11)
    B = 12
    logits = torch.randn(B, V, generator=gen, dtype=torch.float64) * 2
    lifted = torch.randperm(V, generator=gen)[:16]
    logits[:, lifted] += torch.linspace(12, 4, 16, dtype=torch.float64)
    logits[10:] -= 40
    params = {
        "temperature": torch.tensor([1.0, 1.0, 0.7, 1.0, 1.0, 0.05, 5.0, 1.0, 3.0, 3.0, 1.0, 2.0]),
        "top_k": torch.tensor([50, 0, 0, 0, V, 50, 50, 3, 0, 0, 3, 0]),
        "top_p": torch.tensor([0.9, 0.95, 0.5, 1.0, 1.0, 0.9, 0.9, 1.0, 1.0, 1.0, 1.0, 0.5]),
        "min_p": torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.0, 0.0]),
        "seed": torch.arange(B) + 100,
        "step": torch.arange(B) * 7,
    }
    return logits, params


CANDIDATES = 8  # the top-k bound of cut_cases: below a rank's 64-token slice, so ranks hold more than they send


def cut_cases(V: int) -> tuple[torch.Tensor, dict]:
    """fp32 logits [96, V] and per-row parameters for the two ways to the Triton sampler's cuts (search, and each
    rank's CANDIDATES best; every top_k in 1 .. CANDIDATES): rows of few levels (ties at the top-k cut past what
    a rank sends, on several ranks; a few tokens above such a run), the best tokens all on one rank, fewer finite
    logits than k, +inf, NaN, a row of -inf, all negative, at three temperatures and top-p from very low to off."""
    gen = torch.Generator().manual_seed(23)
    B = 96
    logits = torch.randn(B, V, generator=gen) * 2
    logits[0:24] = torch.randint(-3, 3, (24, V), generator=gen).float()  # 6 levels: ties everywhere
    logits[24:36, : V // 4] += 6.0  # the best tokens on the first rank
    logits[36:44, torch.randperm(V, generator=gen)[: V - 5]] = float("-inf")  # 5 finite logits: k may exceed them
    logits[44:48, 3] = float("inf")
    logits[48:52, V - 2] = float("nan")
    logits[52:56] = float("-inf")
    logits[56:64] -= 40  # every logit negative
    # three tokens above a run of 30 ties at the top-6 cut, spread over the ranks: the top-k set's mass (and so the
    # top-p cut among the three) needs every tie, past the few a rank sends
    logits[64:72] -= 10
    spread = torch.randperm(V, generator=gen)
    logits[64:72, spread[:30]] = 1.0
    logits[64:72, spread[30:33]] = torch.tensor([4.0, 3.0, 2.5])
    params = {
        "temperature": torch.tensor([0.5, 1.0, 2.0, 0.0])[torch.arange(B) % 4],
        "top_k": torch.randint(1, CANDIDATES + 1, (B,), generator=gen).index_fill(0, torch.arange(64, 72), 6),
        "top_p": torch.tensor([0.05, 0.37, 0.61, 0.93, 0.999, 1.0])[torch.arange(B) % 6],
        "min_p": torch.tensor([0.0, 0.0, 0.1])[torch.arange(B) % 3],
        "seed": torch.arange(B) + 7,
        "step": torch.arange(B) * 3,
    }
    return logits, params


class CollectiveCounter:
    """An independent count of the collectives a rank runs: torch.distributed's all_reduce / all_gather calls
    (the real ones still run), with the bytes each moves, by the ledger's phase."""

    def __init__(self, ledger: TransferLedger):
        import torch.distributed as dist

        self.seen = []
        for name, kind in (("all_reduce", "all_reduce"), ("all_gather", "all_gather")):
            original = getattr(dist, name)

            def counted(*args, _original=original, _kind=kind, **kwargs):
                tensors = args[0] if isinstance(args[0], list) else [args[0]]
                self.seen.append((ledger.phase, _kind, sum(t.nbytes for t in tensors)))
                return _original(*args, **kwargs)

            setattr(dist, name, counted)


def slice_mismatches(model, full: dict) -> list[str]:
    """The parameters of a sharded model that are not their slices of the unsharded model's `full` parameters:
    values as bytes (fp8 has no equality op on the CPU), a scale's K ranges its weight's in 128-column blocks."""
    specs = model.shard_specs()

    def spec_of(name: str, ndim: int) -> dict:
        if not name.endswith("_scale"):
            return specs.get(name, {0: None})
        spec = specs.get(name.removesuffix("_scale"), {0: None})
        return {d: [(a // 128, n // 128) for a, n in r] if d == ndim - 1 and r else r for d, r in spec.items()}

    def raw(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    return [
        name
        for name, p in model.named_parameters()
        if not all(torch.equal(raw(p[dst]), raw(full[name][src])) for src, dst in shard_blocks(spec_of(name, p.dim())))
    ]


def load_counting_reads(path, **kwargs):
    """loader.load_checkpoint(path, fp32 on the CPU, **kwargs) -> (model, info, (slices read more than once, bytes
    read)), counted at the loader's one read of a tensor slice."""
    from qmoe.checkpoint import loader

    reads, read = [], loader.read_slice

    def counted_read(f, key, index, stager):
        t = read(f, key, index, stager)
        reads.append((key, repr(index), t.nbytes))
        return t

    loader.read_slice = counted_read
    try:
        model, info = loader.load_checkpoint(path, dtype=torch.float32, device="cpu", **kwargs)
    finally:
        loader.read_slice = read
    return model, info, (len(reads) - len({(k, i) for k, i, _ in reads}), sum(n for *_, n in reads))


def rank_checks(rank: int, tp: int, ep: int, checkpoint: str | None, exported: bool, port: int, queue) -> None:
    """Everything one rank checks; the test process compares what rank 0 reports with one process."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp * ep), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    from qmoe import parallel
    from qmoe.parallel import collectives, sampling

    layout = parallel.init(tp, ep, "cpu")
    out = {}
    full = build_model(tiny_config(), torch.float32, "cpu", seed=0)
    model = build_model(tiny_config(), torch.float32, "cpu", seed=0, layout=layout)
    out["init_mismatch"] = slice_mismatches(model, dict(full.named_parameters()))

    model.setup_caches(2, 32)
    model.reset_caches()
    logits = [model(torch.tensor(PROMPTS[0][:4])[None].expand(2, -1), torch.zeros(2, dtype=torch.int64))]
    for pos in range(4, 8):
        token = sampling.greedy(logits[-1], model.vocab_start)
        logits.append(model(token[:, None], torch.full((2,), pos)))
    out["logits"] = [collectives.all_gather(x, "world").permute(1, 0, 2).flatten(1).tolist() for x in logits]

    ledger = TransferLedger()
    counter = CollectiveCounter(ledger)
    for name, s in (("greedy", GREEDY), ("sampled", SAMPLED), ("unfiltered", UNFILTERED)):
        # each rank's Triton candidates (interpreter); sampled: the cuts from each rank's 20 best logits
        model.set_kernels({"sampling": "triton"}, greedy=s.greedy, filters=Filters(s.top_k, s.top_p < 1))
        triton_ledger = TransferLedger()
        gen = generate(ReferenceRunner(model, s, 2, triton_ledger), PROMPTS, NEW)
        out[f"{name}_triton"] = gen.tokens
        out[f"{name}_triton_decode_collectives"] = sorted(
            (c.kind, c.nbytes) for c in triton_ledger.collectives if c.phase == "decode" and c.step == 1
        )
        if s is UNFILTERED:
            continue
        model.set_kernels({"sampling": "torch"}, greedy=s.greedy)
        ledger.clear()
        counter.seen.clear()
        gen = generate(ReferenceRunner(model, s, 2, ledger), PROMPTS, NEW)
        out[name] = gen.tokens
        out[f"{name}_ledger"] = sorted((c.phase, c.kind, c.nbytes) for c in ledger.collectives)
        out[f"{name}_counted"] = sorted(counter.seen)
        out[f"{name}_per_token"] = ledger.summary(gen.decode_tokens)["inter_gpu"]["per_decode_token"]

    V = 64 * tp * ep
    cases, params = sampler_cases(V)
    Vl = V // layout.world
    mine = cases[:, layout.rank * Vl : (layout.rank + 1) * Vl]
    out["sampler"] = sampling.sample(mine, layout.rank * Vl, *params.values()).tolist()
    out["sampler_greedy"] = sampling.greedy(mine[:2], layout.rank * Vl).tolist()
    for name, (rows, row_params) in (("cases", (cases, params)), ("llm", llm_cases(V))):
        mine = rows.float()[:, layout.rank * Vl : (layout.rank + 1) * Vl]
        out[f"triton_{name}"] = sampling.sample(mine, layout.rank * Vl, *row_params.values(), triton=True).tolist()
        out[f"triton_{name}_greedy"] = sampling.greedy(mine, layout.rank * Vl, triton=True).tolist()

    rows, row_params = cut_cases(V)
    mine = rows[:, layout.rank * Vl : (layout.rank + 1) * Vl]
    c, top_k, top_p = sampling.exp2_scale(row_params["temperature"]), row_params["top_k"], row_params["top_p"]
    searched = sampling.searched_cuts(mine, c, top_k, top_p)
    candidates = sampling.candidate_cuts(mine, c, top_k, top_p, CANDIDATES)
    out["cuts_searched"], out["cuts_candidates"] = [(m.tolist(), cut.tolist()) for m, cut in (searched, candidates)]
    out["triton_cut_cases"] = sampling.sample(mine, layout.rank * Vl, *row_params.values(), triton=True,
                                              filters=Filters(CANDIDATES, True)).tolist()  # fmt: skip

    partial = torch.full((3,), float(rank + 1))
    out["reduced_in_place"] = collectives.reduced(partial, "world") is partial and partial.tolist()

    if exported:  # the cuda_native loop over exported methods (collectives as custom ops) on the CPU delegate
        from qmoe.export import ExportSettings
        from qmoe.export.methods import export_methods
        from qmoe.export.program import Delegate

        ep = export_methods(model, "forward_only", 2, 32)["forward"]
        delegate = Delegate("forward", ep, model).graph_module
        out["exported_all_reduces"] = [  # the exported graph's, and those its delegate runs on the partial sums
            sum(n.target is target for n in gm.graph.nodes)
            for gm, target in (
                (ep.graph_module, torch.ops.qmoe.all_reduce.default),
                (delegate, collectives.all_reduce_consumed),
            )
        ]
        from qmoe.runtime.cuda_native import CudaNativeRunner
        from qmoe.runtime.executor import build_program

        runs = [("greedy", GREEDY, "split", "torch"), ("sampled", SAMPLED, "fused", "torch")]
        runs += [("sampled_triton", SAMPLED, "split", "triton")]  # the Triton candidates' custom op exports
        runs += [("unfiltered_triton", UNFILTERED, "fused", "triton")]  # no cut to find, in the fused split
        for name, s, split, sampler in runs:
            model.set_kernels({"sampling": sampler}, greedy=s.greedy, filters=Filters(s.top_k, s.top_p < 1))
            flags = {"skip_h2d_for_method_inputs": True, "skip_d2h_for_method_outputs": True}
            settings = ExportSettings(preset="copy_elided", method_split=split, device_memory_planning=True, **flags)
            runner = CudaNativeRunner(build_program(model, settings, 2, 32), model, s, 2, TransferLedger(), False)
            out[f"exported_{name}"] = generate(runner, PROMPTS, NEW).tokens

    if checkpoint is not None:
        loaded, _, reads = load_counting_reads(checkpoint, layout=layout)
        source = build_model(tiny_config(), torch.float32, "cpu", seed=3)
        out["load_mismatch"] = slice_mismatches(loaded, dict(source.named_parameters()))
        out["reads_repeated"], out["bytes_read"] = reads
        out["bytes_held"] = sum(p.nbytes for p in loaded.parameters())
    queue.put(out if rank == 0 else None)
    parallel.shutdown()


def reporting_rank(target, rank: int, *args) -> None:
    """target(rank, *args) in a rank's process; an exception goes on the queue (args[-1]) as a rank's error, so the
    test fails at once with its traceback instead of waiting out the queue."""
    try:
        target(rank, *args)
    except BaseException:
        args[-1].put({"rank_error": f"rank {rank}:\n{traceback.format_exc()}"})
        raise


def spawn_ranks(target, world: int, *args) -> dict:
    """target(rank, *args, port, queue) in `world` processes -> what rank 0 put on the queue (the others put None)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=reporting_rank, args=(target, r, *args, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        results.append(queue.get(timeout=300))
        if results[-1] is not None and "rank_error" in results[-1]:
            for p in procs:
                p.kill()  # its peers may wait in a collective for it
            pytest.fail(results[-1]["rank_error"], pytrace=False)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return next(r for r in results if r is not None)


def run_ranks(tp: int, ep: int, checkpoint: str | None = None, exported: bool = False) -> dict:
    return spawn_ranks(rank_checks, tp * ep, tp, ep, checkpoint, exported)


@pytest.fixture(scope="module")
def one_process():
    """What one process computes: logits of the same steps, tokens, the sampler on the edge cases."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = build_model(tiny_config(), torch.float32, "cpu", seed=0)
    model.setup_caches(2, 32)
    with torch.no_grad():
        logits = [model(torch.tensor(PROMPTS[0][:4])[None].expand(2, -1), torch.zeros(2, dtype=torch.int64))]
        for pos in range(4, 8):
            token = naive_sampling.greedy(logits[-1])
            logits.append(model(token[:, None], torch.full((2,), pos)))
        out = {"logits": logits}
        for name, s in (("greedy", GREEDY), ("sampled", SAMPLED), ("unfiltered", UNFILTERED)):
            for sampler, suffix in (("torch", ""), ("triton", "_triton")):
                model.set_kernels({"sampling": sampler}, greedy=s.greedy)
                out[name + suffix] = generate(ReferenceRunner(model, s, 2, TransferLedger()), PROMPTS, NEW).tokens
    torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny model (seed 3) as a checkpoint per expert layout (fused experts, or one tensor per expert and
    part), in several shards."""
    from qmoe.checkpoint.synth import write_checkpoint

    return {
        layout: str(
            write_checkpoint(
                tiny_config(),
                tmp_path_factory.mktemp(layout),
                seed=3,
                dtype=torch.float32,
                expert_layout=layout,
                shard_bytes=200_000,
            )
        )
        for layout in ("fused", "per_expert")
    }


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_sharded_run_equals_one_process(layout, one_process, checkpoints):
    tp, ep, exported, expert_layout = LAYOUTS[layout]
    got = run_ranks(tp, ep, checkpoints[expert_layout], exported)
    assert got["init_mismatch"] == []  # each shard is the slice of the unsharded model with the same seed
    for step, (mine, ref) in enumerate(zip(got["logits"], one_process["logits"])):
        assert rel_err(torch.tensor(mine), ref) < 1e-5, f"logits at step {step}"  # fp32, sums in another order
    assert got["greedy"] == one_process["greedy"]
    assert got["sampled"] == one_process["sampled"]  # Philox-style race keyed by the global token index
    # kernels.sampling=triton: each rank's Triton candidates give the Triton sampler's tokens of one process
    assert got["greedy_triton"] == one_process["greedy_triton"] == one_process["greedy"]
    assert got["sampled_triton"] == one_process["sampled_triton"]
    assert got["unfiltered_triton"] == one_process["unfiltered_triton"]
    W = tp * ep
    assert got["reduced_in_place"] == [W * (W + 1) / 2] * 3  # a module's partial sums: summed in their own memory
    if exported:
        # every block's all-reduce (the mixer's and the MoE block's per layer) reduces in place in the delegate
        assert got["exported_all_reduces"] == [tiny_config().num_hidden_layers * 2] * 2
        assert got["exported_greedy"] == one_process["greedy"]
        assert got["exported_sampled"] == one_process["sampled"]
        assert got["exported_sampled_triton"] == one_process["sampled_triton"]
        assert got["exported_unfiltered_triton"] == one_process["unfiltered_triton"]

    V = 64 * tp * ep
    cases, params = sampler_cases(V)
    assert got["sampler"] == naive_sampling.sample(cases, *params.values()).tolist()
    assert got["sampler_greedy"] == naive_sampling.greedy(cases[:2]).tolist()
    for name, (rows, row_params) in (("cases", (cases, params)), ("llm", llm_cases(V))):
        assert got[f"triton_{name}"] == fused_sampling.sample(rows.float(), *row_params.values()).tolist(), name
        assert got[f"triton_{name}_greedy"] == fused_sampling.greedy(rows.float()).tolist(), name
    # the cuts from each rank's best CANDIDATES logits are the search's, on every row (ties past what ranks send,
    # fewer finite logits than k, non-finite rows), and the tokens one process's Triton sampler draws
    assert got["cuts_candidates"] == got["cuts_searched"]
    rows, row_params = cut_cases(V)
    assert got["triton_cut_cases"] == fused_sampling.sample(rows, *row_params.values()).tolist()

    assert got["load_mismatch"] == []
    assert got["reads_repeated"] == 0
    assert got["bytes_read"] == got["bytes_held"]  # each rank reads its slices and nothing else

    for name in ("greedy", "sampled"):  # the ledger holds exactly the collectives torch.distributed ran
        assert got[f"{name}_ledger"] == got[f"{name}_counted"] != []
    cfg = tiny_config()
    blocks = cfg.num_hidden_layers * (1 + (tp > 1))  # the MoE block's all-reduce, and the mixer's under tp
    per_token = got["greedy_per_token"]
    # decode steps: NEW - 1 per row, plus the 3 steps row 0 waits while row 1 reads its prompt
    steps, tokens = NEW - 1 + 3, (NEW - 1) + NEW  # row 1's first token comes from a decode step
    assert per_token["all_reduce"]["count"] == pytest.approx(blocks * steps / tokens)
    assert per_token["all_reduce"]["bytes"] == pytest.approx(blocks * steps * 2 * cfg.hidden_size * 4 / tokens)
    assert per_token["all_gather"]["count"] == pytest.approx(steps / tokens)  # greedy: one gather of candidates
    # a sampled decode step of the Triton sampler (top-k 20 and top-p in the config): the blocks' all-reduces, two
    # all-gathers, each rank's 20 best logits (+ its ties at the 20th and its max) and its race winner; no search
    W, B, C = tp * ep, 2, min(SAMPLED.top_k, cfg.vocab_size // (tp * ep))
    blocks_bytes = [("all_reduce", B * cfg.hidden_size * 4)] * blocks
    assert got["sampled_triton_decode_collectives"] == sorted(
        [*blocks_bytes, ("all_gather", W * B * (C + 2) * 8), ("all_gather", W * B * 4 * 8)]
    )
    assert got["greedy_triton_decode_collectives"] == sorted([*blocks_bytes, ("all_gather", W * B * 2 * 8)])
    # no filter: the row's max (one all-reduce of B fp32), then the race winners
    assert got["unfiltered_triton_decode_collectives"] == sorted(
        [*blocks_bytes, ("all_reduce", B * 4), ("all_gather", W * B * 4 * 8)]
    )


@pytest.mark.parametrize(
    "top_k,top_p,cuts,name",
    [
        (20, True, "candidates", "top_k=20,top_p"),  # Qwen's recipe: each rank's 20 best logits hold both cuts
        (1024, False, "candidates", "top_k=1024"),
        (1025, True, "search", "top_k=1025,top_p"),  # past CANDIDATES_MAX the all-gather would outgrow the search
        (0, True, "search", "top_p"),  # top-p alone: its cut may lie anywhere in a flat row
        (0, False, "none", "no filter"),  # temperature / min-p alone: the row's max is all the race needs
    ],
)
def test_filters_choose_how_the_cuts_are_found(top_k, top_p, cuts, name):
    from kernels.sampling import triton

    filters = Filters(top_k, top_p)
    assert (filters.cuts, str(filters)) == (cuts, name)
    sharded = build_model(tiny_config(), torch.float32, "meta", seed=None, layout=Layout(2, 1, 0))
    sharded.set_kernels({"sampling": "triton"}, filters=filters)  # the name keys exports and saved programs
    baked = cuts != "search"
    assert sharded.ops["sampling"].__name__ == triton.__name__ + (f"[{name}]" if baked else "")
    sharded.set_kernels({"sampling": "torch"}, filters=filters)  # the torch form always searches
    assert sharded.ops["sampling"] is naive_sampling
    single = build_model(tiny_config(), torch.float32, "meta", seed=None)
    single.set_kernels({"sampling": "triton"}, filters=filters)  # one process: nothing to skip
    assert single.ops["sampling"] is triton


@pytest.mark.parametrize("bracket", ["int32", "float64"])
def test_global_cut_pins_the_cut_in_its_fixed_rounds(bracket):
    # one process (the all-reduces are the identity): the search's fixed rounds find the exact cut of a brute force
    # wherever it lies in the bracket, at both ends too (the widest bracket a round leaves is the last pivot's)
    from qmoe.parallel.sampling import INT32_KEYS, POS_INF_KEY, global_cut, search_rounds

    lo, hi = INT32_KEYS if bracket == "int32" else (-1, POS_INF_KEY)
    assert search_rounds(lo, hi) == (4 if bracket == "int32" else 9)  # 17 at 15 pivots on float64
    gen = torch.Generator().manual_seed(0)
    spots = [lo + 1, lo + 2, hi - 1, hi, (lo + hi) // 2, hi - 2**20, lo + 2**20]
    keys = torch.tensor([spots + torch.randint(lo + 1, hi, (9,), generator=gen).tolist() for _ in range(6)])
    keys[3] = hi - 1 - torch.arange(keys.shape[1])  # a cluster at the top: every round takes the last bracket
    weights = torch.rand(keys.shape, generator=gen, dtype=torch.float64)
    for target_share in (0.05, 0.3, 0.7, 0.999):
        target = weights.sum(-1) * target_share
        got = global_cut(keys, weights, target, lo, hi)
        for b in range(keys.shape[0]):  # the smallest key t (or lo + 1) with the weight above t below target
            cands = sorted({lo + 1, *keys[b].tolist()})
            want = next(t for t in cands if weights[b][keys[b] > t].sum() < target[b])
            assert got[b].item() == want, (b, target_share)


def test_layout_replicates_heads_beyond_tp():
    """tp = 4 over 2 kv heads: ranks 0, 1 hold head 0 and ranks 2, 3 head 1 (their q heads' GQA group)."""
    assert [Layout(4, 1, r).heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [Layout(2, 1, r).heads(4) for r in range(2)] == [(0, 2), (2, 2)]
    assert [Layout(2, 2, r).experts(8) for r in range(4)] == [(0, 4), (0, 4), (4, 4), (4, 4)]


@pytest.mark.parametrize(
    "tp,ep,key",
    [
        (3, 1, "model.arch.num_attention_heads: 4 is not divisible by parallel.tp=3"),
        (1, 3, "model.arch.num_experts: 8 is not divisible by parallel.ep=3"),
        (8, 1, "model.arch.num_attention_heads: 4 is not divisible by parallel.tp=8"),
    ],
    ids=["tp3", "ep3", "tp8"],
)
def test_layout_error_names_the_dimension(tp, ep, key):
    from helpers import TINY_ARCH

    assert layout_errors(TINY_ARCH, tp, ep)[0] == key


# the tiny model with every row-parallel K split on the fp8 scale blocks at tp = 2 (fp8_layout_errors): o_proj and
# out_proj 256 columns, the experts' and the shared expert's down 256
FP8_TP_ARCH = dict(
    head_dim=64, linear_value_head_dim=64, moe_intermediate_size=256, shared_expert_intermediate_size=256
)


def fp8_rank_checks(rank: int, tp: int, ep: int, moe: str, port: int, queue) -> None:
    """One rank of the FP8 model at tp x ep: its FP8 shards against the slices of the unsharded FP8 model, its
    greedy tokens with the `moe` kernels."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp * ep), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    from qmoe import parallel
    from qmoe.model import fp8_weight_names

    cfg = tiny_config(**FP8_TP_ARCH)
    fp8 = fp8_weight_names(cfg, "fp8")
    layout = parallel.init(tp, ep, "cpu")
    full = dict(build_model(cfg, torch.float32, "cpu", seed=0, fp8=fp8).named_parameters())
    model = build_model(cfg, torch.float32, "cpu", seed=0, fp8=fp8, layout=layout)
    specs, params = model.shard_specs(), dict(model.named_parameters())
    out = {"fp8_sharded": sorted(n for n in fp8 if n in specs and params[n].dtype == torch.float8_e4m3fn)}
    out["mismatch"] = slice_mismatches(model, full)
    model.setup_caches(2, 32)
    model.set_kernels({"moe": moe})
    out["greedy"] = generate(ReferenceRunner(model, GREEDY, 2, TransferLedger()), PROMPTS, NEW).tokens
    queue.put(out if rank == 0 else None)
    parallel.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,moe", [(2, 1, "torch"), (1, 2, "torch"), (1, 2, "triton")])
def test_fp8_sharded_equals_one_process(tp, ep, moe):
    # model.weights=fp8 at tp = 2 or ep = 2 (random weights): each rank holds exactly its slice of the unsharded FP8
    # model, scales included (expert parallel: whole experts and their scales), and greedy-decodes the same tokens
    # as one process with it; ep also on the Triton MoE kernels (CPU interpreter, a minute)
    from qmoe.model import fp8_weight_names

    cfg = tiny_config(**FP8_TP_ARCH)
    one = build_model(cfg, torch.float32, "cpu", seed=0, fp8=fp8_weight_names(cfg, "fp8"))
    one.setup_caches(2, 32)
    with torch.no_grad():
        expected = generate(ReferenceRunner(one, GREEDY, 2, TransferLedger()), PROMPTS, NEW).tokens
    got = spawn_ranks(fp8_rank_checks, tp * ep, tp, ep, moe)
    assert len(got["fp8_sharded"]) > 0  # the layout shards fp8 tensors (tp: rows and K columns; ep: experts)
    assert got["mismatch"] == []
    assert got["greedy"] == expected


def fp8_checkpoint_rank_checks(rank: int, tp: int, ep: int, path: str, weights: str, port: int, queue) -> None:
    """One rank's sharded load of an FP8 (or, with weights=fp8, a dense) checkpoint: its parameters against the
    slices of the model one process loads, the bytes it reads, its greedy tokens."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp * ep), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    from qmoe import parallel
    from qmoe.checkpoint import loader

    layout = parallel.init(tp, ep, "cpu")
    full, _ = loader.load_checkpoint(path, dtype=torch.float32, device="cpu", weights=weights)
    model, info, (repeated, nbytes) = load_counting_reads(path, weights=weights, layout=layout)
    params = dict(model.named_parameters())
    out = {"quantization": info.quantization, "mismatch": slice_mismatches(model, dict(full.named_parameters()))}
    specs = model.shard_specs()
    out["fp8_sharded"] = sorted(n for n, p in params.items() if p.dtype == torch.float8_e4m3fn and n in specs)
    out["reads_repeated"], out["bytes_read"] = repeated, nbytes  # the weights' slices, in their stored dtype
    stored_fp8 = loader._checked_plan(Path(path), model.config, torch.float32)[0].stored_fp8
    out["bytes_stored"] = sum(  # what the rank's slices take in the checkpoint's dtypes (fp8, else fp32)
        p.numel() * (1 if n in stored_fp8 else 4) for n, p in params.items() if not n.endswith("_scale")
    )
    model.setup_caches(2, 32)
    out["greedy"] = generate(ReferenceRunner(model, GREEDY, 2, TransferLedger()), PROMPTS, NEW).tokens
    queue.put(out if rank == 0 else None)
    parallel.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,ep,quant,weights,experts",
    [
        (2, 1, "fp8_block", "auto", "fused"),  # Qwen's block format held in fp8: rows and K columns with their scales
        (2, 1, "fp8_block", "auto", "per_expert"),  # each expert's gate / up / down tensor and scale, K split
        (1, 2, "fp8_channel", "auto", "per_expert"),  # compressed-tensors per channel, whole experts per rank
        (2, 1, "fp8_block", "dense", "fused"),  # fp8 slices dequantized on load
        (2, 1, "none", "fp8", "fused"),  # a dense checkpoint quantized on load, slice by slice
    ],
    ids=["tp2-block", "tp2-block-per-expert", "ep2-channel", "tp2-block-dense", "tp2-dense-to-fp8"],
)
def test_sharded_fp8_checkpoint_load_equals_one_process(tmp_path, tp, ep, quant, weights, experts):
    # each rank reads only its slices of the memory-mapped tensors (each once) and holds exactly the slices of the
    # model one process loads from the same checkpoint, fp8 values and scales included; greedy tokens equal
    from qmoe.checkpoint import load_checkpoint, write_checkpoint

    cfg = tiny_config(**FP8_TP_ARCH)
    path = write_checkpoint(
        cfg, tmp_path / quant, seed=4, dtype=torch.float32, quant=quant, expert_layout=experts, shard_bytes=300_000
    )
    one, _ = load_checkpoint(path, dtype=torch.float32, device="cpu", weights=weights)
    one.setup_caches(2, 32)
    with torch.no_grad():
        expected = generate(ReferenceRunner(one, GREEDY, 2, TransferLedger()), PROMPTS, NEW).tokens
    got = spawn_ranks(fp8_checkpoint_rank_checks, tp * ep, tp, ep, str(path), weights)
    assert got["mismatch"] == []
    assert (len(got["fp8_sharded"]) > 0) == (weights != "dense"), got["quantization"]
    assert got["reads_repeated"] == 0
    assert got["bytes_read"] == got["bytes_stored"]  # the slices and nothing else (the scales, read whole, aside)
    assert got["greedy"] == expected


def test_sharded_fp8_checkpoint_off_the_scale_blocks_is_one_line(tmp_path):
    # the tiny model's o_proj K (4 heads x 32) split in two is 64 columns: half a scale block per rank
    from qmoe.checkpoint import CheckpointError, load_checkpoint, write_checkpoint
    from qmoe.parallel.layout import Layout

    path = write_checkpoint(tiny_config(), tmp_path / "ckpt", seed=4, dtype=torch.float32, quant="fp8_block")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, dtype=torch.float32, device="cpu", layout=Layout(2, 1, 0))
    assert str(e.value) == f"{path}: " + fp8_layout_errors(tiny_config().to_dict(), 2, 1)[0]


@pytest.mark.parametrize(
    "model,tp,first_error",
    [
        ("qwen35_moe_397b", 4, None),  # the 397B FP8 run of the multi-GPU issues: every K split on the blocks
        ("qwen35_moe_122b", 8, None),
        ("qwen35_moe", 4, None),
        ("qwen35_moe", 8, "model.arch.moe_intermediate_size: fp8 needs each rank's share of the 512 columns"),
    ],
)
def test_fp8_layouts_of_the_real_models(model, tp, first_error):
    import yaml

    arch = yaml.safe_load((ROOT / f"configs/model/{model}.yaml").read_text())["arch"]
    errors = fp8_layout_errors(arch, tp, 1)
    if first_error is None:
        assert errors == []
    else:
        assert errors and errors[0].startswith(first_error), errors


@pytest.mark.parametrize("tp,ep,dtype", [(8, 1, torch.bfloat16), (4, 2, torch.bfloat16), (2, 1, torch.bfloat16)])
def test_397b_layouts_split_and_fit(tp, ep, dtype):
    """The 397B-A17B runs of the multi-GPU issues: its dimensions split at these layouts, and a rank's shard of the
    weights (meta model: nothing allocated) fits an H200's 139 GiB at tp x ep = 8, not at 2."""
    from omegaconf import OmegaConf

    from qmoe.model import ModelConfig
    from qmoe.model.qwen35_moe import weight_nbytes

    arch = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "configs/model/qwen35_moe_397b.yaml").arch)
    assert layout_errors(arch, tp, ep) == []
    per_rank = weight_nbytes(ModelConfig.from_dict(arch), dtype) / (tp * ep)
    assert (per_rank < 139 * 2**30) == (tp * ep >= 8), per_rank / 2**30


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["parallel.tp=2", "runtime=host"], "runtime: host samples full logits on the CPU"),
        (
            ["parallel.tp=2", "model.arch.num_key_value_heads=3", "model.arch.num_attention_heads=6"],
            "model.arch.num_key_value_heads: 3 is not divisible by parallel.tp=2, nor parallel.tp by it",
        ),
        (["parallel.tp=0"], "parallel.tp: must be >= 1"),
        (["parallel.tp=2", "model.weights=fp8"], "model.arch.head_dim: fp8 needs each rank's share of the 128"),
    ],
    ids=["host", "kv_heads", "tp0", "fp8_k_split"],
)
def test_parallel_settings_are_one_line(overrides, line, monkeypatch):
    """Under torchrun (WORLD_SIZE=2) the config says in one line what has no sharded path."""
    from compose import compose_config

    from qmoe.settings import ConfigError, validate

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        validate(compose_config("logger=none", *overrides))
    assert str(e.value).startswith(line), str(e.value)


def cli(args, env=None, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_parallel_without_torchrun_is_one_line():
    p = cli([sys.executable, "run.py", "parallel.tp=2", "logger=none"])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("error: parallel: tp x ep = 2 x 1 = 2 processes, but 1 run"), lines[0]


def torchrun(n: int, *args, timeout=180):
    port = free_port()
    return cli(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={port}", *args],
        timeout=timeout,
    )


def test_wrong_world_size_is_one_line_from_rank_0(tmp_path):
    p = torchrun(2, "run.py", "parallel.tp=4", "logger=none", f"hydra.run.dir={tmp_path}/run")
    ours = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0
    assert ours == [
        "error: parallel: tp x ep = 4 x 1 = 4 processes, but 2 run (torchrun --nproc-per-node 4, "
        "or set parallel.tp / parallel.ep to match)"
    ], p.stderr
    assert "exitcode  : 2" in p.stderr  # rank 0's exit code, as torchrun reports it
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_expert_parallel_on_the_triton_moe_equals_one_process(tmp_path):
    # each rank's Triton MoE kernels (CPU interpreter) hold half the experts: a batch of 2 (prefill and decode on the
    # aligned grouped path) and a batch of 1 (decode on the GEMV kernels) generate one process's greedy tokens
    for batch in (2, 1):
        common = ["logger=none", "kernels.moe=triton", "generation.max_new_tokens=4", f"generation.batch_size={batch}"]
        one = cli([sys.executable, "run.py", *common, f"hydra.run.dir={tmp_path}/one{batch}"], timeout=300)
        assert one.returncode == 0, one.stderr
        two = torchrun(2, "run.py", "parallel.ep=2", *common, f"hydra.run.dir={tmp_path}/ep{batch}", timeout=300)
        assert two.returncode == 0, two.stderr
        tokens = [json.loads((tmp_path / f"{r}{batch}/results.json").read_text())["generated"]["token_ids"]
                  for r in ("one", "ep")]  # fmt: skip
        assert tokens[0] == tokens[1] and len(tokens[0]) == batch, tokens


@pytest.mark.slow
def test_tensor_parallel_on_every_triton_kernel_samples_one_process_tokens(tmp_path):
    # kernels=triton at tp = 2 (CPU interpreter): every op group's Triton kernel on its shard, the sampler's
    # vocab-parallel form with every filter on, gives one process's sampled tokens
    common = ["logger=none", "kernels=triton", "generation.max_new_tokens=4", "sampling.temperature=0.8",
              "sampling.top_k=20", "sampling.top_p=0.9", "sampling.min_p=0.02"]  # fmt: skip
    one = cli([sys.executable, "run.py", *common, f"hydra.run.dir={tmp_path}/one"], timeout=300)
    assert one.returncode == 0, one.stderr
    two = torchrun(2, "run.py", "parallel.tp=2", *common, f"hydra.run.dir={tmp_path}/tp", timeout=300)
    assert two.returncode == 0, two.stderr
    docs = [json.loads((tmp_path / f"{r}/results.json").read_text()) for r in ("one", "tp")]
    assert docs[1]["config"]["kernels"]["sampling"] == "triton"
    assert docs[0]["generated"]["token_ids"] == docs[1]["generated"]["token_ids"]


FAILING_RANK = """
import os, runpy, sys
sys.path.insert(0, {root!r})
if os.environ["RANK"] == "1":  # rank 1 fails in its third decode step, while rank 0 waits in an all-reduce
    from qmoe.runtime import generate
    step = generate.ReferenceRunner.step
    def failing_step(self, forced):
        if self.decode_steps >= 2:
            raise RuntimeError("disk on fire")
        return step(self, forced)
    generate.ReferenceRunner.step = failing_step
sys.argv[0] = os.path.join({root!r}, "run.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_failing_rank_stops_every_rank_with_one_line(tmp_path):
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK.format(root=str(ROOT)))
    p = torchrun(2, str(script), "parallel.tp=2", "logger=none", f"hydra.run.dir={tmp_path}/run", timeout=120)
    ours = [line for line in p.stderr.splitlines() if line.startswith("rank ")]
    assert p.returncode != 0
    assert ours == ["rank 1: error: RuntimeError: disk on fire"], p.stderr
    assert "qmoe" not in "".join(line for line in p.stderr.splitlines() if line.startswith("  File"))  # no rank's
    assert not (tmp_path / "run" / "results.json").exists()


def test_captured_collectives_are_recorded_once_per_replay():
    """A CUDA-graph capture launches nothing: its collectives are recorded by each replay (graphs.py), not twice."""
    from qmoe.parallel import collectives

    ledger = TransferLedger().at("decode", 1)
    with collectives.recording(ledger, "decode"):
        with collectives.capturing() as captured:
            collectives.record("all_reduce", 4096, "tp")
        assert ledger.collectives == []
        for _ in range(3):
            collectives.replayed(captured)
    assert [(c.kind, c.nbytes, c.method, c.group) for c in ledger.collectives] == [
        ("all_reduce", 4096, "decode", "tp")
    ] * 3


@pytest.mark.slow
def test_bench_tp_layouts_row_runs_both_layouts(tmp_path):
    # bench_tp's layouts row (its --smoke: gloo, the tiny model): TP and EP at batch 1 and 32, each run in the
    # layout it names (EP has no mixer all-reduce: fewer per token), and the faster of the two per batch
    out = tmp_path / "bench_tp.json"
    p = torchrun(2, "experiments/bench_tp.py", "--smoke", "--rows", "layouts", "--new-tokens", "3", "--out", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    rows = {r["label"]: r for r in doc["rows"]}
    assert sorted(rows) == ["35b_ep2_b1", "35b_ep2_b32", "35b_tp2_b1", "35b_tp2_b32"]
    for label, r in rows.items():
        tp, ep = (2, 1) if "_tp2_" in label else (1, 2)
        assert r["config"]["parallel"] == {"tp": tp, "ep": ep} and r["batch"] == int(label.split("_b")[-1])
    for batch in (1, 32):
        tp_ar, ep_ar = (
            rows[f"35b_{n}2_b{batch}"]["inter_gpu_per_decode_token"]["all_reduce"]["count"] for n in ("tp", "ep")
        )
        assert ep_ar < tp_ar
    assert set(doc["layouts_fastest"]) == {"batch 1", "batch 32"}
    assert set(doc["layouts_fastest"].values()) <= {"tp", "ep"}
