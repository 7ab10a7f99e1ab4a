"""Triton attention (kernels/attention/triton.py) against the PyTorch reference (kernels/attention/naive.py)."""

import pytest
import torch

from kernels.attention import naive
from kernels.attention import triton as tri
from qmoe.model import build_model
from tests.helpers import poisoned, rel_err, tiny_config

EPS = 1e-6
# qk_norm_rope rounds once where naive rounds after each op; decode attention casts p to the model dtype
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
D_SCALE = 256**-0.5


def make_inv_freq(rot: int, device) -> torch.Tensor:
    return 1.0 / (1e7 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))


def check_qk_norm_rope(B, T, HQ, HKV, D, R, starts, dtype, device):
    gen = torch.Generator().manual_seed(D + R + T)
    q = torch.randn(B, T, HQ, 2 * D, generator=gen).to(dtype).to(device)[..., :D]  # strided, as the model's chunk
    k = torch.randn(B, T, HKV, D, generator=gen).to(dtype).to(device)
    q_w, k_w = (0.1 * torch.randn(2, D, generator=gen)).to(dtype).to(device)
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)  # [B, T]
    inv_freq = make_inv_freq(R, device)
    q_out, k_out = poisoned(B, T, HQ, D, dtype=dtype, device=device), poisoned(B, T, HKV, D, dtype=dtype, device=device)
    tri.qk_norm_rope_into(q, k, q_w, k_w, positions, inv_freq, EPS, q_out, k_out)
    q_ref, k_ref = naive.qk_norm_rope(q.float(), k.float(), q_w.float(), k_w.float(), positions, inv_freq, EPS)
    assert rel_err(q_out, q_ref) < TOL[dtype] and rel_err(k_out, k_ref) < TOL[dtype]
    q_op, k_op = tri.qk_norm_rope(q, k, q_w, k_w, positions, inv_freq, EPS)
    assert rel_err(q_op, q_ref) < TOL[dtype] and rel_err(k_op, k_ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "B, T, HQ, HKV, D, R, starts",
    [
        (1, 1, 4, 2, 32, 8, [0]),  # tiny model decode at position 0 (cos 1, sin 0)
        (3, 5, 4, 2, 32, 16, [0, 1000, 70000]),  # batch 3 rows far apart; large angles need the range reduction
        (1, 3, 6, 6, 72, 24, [9]),  # head dim not a power of 2 (masked tail), MHA, R/2 = 12 not a power of 2
        (2, 2, 16, 2, 256, 64, [31, 4096]),  # 35B-A3B heads: 16 q / 2 kv, head dim 256, rotary 64
    ],
)
def test_qk_norm_rope(B, T, HQ, HKV, D, R, starts, dtype):
    check_qk_norm_rope(B, T, HQ, HKV, D, R, starts, dtype, "cpu")


def make_decode(B, HQ, HKV, D, S, positions, dtype, device, seed=0):
    """One new token per row at `positions` [B] over a random cache of S slots (garbage past each row's
    position, so a kernel that reads beyond it fails)."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)
    q, k, v = randn(B, 1, HQ, D), randn(B, 1, HKV, D), randn(B, 1, HKV, D)
    k_cache, v_cache = randn(B, HKV, S, D), randn(B, HKV, S, D)
    return q, k, v, k_cache, v_cache, torch.tensor(positions, device=device)[:, None]


def check_decode(B, HQ, HKV, D, S, positions, splits, dtype, device):
    q, k, v, k_cache, v_cache, pos = make_decode(B, HQ, HKV, D, S, positions, dtype, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    naive.attention(q, k, v, k_ref, v_ref, pos, D**-0.5)  # writes the reference caches
    ref = naive.attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), pos, D**-0.5)
    out = poisoned(B, 1, HQ, D, dtype=dtype, device=device)
    o_part = poisoned(B, HQ, splits, D, device=device)
    lse_part = poisoned(B, HQ, splits, device=device)
    tri.decode_attention_into(q, k, v, k_cache, v_cache, pos, D**-0.5, out, o_part, lse_part)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # written exactly where naive writes
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("context", [1, 63, 64, 65, 500])  # one key; around one 64-key tile; many tiles
@pytest.mark.parametrize("splits", [1, 4, 16])  # no split-K; split-K; more splits than tiles (empty splits)
def test_decode_attention(context, splits, dtype):
    # batch 3: one row at `context`, the others at shorter contexts, so rows use different split ranges
    positions = [context - 1, context // 2, 0]
    check_decode(3, 4, 2, 32, 512, positions, splits, dtype, "cpu")


@pytest.mark.parametrize("context", [1, 65, 500])
def test_decode_attention_35b_heads(context):
    """35B-A3B heads (group of 8 q heads, head dim 256), batch 1, default split count for the cache."""
    splits = tri.num_splits(1, 2, 512, torch.device("cpu"))
    check_decode(1, 16, 2, 256, 512, [context - 1], splits, torch.float32, "cpu")


def check_prefill(B, T, HQ, HKV, D, S, starts, dtype, device):
    gen = torch.Generator().manual_seed(T + D)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)
    q, k, v = randn(B, T, HQ, D), randn(B, T, HKV, D), randn(B, T, HKV, D)
    k_cache, v_cache = randn(B, HKV, S, D), randn(B, HKV, S, D)  # slots before `starts` are earlier context
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)  # [B, T]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    naive.attention(q, k, v, k_ref, v_ref, positions, D**-0.5)
    ref = naive.attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), positions, D**-0.5)
    out = poisoned(B, T, HQ, D, dtype=dtype, device=device)
    tri.prefill_attention_into(q, k, v, k_cache, v_cache, positions, D**-0.5, out)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "B, T, starts",
    [
        (1, 65, [0]),  # a prompt from position 0, one query block plus a 1-token tail block
        (3, 63, [0, 100, 5]),  # batch 3, rows continuing earlier context at different positions, T < BLOCK_M
        (3, 1, [7, 0, 70]),  # a single token per row through the prefill kernel
    ],
)
def test_prefill_attention(B, T, starts, dtype):
    check_prefill(B, T, 4, 2, 32, 192, starts, dtype, "cpu")


def test_prefill_attention_35b_heads():
    """35B-A3B heads: 8 q heads per kv head, head dim 256."""
    check_prefill(1, 20, 16, 2, 256, 64, [30], torch.float32, "cpu")


def test_odd_head_dim():
    """Head dim 72 (not a power of 2: masked tail of the head block) and 3 q heads per kv head."""
    check_decode(2, 6, 2, 72, 160, [100, 7], 4, torch.float32, "cpu")
    check_prefill(2, 9, 6, 2, 72, 160, [0, 50], torch.float32, "cpu")


@pytest.mark.parametrize("T", [1, 63, 65])
def test_attention_through_public_op(T):
    """attention() dispatches T == 1 to the decode kernels and T > 1 to the prefill kernel; rows at
    different positions, the caches written where naive writes them."""
    B, HQ, HKV, D, S = 3, 4, 2, 32, 160
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, T, h, D, generator=gen) for h in (HQ, HKV, HKV))
    k_cache, v_cache = torch.randn(2, B, HKV, S, D, generator=gen)
    positions = torch.tensor([0, 30, 90])[:, None] + torch.arange(T)  # [B, T]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = naive.attention(q, k, v, k_ref, v_ref, positions, D**-0.5)
    out = tri.attention(q, k, v, k_cache, v_cache, positions, D**-0.5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_exports_with_dynamic_T():
    """qk_norm_rope + attention export with torch.export over a dynamic T (custom ops with fakes, cache
    mutation declared, the decode/prefill choice inside the op), and the exported program updates the
    caches and returns what naive does, for decode and prefill shapes alike."""

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, k_cache, v_cache, positions, q_w, k_w, inv_freq):
            q, k = tri.qk_norm_rope(q, k, q_w, k_w, positions, inv_freq, EPS)
            return tri.attention(q, k, v, k_cache, v_cache, positions, 32**-0.5)

    def inputs(T, seed):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(2, T, h, 32, generator=gen) for h in (4, 2, 2))
        k_cache, v_cache = torch.randn(2, 2, 2, 96, 32, generator=gen)
        positions = torch.tensor([[60], [5]]) + torch.arange(T)  # [B, T]
        q_w, k_w = 0.1 * torch.randn(2, 32, generator=gen)
        return q, k, v, k_cache, v_cache, positions, q_w, k_w, make_inv_freq(8, "cpu")

    T = torch.export.Dim("T", min=1, max=32)
    dynamic = ({1: T}, {1: T}, {1: T}, {}, {}, {1: T}, {}, {}, {})
    program = torch.export.export(Attention(), inputs(3, 0), dynamic_shapes=dynamic, strict=False)
    graph = str(program.graph)
    assert "qmoe_attention.attention" in graph and "qmoe_attention.qk_norm_rope" in graph
    for t in (1, 5):
        args = inputs(t, t)
        q, k, v, k_cache, v_cache, positions, q_w, k_w, inv_freq = args
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        q_ref, k_normed = naive.qk_norm_rope(q, k, q_w, k_w, positions, inv_freq, EPS)
        ref = naive.attention(q_ref, k_normed, v, k_ref, v_ref, positions, 32**-0.5)
        out = program.module()(*args)
        assert torch.allclose(k_cache, k_ref, atol=1e-6) and torch.equal(v_cache, v_ref)
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
        check_decode(len(positions), 16, 2, 256, S, positions, splits, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T, starts", [(4096, [0]), (257, [0, 1000, 3000])])  # a long prompt; chunked, batch 3
def test_prefill_attention_gpu_35b(T, starts, dtype):
    check_prefill(len(starts), T, 16, 2, 256, 4096, starts, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T, starts", [(1, [0]), (1, [5, 32000, 200000]), (4096, [0])])
def test_qk_norm_rope_gpu_35b(T, starts, dtype):
    check_qk_norm_rope(len(starts), T, 16, 2, 256, 64, starts, dtype, "cuda")


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
    """The decode op captures into a CUDA graph (no host sync, grid from static shapes) and the replay
    follows positions written into the captured tensor: contexts 1, 64, 65, 3000 in one graph."""
    q, k, v, k_cache, v_cache, pos = make_decode(2, 16, 2, 256, 4096, [0, 0], torch.bfloat16, "cuda")
    tri.attention(q, k, v, k_cache, v_cache, pos, D_SCALE)  # compile outside the capture
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.attention(q, k, v, k_cache, v_cache, pos, D_SCALE)
    for step, context in enumerate([1, 64, 65, 3000]):
        gen = torch.Generator().manual_seed(step)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen))
        pos.copy_(torch.tensor([[context - 1], [context // 2]]))
        graph.replay()
        naive.attention(q, k, v, k_ref, v_ref, pos, D_SCALE)  # the reference cache write
        ref = naive.attention(q.float(), k.float(), v.float(), k_ref.float(), v_ref.float(), pos, D_SCALE)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        assert rel_err(out, ref) < TOL[torch.bfloat16]
