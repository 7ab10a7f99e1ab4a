"""The PyTorch model against transformers' Qwen3_5MoeForCausalLM (the oracle) with identical weights."""

import pytest
import torch

from qmoe.model import ModelConfig, build_model
from qmoe.model.hf import to_transformers
from tests.helpers import TINY_ARCH, tiny_config

TINY = TINY_ARCH
CONFIGS = {
    "tiny": TINY,
    # odd sizes everywhere: hidden 72, 5 experts top-3, intermediate 24, vocab 301, 3 v heads per k head
    "odd": {
        **TINY,
        "hidden_size": 72,
        "vocab_size": 301,
        "num_experts": 5,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40,
        "linear_num_value_heads": 6,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 12,
        "num_attention_heads": 6,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
    },
    # the released layer pattern (full attention every 4th layer), 8 layers, K = E, MHA (kv heads = q heads)
    "interval4": {
        **TINY,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,
        "num_experts": 4,
        "num_experts_per_tok": 4,
        "num_key_value_heads": 4,
        "linear_num_key_heads": 4,
    },
}
PREFILL, DECODE = 70, 16  # the prefill crosses the 64-token DeltaNet chunk


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def oracle_run(hf, tokens, steps):
    """Prefill logits [B, T, V] and the greedy continuation of transformers' model, step by step."""
    out = hf(tokens, use_cache=True)
    prefill, cache = out.logits.float(), out.past_key_values
    nxt = prefill[:, -1].argmax(-1, keepdim=True)
    step_logits, greedy = [], [nxt]
    for _ in range(steps):
        out = hf(nxt, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        step_logits.append(out.logits[:, -1].float())
        nxt = step_logits[-1].argmax(-1, keepdim=True)
        greedy.append(nxt)
    return prefill, step_logits, torch.cat(greedy, 1)


@torch.no_grad()
def ours_run(model, tokens, steps):
    B, T = tokens.shape
    model.setup_caches(B, T + steps + 1)
    prefill = model(tokens, torch.zeros(B, dtype=torch.int64, device=tokens.device), all_logits=True)
    nxt = prefill[:, -1].argmax(-1)
    step_logits, greedy = [], [nxt[:, None]]
    for s in range(steps):
        step_logits.append(model(nxt[:, None], torch.full((B,), T + s, device=tokens.device)))
        nxt = step_logits[-1].argmax(-1)
        greedy.append(nxt[:, None])
    return prefill, step_logits, torch.cat(greedy, 1)


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_transformers(name):
    cfg = ModelConfig.from_dict(CONFIGS[name])
    model = build_model(cfg, torch.float32, "cpu", seed=1)
    hf = to_transformers(model)
    tokens = torch.randint(0, cfg.vocab_size, (1, PREFILL), generator=torch.Generator().manual_seed(2))
    ref_prefill, ref_steps, ref_greedy = oracle_run(hf, tokens, DECODE)
    prefill, steps, greedy = ours_run(model, tokens, DECODE)
    assert rel(prefill, ref_prefill) < 1e-4
    for s, (ours, ref) in enumerate(zip(steps, ref_steps)):
        assert rel(ours, ref) < 1e-4, f"decode step {s}"
    assert torch.equal(greedy, ref_greedy)


def test_batch_rows_match_single_runs():
    """Two different prompts in one batch give what each gives alone (caches are per row)."""
    cfg = ModelConfig.from_dict(TINY)
    model = build_model(cfg, torch.float32, "cpu", seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 67), generator=torch.Generator().manual_seed(4))
    batch_prefill, batch_steps, batch_greedy = ours_run(model, tokens, 8)
    for b in range(2):
        prefill, steps, greedy = ours_run(model, tokens[b : b + 1], 8)
        assert rel(batch_prefill[b], prefill[0]) < 1e-5
        assert all(rel(x[b], y[0]) < 1e-5 for x, y in zip(batch_steps, steps))
        assert torch.equal(batch_greedy[b], greedy[0])


@torch.no_grad()
def test_reset_caches_zeroes_every_cache_and_nothing_else():
    """reset_caches zeroes each layer's caches (KV for attention, conv and recurrent state for DeltaNet) in one
    multi-tensor call, and a prompt after it gives what it gives on a fresh model; weights are untouched."""
    cfg = ModelConfig.from_dict(TINY)
    model = build_model(cfg, torch.float32, "cpu", seed=3)
    model.setup_caches(1, 16)
    tokens = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    fresh = model(tokens, torch.zeros(1, dtype=torch.int64))
    weights = {n: p.clone() for n, p in model.named_parameters()}
    caches = {n: b for n, b in model.named_buffers() if n.endswith(("_cache", "_state"))}
    assert len(caches) == 2 * cfg.num_hidden_layers and all(b.abs().sum() > 0 for b in caches.values())
    model.reset_caches()
    assert all(not b.any() for b in caches.values())
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    torch.testing.assert_close(model(tokens, torch.zeros(1, dtype=torch.int64)), fresh, rtol=0, atol=0)


def test_fused_projections_are_row_slices_of_a_padded_buffer():
    """fuse_projections_ seats each FUSED group's weights as consecutive row slices of one buffer (values kept)
    whose storage is zero-padded to a multiple of 16 bytes of rows: what padded_rows needs for an aligned prefill
    GEMM (the MoE in-projection: E + 2 Is + 1 rows)."""
    from kernels.linear.triton import padded_rows

    cfg = ModelConfig.from_dict(TINY)
    model = build_model(cfg, torch.float32, "cpu", seed=3)
    moe = model.layers[0].mlp
    fused = moe.in_proj
    parts = [moe.gate.weight, moe.shared_expert.gate_proj.weight, moe.shared_expert.up_proj.weight,
             moe.shared_expert_gate.weight]  # fmt: skip
    assert fused.shape[0] == cfg.num_experts + 2 * cfg.shared_expert_intermediate_size + 1
    assert torch.equal(torch.cat(parts), fused)
    assert all(p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for p in parts)
    n_pad = -(-fused.shape[0] // 4) * 4  # fp32: 4 elements to 16 bytes
    assert fused.untyped_storage().nbytes() == n_pad * fused.shape[1] * 4
    padded = padded_rows(fused)
    assert padded.shape[0] == n_pad and not padded[fused.shape[0] :].any()


def test_transformers_bridge_can_share_weights():
    model = build_model(ModelConfig.from_dict(TINY), torch.float32, "cpu", seed=0)
    hf = to_transformers(model, share_weights=True)
    ours = model.layers[0].mlp.experts.gate_up_proj
    assert hf.model.layers[0].mlp.experts.gate_up_proj.data_ptr() == ours.data_ptr()


@pytest.mark.gpu
def test_matches_transformers_on_gpu():
    """On CUDA with the GPU image's transformers: fp32 within TF32 tolerance; in bf16 ours is as close to the fp32
    oracle as transformers' own bf16 run (two bf16 implementations differ by about twice their rounding)."""
    cfg = ModelConfig.from_dict(CONFIGS["odd"])
    model32 = build_model(cfg, torch.float32, "cuda", seed=1)
    hf32 = to_transformers(model32)
    tokens = torch.randint(0, cfg.vocab_size, (1, PREFILL), generator=torch.Generator().manual_seed(2)).cuda()
    ref_prefill, ref_steps, _ = oracle_run(hf32, tokens, 4)
    prefill, steps, _ = ours_run(model32, tokens, 4)
    assert rel(prefill, ref_prefill) < 1e-3
    assert all(rel(a, b) < 1e-3 for a, b in zip(steps, ref_steps))

    model16 = build_model(cfg, torch.bfloat16, "cuda", seed=None)
    model16.load_state_dict({k: v.bfloat16() for k, v in model32.state_dict().items()})
    hf_prefill, _, _ = oracle_run(to_transformers(model16), tokens, 4)
    prefill16, _, _ = ours_run(model16, tokens, 4)
    err_hf, err_ours = rel(hf_prefill, ref_prefill), rel(prefill16, ref_prefill)
    assert err_ours < 1.5 * err_hf + 1e-3


@pytest.mark.gpu
def test_35b_shape_initialises_on_gpu_quickly():
    """The real 35B-A3B shape (4 layers here) initialises on the GPU without a host copy and runs a step."""
    import time

    from compose import compose_config

    arch = dict(compose_config("model=qwen35_moe").model.arch, num_hidden_layers=4)
    t0 = time.perf_counter()
    model = build_model(ModelConfig.from_dict(arch), torch.bfloat16, "cuda", seed=0)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 30
    model.setup_caches(1, 64)
    logits = model(torch.randint(0, 248320, (1, 8), device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda"))
    assert logits.shape == (1, 248320) and torch.isfinite(logits).all()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_greedy_run_samples_through_the_argmax_entry_point(impl):
    """A greedy run (set_kernels(..., greedy=True), as the app does for temperature 0) samples through the
    sampler's greedy entry point, which equals the general sampler on greedy rows; it is undone by the next
    set_kernels without greedy, and the choice is part of the module name that keys exports."""
    model = build_model(tiny_config(), torch.float32, "cpu", seed=0)
    model.set_kernels({"sampling": impl}, greedy=True)
    assert model.ops["sampling"].__name__.endswith("[greedy]")
    logits = torch.randn(3, model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[1].max() + 1  # a clear winner
    B = logits.shape[0]
    params = [torch.zeros(B), torch.zeros(B, dtype=torch.int64), torch.ones(B), torch.zeros(B)]
    params += [torch.zeros(B, dtype=torch.int64)] * 2
    greedy = model.sample(logits, *params)
    model.set_kernels({"sampling": impl})
    assert not model.ops["sampling"].__name__.endswith("[greedy]")
    assert torch.equal(greedy, model.sample(logits, *params))
    assert torch.equal(greedy, logits.argmax(-1))
