"""Would a persistent decode kernel beat the PDL launch chain? A measurement before the design (issue #12, item 4).

A chain of P dependent GEMVs, x_{p+1} = W_p @ x_p (N = K, bf16, fp32 accumulation), run two ways:
  pdl:        P kernels back to back in a CUDA graph with Programmatic Dependent Launch, the decode loop's design:
              every program loads its [BLOCK_N, K] weight tile before it waits for the previous kernel.
  persistent: one kernel of G co-resident programs. Each program walks its tiles of phase 0, 1, ... P - 1 with the
              next tile's load issued before the current tile's math, so the first tile of phase p + 1 is in flight
              while the program arrives at the grid barrier after phase p and waits there for the other programs.
Also the bare costs: an empty PDL kernel in a graph, and a grid barrier with no work (per barrier).

The barrier: every program, after its stores, arrives with one release atomic on a counter; before it reads phase
p's input it spins (acquire atomics) until the counter reaches p * G. Spinning is safe only if all G programs are
resident at once: G is capped by the compiled kernel's occupancy (registers, warps, shared memory) times the SM
count. Spins are bounded (SPIN_LIMIT): a hang becomes a flagged, wrong result instead.

    PYTHONPATH=. python experiments/probe_grid_barrier.py [--out results/probe_grid_barrier.json]
"""

import argparse

import torch
import triton
import triton.language as tl
from benchlib import time_calls, write_json

from kernels.pdl import allow_dependents, pdl, wait_for_producers

SPIN_LIMIT = 1 << 18  # ~0.3 s of spinning per barrier at most


@triton.jit
def _arrive(counter_ptr):
    tl.debug_barrier()  # every thread's stores of this phase are issued before the release
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(counter_ptr, target, flag_ptr, SPIN_LIMIT: tl.constexpr):
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < SPIN_LIMIT):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if spins >= SPIN_LIMIT:
        tl.atomic_add(flag_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _gemv_pdl_kernel(w_ptr, x_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, K)
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=(rows < N)[:, None] & (cols < K)[None, :])
    wait_for_producers(PDL)
    x = tl.load(x_ptr + cols)
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _tile(w_ptr, phase, tile, N, K: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N  # a tile past the last one (tile >= n_tiles) has rows >= N
    cols = tl.arange(0, K)
    ptrs = w_ptr + (phase * N).to(tl.int64) * K + rows[:, None].to(tl.int64) * K + cols[None, :]
    return tl.load(ptrs, mask=ok[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _gemv_persistent_kernel(w_ptr, xs_ptr, counter_ptr, flag_ptr, N, P, G, n_tiles, T,
                            K: tl.constexpr, BLOCK_N: tl.constexpr, SPIN_LIMIT: tl.constexpr):  # fmt: skip
    """Phases p = 0..P-1: xs[p + 1] = W[p] @ xs[p]; this program owns tiles pid, pid + G, ... (T of them)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, K)
    w = _tile(w_ptr, pid * 0, pid, N, K, BLOCK_N)
    for p in range(P):
        if p > 0:
            _wait(counter_ptr, p * G, flag_ptr, SPIN_LIMIT)
        x = tl.load(xs_ptr + p * K + cols, cache_modifier=".cg").to(tl.float32)
        for j in range(T):
            last = j == T - 1
            nxt_phase = tl.where(last, tl.minimum(p + 1, P - 1), p)
            nxt_tile = pid + tl.where(last, 0, j + 1) * G
            w_next = _tile(w_ptr, nxt_phase, nxt_tile, N, K, BLOCK_N)  # in flight across the barrier
            rows = (pid + j * G) * BLOCK_N + tl.arange(0, BLOCK_N)
            y = tl.sum(w.to(tl.float32) * x[None, :], 1)
            tl.store(xs_ptr + (p + 1) * K + rows, y.to(xs_ptr.dtype.element_ty), mask=rows < N)
            w = w_next
        _arrive(counter_ptr)


@triton.jit
def _barriers_kernel(counter_ptr, flag_ptr, P, G, SPIN_LIMIT: tl.constexpr):
    for p in range(1, P + 1):
        _arrive(counter_ptr)
        _wait(counter_ptr, p * G, flag_ptr, SPIN_LIMIT)


@triton.jit
def _empty_pdl_kernel(x_ptr, PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_producers(PDL)


def resident_programs(compiled, num_warps: int, props) -> int:
    """How many programs of this compiled kernel one SM holds at once (registers, warps, shared memory)."""
    regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
    by_regs = props.regs_per_multiprocessor // (regs_per_warp * num_warps)
    by_warps = props.max_threads_per_multi_processor // (32 * num_warps)
    smem = compiled.metadata.shared + 1024
    by_smem = props.shared_memory_per_multiprocessor // smem if smem else 32
    return max(0, min(by_regs, by_warps, by_smem, 32))


def graph_us(fn, reps=20) -> float:
    """µs of one CUDA-graph replay of fn() (benchlib's capture and timing)."""
    return time_calls(lambda _: fn(), 1, "cuda", reps)[0]


def chain(N: int, P: int, block_n: int, props, rotate: int = 3) -> dict:
    dev = "cuda"
    K = N
    gen = torch.Generator(device=dev).manual_seed(0)
    # rotate weight sets past L2 (50 MB): each replay reads fresh HBM
    ws = [torch.randn(P, N, K, device=dev, generator=gen).mul_(K**-0.5).bfloat16() for _ in range(rotate)]
    x0 = torch.randn(K, device=dev, generator=gen).bfloat16()
    xs_pdl = torch.zeros(P + 1, K, device=dev, dtype=torch.bfloat16)
    xs_per = torch.zeros_like(xs_pdl)
    counter = torch.zeros(1, device=dev, dtype=torch.int32)
    flag = torch.zeros(1, device=dev, dtype=torch.int32)
    n_tiles = triton.cdiv(N, block_n)
    on = pdl(x0)
    warps = 4
    compiled = _gemv_persistent_kernel.warmup(
        ws[0], xs_per, counter, flag, N, P, 1, n_tiles, n_tiles, K=K, BLOCK_N=block_n, SPIN_LIMIT=SPIN_LIMIT,
        num_warps=warps, grid=(1,),
    )  # fmt: skip
    compiled._init_handles()  # loads the module: n_regs / n_spills are set here
    per_sm = resident_programs(compiled, warps, props)
    G = min(n_tiles, per_sm * props.multi_processor_count)
    T = triton.cdiv(n_tiles, G)
    state = {"i": 0}

    def run_pdl():
        w = ws[state["i"] % rotate]
        xs_pdl[0].copy_(x0)
        for p in range(P):
            _gemv_pdl_kernel[(n_tiles,)](w[p], xs_pdl[p], xs_pdl[p + 1], N, K=K, BLOCK_N=block_n, PDL=on,
                                         launch_pdl=on, num_warps=warps)  # fmt: skip

    def run_persistent():
        w = ws[state["i"] % rotate]
        xs_per[0].copy_(x0)
        counter.zero_()
        _gemv_persistent_kernel[(G,)](w, xs_per, counter, flag, N, P, G, n_tiles, T, K=K, BLOCK_N=block_n,
                                      SPIN_LIMIT=SPIN_LIMIT, num_warps=warps)  # fmt: skip

    # correctness first: both against a torch chain with the same per-phase rounding
    run_pdl()
    run_persistent()
    torch.cuda.synchronize()
    ref = x0.float()
    for p in range(P):
        ref = (ws[0][p].float() @ ref).bfloat16().float()
    err_pdl = ((xs_pdl[P].float() - ref).abs().max() / ref.abs().max()).item()
    err_per = ((xs_per[P].float() - ref).abs().max() / ref.abs().max()).item()
    same = torch.equal(xs_pdl, xs_per)
    count_ok = counter.item() == P * G

    def rotated(fn):
        def call():
            for i in range(rotate):
                state["i"] = i
                fn()

        return call

    pdl_us = graph_us(rotated(run_pdl)) / rotate
    per_us = graph_us(rotated(run_persistent)) / rotate
    nbytes = P * N * K * 2
    return dict(
        N=N, K=K, P=P, BLOCK_N=block_n, programs=G, tiles_per_program=T, resident_per_sm=per_sm,
        n_regs=compiled.n_regs, n_spills=compiled.n_spills, pdl_us=pdl_us, persistent_us=per_us,
        pdl_gbs=nbytes / pdl_us / 1e3, persistent_gbs=nbytes / per_us / 1e3,
        pdl_us_per_phase=pdl_us / P, persistent_us_per_phase=per_us / P,
        rel_err_pdl=err_pdl, rel_err_persistent=err_per, bit_identical=same, counter_ok=count_ok,
        spin_limit_hit=flag.item(),
    )  # fmt: skip


def bare_costs(props) -> dict:
    dev = "cuda"
    x = torch.zeros(1, device=dev)
    on = pdl(x)
    launches = 200

    def empties():
        for _ in range(launches):
            _empty_pdl_kernel[(props.multi_processor_count,)](x, PDL=on, launch_pdl=on, num_warps=4)

    empty_us = graph_us(empties) / launches
    counter = torch.zeros(1, device=dev, dtype=torch.int32)
    flag = torch.zeros(1, device=dev, dtype=torch.int32)
    out = dict(empty_pdl_launch_us=empty_us, barrier_us={})
    for G in (props.multi_processor_count, 2 * props.multi_processor_count, 4 * props.multi_processor_count):

        def barriers(G=G):
            counter.zero_()
            _barriers_kernel[(G,)](counter, flag, launches, G, SPIN_LIMIT=SPIN_LIMIT, num_warps=4)

        out["barrier_us"][G] = graph_us(barriers) / launches
    out["spin_limit_hit"] = flag.item()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/probe_grid_barrier.json")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    bare = bare_costs(props)
    rows = [chain(N, 40, bn, props) for N, bn in ((2048, 2), (2048, 4), (4096, 2), (4096, 4))]
    write_json(args.out, "probe_grid_barrier", "cuda", bare=bare, rows=rows)
    print(f"empty PDL launch in a graph: {bare['empty_pdl_launch_us']:.2f} us; grid barrier (programs: us) "
          + ", ".join(f"{g}: {us:.2f}" for g, us in bare["barrier_us"].items()))  # fmt: skip
    print(f"{'N=K':>5} {'BN':>3} {'G':>5} {'T':>3} {'regs':>4} {'pdl us/phase':>13} {'persistent':>11} "
          f"{'pdl GB/s':>9} {'pers GB/s':>9} ok")  # fmt: skip
    for r in rows:
        ok = r["counter_ok"] and r["bit_identical"] and not r["spin_limit_hit"] and r["rel_err_pdl"] < 2e-2
        print(f"{r['N']:>5} {r['BLOCK_N']:>3} {r['programs']:>5} {r['tiles_per_program']:>3} {r['n_regs']:>4} "
              f"{r['pdl_us_per_phase']:>13.2f} {r['persistent_us_per_phase']:>11.2f} {r['pdl_gbs']:>9.0f} "
              f"{r['persistent_gbs']:>9.0f} {ok}")  # fmt: skip


if __name__ == "__main__":
    main()
