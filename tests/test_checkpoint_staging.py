"""qmoe/checkpoint/staging.py: tensors read as views of a mapped shard, and the chunked staging copy."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qmoe.checkpoint.staging import ShardReader, Stager


def raw(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8)  # the bytes (a 0-dim tensor has no byte view of its own)


def stored_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(3, 5, generator=g).bfloat16(),  # odd byte count: the next tensor's offset is not 16-aligned
        "f32": torch.randn(17, generator=g),
        "f16": torch.randn(2, 2, 3, generator=g).half(),
        "fp8": torch.randn(4, 129, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.arange(-3, 4),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),  # zero bytes
        "scalar": torch.tensor(2.5),  # shape []
    }


def test_host_views_equal_safetensors_reads(tmp_path):
    tensors = stored_tensors()
    file = tmp_path / "shard.safetensors"
    save_file(tensors, file, metadata={"format": "pt"})
    with ShardReader(file) as reader, safe_open(file, framework="pt") as f:
        for key, expected in tensors.items():
            view = reader.host_view(key)
            assert view.dtype == expected.dtype and view.shape == expected.shape, key
            assert torch.equal(raw(view), raw(f.get_tensor(key))), key
            del view  # the map closes at the end of the block: no view may outlive it


@pytest.mark.parametrize("chunk_bytes", [1, 7, 8, 64])  # every byte its own chunk, chunks across elements, whole
def test_stager_copies_every_byte_through_rotating_buffers(chunk_bytes):
    # on the CPU the same chunking runs with plain buffers: sizes below, at and across a chunk, with three buffers
    # reused in turn
    stager = Stager("cpu", chunk_bytes=chunk_bytes, buffers=3)
    for key, x in stored_tensors().items():
        out = stager.to_device(x)
        assert out.dtype == x.dtype and out.shape == x.shape, key
        assert torch.equal(raw(out), raw(x)), key
        assert out.data_ptr() != x.data_ptr() or x.numel() == 0  # a copy, not a view


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stager_to_gpu_through_pinned_buffers(tmp_path):
    tensors = {"big": torch.randn(3 << 20).bfloat16(), **stored_tensors()}  # 6 MiB: 3 chunks of 2 MiB
    file = tmp_path / "shard.safetensors"
    save_file(tensors, file)
    stager = Stager("cuda", chunk_bytes=2 << 20)
    with ShardReader(file) as reader:
        out = {key: stager.to_device(reader.host_view(key)) for key in tensors}
    torch.cuda.synchronize()
    for key, x in tensors.items():
        assert out[key].is_cuda and torch.equal(raw(out[key].cpu()), raw(x)), key
