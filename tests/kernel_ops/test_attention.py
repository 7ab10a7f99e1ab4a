"""Triton gated attention (kernels/attention/triton.py) against the PyTorch reference (kernels/attention/naive.py).

Inputs are what the model passes: q, gate, k, v as strided views of one fused projection output (query and gate
interleaved per head), caches with garbage past each row's context. Outputs and the split-K workspace are
NaN-poisoned; the reference runs in fp32 on copies and errors are relative, in float64.
"""

import pytest
import torch

from kernels.attention import naive
from kernels.attention import triton as tri
from qmoe.model import build_model
from tests.helpers import captured, poisoned, rel_err, tiny_config

EPS = 1e-6
# norm + RoPE round once where naive rounds after each op; decode attention casts p to the model dtype
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_inv_freq(rot: int, device) -> torch.Tensor:
    return 1.0 / (1e7 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))


def make_layer(B, T, HQ, HKV, D, R, S, starts, dtype, device, seed=0) -> dict:
    """gated_attention's tensor arguments: q, gate [B, T, HQ, D] and k, v [B, T, HKV, D] are views of one
    [B, T, 2*HQ*D + 2*HKV*D] tensor (rows that far apart, q and gate 2*D apart per head), random caches of S
    slots, positions starts[b] + t, RoPE on the first R dims."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)
    qg, k, v = randn(B, T, 2 * HQ * D + 2 * HKV * D).split([2 * HQ * D, HKV * D, HKV * D], dim=-1)
    q, gate = qg.view(B, T, HQ, 2 * D).chunk(2, dim=-1)
    k_cache, v_cache = randn(B, HKV, S, D), randn(B, HKV, S, D)
    return dict(
        q=q, gate=gate, k=k.view(B, T, HKV, D), v=v.view(B, T, HKV, D),
        q_weight=0.1 * randn(D), k_weight=0.1 * randn(D), k_cache=k_cache, v_cache=v_cache,
        positions=torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device),
        inv_freq=make_inv_freq(R, device),
    )  # fmt: skip


def reference(x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """naive.gated_attention in fp32 on copies -> (out, k_cache, v_cache after the write)."""
    f = {k: v.float().clone() if v.is_floating_point() else v for k, v in x.items()}
    out = naive.gated_attention(**f, eps=EPS, scale=x["q"].shape[-1] ** -0.5)
    return out, f["k_cache"], f["v_cache"]


def check_caches(x: dict, before: tuple, k_ref: torch.Tensor, v_ref: torch.Tensor, dtype) -> None:
    """Slots at the new positions hold the reference's k (normed, roped) and v; every other slot is untouched."""
    B, HKV, S, _ = x["k_cache"].shape
    written = torch.zeros(B, HKV, S, dtype=torch.bool, device=x["k_cache"].device)
    written[torch.arange(B)[:, None], :, x["positions"]] = True
    for cache, old, ref in ((x["k_cache"], before[0], k_ref), (x["v_cache"], before[1], v_ref)):
        assert torch.equal(cache[~written], old[~written])
        assert rel_err(cache[written], ref[written]) < TOL[dtype]
    assert torch.equal(x["v_cache"][written].float(), v_ref[written])  # v is copied, not computed


def check_decode(B, HQ, HKV, D, R, S, positions, splits, dtype, device, options=None):
    x = make_layer(B, 1, HQ, HKV, D, R, S, positions, dtype, device, seed=sum(positions) + splits)
    ref, k_ref, v_ref = reference(x)
    before = x["k_cache"].clone(), x["v_cache"].clone()
    out = poisoned(B, 1, HQ * D, dtype=dtype, device=device)
    o_part, lse_part = poisoned(B, HQ, splits, D, device=device), poisoned(B, HQ, splits, device=device)
    tri.decode_attention_into(**x, eps=EPS, scale=D**-0.5, out=out, o_part=o_part, lse_part=lse_part, options=options)
    assert rel_err(out, ref) < TOL[dtype]
    check_caches(x, before, k_ref, v_ref, dtype)
    assert not tri.split_arrivals(B * HKV, torch.device(device)).any()  # the last split reset every counter


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "context, splits",
    [
        (1, 4),  # one key: one active split, three empty ones that still arrive
        (64, 1),  # exactly one tile, no split-K: the only split merges itself
        (65, 4),  # one key into the second tile
        (500, 4),  # two tiles per split, the last split partial
        (500, 16),  # more splits than tiles (empty splits) and one tile each
    ],
)
def test_decode_attention(context, splits, dtype):
    # batch 3: one row at `context`, the others at shorter contexts, so rows use different split ranges
    check_decode(3, 4, 2, 32, 8, 512, [context - 1, context // 2, 0], splits, dtype, "cpu")


@pytest.mark.parametrize("context", [1, 65, 500])
def test_decode_attention_35b_heads(context):
    """35B-A3B heads (group of 8 q heads, head dim 256, rotary 64), batch 1, the split count the model gets."""
    splits = tri.num_splits(1, 2, 512, torch.device("cpu"))
    check_decode(1, 16, 2, 256, 64, 512, [context - 1], splits, torch.float32, "cpu")


def test_decode_merge_in_several_steps():
    """More active splits than the merge takes per step (REDUCE_S): the last split loops over partial tiles."""
    config = tri._decode_config(8, 256, 64, torch.float32)
    assert config["REDUCE_S"] < 64
    check_decode(1, 16, 2, 256, 64, 64 * 64, [64 * 64 - 1], 64, torch.float32, "cpu")


def test_decode_rope_angles_need_range_reduction():
    """Rows at positions 70000 and 200000: RoPE angles of ~1e5 rad, exact only with the Cody-Waite reduction.
    2048-key tiles: the interpreter steps over the 200k keys in 25 tiles per split instead of 782 (71 s -> a few)."""
    check_decode(2, 4, 2, 32, 16, 200_064, [70_000, 200_000], 4, torch.float32, "cpu", options={"BLOCK_N": 2048})


def check_prefill(B, T, HQ, HKV, D, R, S, starts, dtype, device):
    x = make_layer(B, T, HQ, HKV, D, R, S, starts, dtype, device, seed=T + D)
    ref, k_ref, v_ref = reference(x)
    q, k, q_w, k_w = (x[n].float() for n in ("q", "k", "q_weight", "k_weight"))
    q_ref, _ = naive.qk_norm_rope(q, k, q_w, k_w, x["positions"], x["inv_freq"], EPS)
    before = x["k_cache"].clone(), x["v_cache"].clone()
    out, q_normed = (
        poisoned(B, T, HQ * D, dtype=dtype, device=device),
        poisoned(B, T, HQ, D, dtype=dtype, device=device),
    )
    tri.prefill_attention_into(**x, eps=EPS, scale=D**-0.5, out=out, q_normed=q_normed)
    assert rel_err(q_normed, q_ref) < TOL[dtype]
    assert rel_err(out, ref) < TOL[dtype]
    check_caches(x, before, k_ref, v_ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "B, T, starts",
    [
        (1, 65, [0]),  # a prompt from position 0, one query block plus a 1-token tail block
        (2, 17, [0, 100]),  # batch 2 rows continuing earlier context, T < BLOCK_M, a 1-token norm-rope tail
        (3, 5, [0, 1000, 3000]),  # batch 3 rows far apart (angles in the thousands of rad)
    ],
)
def test_prefill_attention(B, T, starts, dtype):
    check_prefill(B, T, 4, 2, 32, 16, 3008, starts, dtype, "cpu")


def test_prefill_attention_35b_heads():
    """35B-A3B heads: 8 q heads per kv head, head dim 256, rotary 64."""
    check_prefill(1, 20, 16, 2, 256, 64, 64, [30], torch.float32, "cpu")


def test_odd_head_dim():
    """Head dim 72 (not a power of 2: masked tail of the head block), 3 q heads per kv head, R/2 = 12."""
    check_decode(2, 6, 2, 72, 24, 160, [100, 7], 4, torch.float32, "cpu")
    check_prefill(2, 9, 6, 2, 72, 24, 160, [0, 50], torch.float32, "cpu")


def test_mha_one_q_head_per_kv_head():
    check_decode(1, 6, 6, 32, 8, 96, [40], 2, torch.float32, "cpu")
    check_prefill(1, 3, 6, 6, 32, 8, 96, [9], torch.float32, "cpu")


@pytest.mark.parametrize("T", [1, 5])
def test_public_op_eager_and_custom_op(T):
    """gated_attention() dispatches T == 1 to the decode kernel and T > 1 to the prefill kernels; eager launches
    directly, and the custom op (what kernels.tracing() selects) returns the same."""
    x = make_layer(3, T, 4, 2, 32, 8, 160, [0, 30, 90], torch.float32, "cpu", seed=T)
    ref, k_ref, _ = reference(x)
    x2 = {k: v.clone() for k, v in x.items()}
    out = tri.gated_attention(**x, eps=EPS, scale=32**-0.5)
    assert rel_err(out, ref) < TOL[torch.float32] and rel_err(x["k_cache"], k_ref) < TOL[torch.float32]
    out_op = tri._gated_attention_op(**x2, eps=EPS, scale=32**-0.5)
    assert torch.equal(out_op, out) and torch.equal(x2["k_cache"], x["k_cache"])


@pytest.mark.parametrize(
    "options", [{"splits": 1}, {"splits": 3, "num_warps": 2}], ids=["one split", "3 splits, 2 warps"]
)
def test_decode_options_override_the_launch(monkeypatch, options):
    """DECODE_OPTIONS (what tune_decode_loop tries in the step) replace num_splits()' split count (seen in the
    workspace the launch allocates) and the launch options; the op stays right."""
    x = make_layer(2, 1, 4, 2, 32, 8, 160, [0, 90], torch.float32, "cpu", seed=7)
    ref, _, _ = reference(x)
    monkeypatch.setattr(tri, "DECODE_OPTIONS", options)
    seen = []
    real = tri.decode_attention_into
    monkeypatch.setattr(tri, "decode_attention_into", lambda *a, **kw: seen.append(a[-1].shape[2]) or real(*a, **kw))
    out = tri.gated_attention(**x, eps=EPS, scale=32**-0.5)
    assert seen == [options["splits"]] and rel_err(out, ref) < TOL[torch.float32]


def test_arrival_counters_are_per_size_and_kept():
    """One counter buffer per (device, size), the same object on every call (a captured CUDA graph keeps its
    pointer), and back at zero after a decode call at either size."""
    cpu = torch.device("cpu")
    for B in (1, 3, 1):
        check_decode(B, 4, 2, 32, 8, 128, [70] * B, 4, torch.float32, "cpu")
    first, third = tri.split_arrivals(2, cpu), tri.split_arrivals(6, cpu)
    assert first is tri.split_arrivals(2, cpu) and third is tri.split_arrivals(6, cpu) and first is not third


def test_exports_with_dynamic_T():
    """gated_attention exports with torch.export over a dynamic T (a custom op with a fake, cache mutation
    declared, the decode/prefill choice inside the op), and the exported program updates the caches and returns
    what naive does, for decode and prefill shapes alike."""

    class Attention(torch.nn.Module):
        def forward(self, q, gate, k, v, q_weight, k_weight, k_cache, v_cache, positions, inv_freq):
            args = (q, gate, k, v, q_weight, k_weight, k_cache, v_cache, positions, inv_freq)
            return tri.gated_attention(*args, EPS, 32**-0.5)

    def inputs(T, seed):
        x = make_layer(2, T, 4, 2, 32, 8, 96, [60, 5], torch.float32, "cpu", seed=seed)
        return {k: v.contiguous() for k, v in x.items()}  # export example inputs are plain tensors

    T = torch.export.Dim("T", min=1, max=32)
    dynamic = ({1: T}, {1: T}, {1: T}, {1: T}, {}, {}, {}, {}, {1: T}, {})
    program = torch.export.export(Attention(), tuple(inputs(3, 0).values()), dynamic_shapes=dynamic, strict=False)
    assert "qmoe_attention.gated_attention" in str(program.graph)
    for t in (1, 5):
        x = inputs(t, t)
        ref, k_ref, v_ref = reference(x)
        out = program.module()(*x.values())
        assert rel_err(x["k_cache"], k_ref) < 1e-6 and torch.equal(x["v_cache"], v_ref)
        assert rel_err(out, ref) < TOL[torch.float32]


TINY = tiny_config()


@torch.no_grad()
def greedy(model, tokens, steps):
    """Prefill then `steps` greedy decode steps -> (tokens [B, steps + 1], decode logits [steps, B, V])."""
    B, T = tokens.shape
    model.setup_caches(B, T + steps + 1)
    nxt = model(tokens, torch.zeros(B, dtype=torch.int64, device=tokens.device)).argmax(-1)
    out, logits = [nxt], []
    for s in range(steps):
        logits.append(model(nxt[:, None], torch.full((B,), T + s, device=tokens.device)))
        nxt = logits[-1].argmax(-1)
        out.append(nxt)
    return torch.stack(out, 1), torch.stack(logits)


@pytest.mark.slow
def test_tiny_model_greedy_matches_torch():
    """Tiny model in fp32: attention and norm kernels on triton give torch's greedy tokens (batch 2)."""
    model = build_model(TINY, torch.float32, "cpu", seed=1)
    tokens = torch.randint(0, TINY.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    ref_tokens, ref_logits = greedy(model, tokens, 5)
    model.set_kernels({"attention": "triton", "norm": "triton"})
    tokens_tri, logits_tri = greedy(model, tokens, 5)
    assert torch.equal(tokens_tri, ref_tokens)
    assert rel_err(logits_tri, ref_logits) < 1e-5


@pytest.mark.slow
@torch.no_grad()
def test_tiny_model_decode_step_exports():
    """The tiny model's decode step with attention and norm on triton exports with torch.export, and the
    exported program writes the model's KV caches and returns the eager logits."""
    model = build_model(TINY, torch.float32, "cpu", seed=1)
    model.set_kernels({"attention": "triton", "norm": "triton"})
    model.setup_caches(2, 16)
    tokens, input_pos = torch.randint(0, TINY.vocab_size, (2, 1)), torch.tensor([3, 7])  # rows at their own positions
    program = torch.export.export(model, (tokens, input_pos), strict=False)
    model.reset_caches()
    exported = program.module()(tokens, input_pos)
    exported_cache = model.layers[1].self_attn.k_cache.clone()
    model.reset_caches()
    eager = model(tokens, input_pos)
    assert exported_cache.abs().sum() > 0 and torch.equal(exported_cache, model.layers[1].self_attn.k_cache)
    assert torch.equal(exported, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("context", [1, 65, 1000, 8192])
def test_decode_attention_gpu_35b(context, dtype):
    """35B-A3B dims on the GPU with the split count the model gets: batch 1 and batch 3 at different positions."""
    S = 8192
    for positions in ([context - 1], [context - 1, context // 3, 0]):
        splits = tri.num_splits(len(positions), 2, S, torch.device("cuda"))
        check_decode(len(positions), 16, 2, 256, 64, S, positions, splits, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T, starts", [(4096, [0]), (257, [0, 1000, 3000]), (3, [5, 32000, 200000])])
def test_prefill_attention_gpu_35b(T, starts, dtype):
    # the cache just holds the last position: the reference's [B, H, T, S] scores at S = 200k and T = 4096 took
    # ~50 GB per dtype (the far positions are the (3, [.., 200000]) case's)
    check_prefill(len(starts), T, 16, 2, 256, 64, max(starts) + T + 8, starts, dtype, "cuda")


@pytest.mark.gpu
def test_tiny_model_greedy_matches_torch_gpu():
    model = build_model(TINY, torch.float32, "cuda", seed=1)
    tokens = torch.randint(0, TINY.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2)).cuda()
    ref_tokens, ref_logits = greedy(model, tokens, 24)
    model.set_kernels({"attention": "triton", "norm": "triton"})
    tokens_tri, logits_tri = greedy(model, tokens, 24)
    assert torch.equal(tokens_tri, ref_tokens)
    assert rel_err(logits_tri, ref_logits) < 1e-4


@torch.no_grad()
def logits_along(model, tokens, continuation):
    """Logits [1 + steps, B, V] of the prompt's last token and then of each forced continuation token."""
    B, T = tokens.shape
    model.setup_caches(B, T + continuation.shape[1] + 1)
    out = [model(tokens, torch.zeros(B, dtype=torch.int64, device=tokens.device))]
    for s in range(continuation.shape[1]):
        out.append(model(continuation[:, s : s + 1], torch.full((B,), T + s, device=tokens.device)))
    return torch.stack(out)


@pytest.mark.gpu
def test_tiny_model_bf16_logits_gpu():
    """bf16: along torch's greedy continuation, the triton path is as close to the fp32 model as the torch path
    (two bf16 paths differ from each other by about twice their own rounding, so compare both to fp32)."""
    model = build_model(TINY, torch.bfloat16, "cuda", seed=1)
    tokens = torch.randint(0, TINY.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2)).cuda()
    ref_tokens, _ = greedy(model, tokens, 24)
    continuation = ref_tokens[:, :-1]
    torch_bf16 = logits_along(model, tokens, continuation)
    model.set_kernels({"attention": "triton", "norm": "triton"})
    triton_bf16 = logits_along(model, tokens, continuation)
    model32 = build_model(TINY, torch.float32, "cuda", seed=None)  # the same weights, upcast
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    fp32 = logits_along(model32, tokens, continuation)
    err_torch, err_triton = rel_err(torch_bf16, fp32), rel_err(triton_bf16, fp32)
    assert err_torch < 0.1  # bf16 rounding through 4 layers and 24 cached steps of O(1) random weights
    assert err_triton < 1.5 * err_torch + 1e-3


@pytest.mark.gpu
def test_decode_attention_cuda_graph():
    """The decode op captures into a CUDA graph (no host sync, grid from static shapes) and the replay follows
    inputs and positions written into the captured tensors: contexts 1, 64, 65, 3000 in one graph, so the number
    of active splits (and the last split to arrive) changes from replay to replay."""
    x = make_layer(2, 1, 16, 2, 256, 64, 4096, [0, 0], torch.bfloat16, "cuda")
    fused = x["q"]._base  # the projection output the four views share
    graph, out = captured(lambda: tri.gated_attention(**x, eps=EPS, scale=256**-0.5))  # counters allocated before
    for step, context in enumerate([1, 64, 65, 3000]):
        fused.copy_(torch.randn(fused.shape, generator=torch.Generator().manual_seed(step)))
        x["positions"].copy_(torch.tensor([[context - 1], [context // 2]]))
        ref, k_ref, v_ref = reference(x)
        before = x["k_cache"].clone(), x["v_cache"].clone()
        graph.replay()
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        check_caches(x, before, k_ref, v_ref, torch.bfloat16)
