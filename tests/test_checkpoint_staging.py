"""qmoe/checkpoint/staging.py: positioned reads (in pieces, on threads) and the chunked staging copy."""

import os
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qmoe.checkpoint import staging
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


@pytest.mark.parametrize("piece", [1, 3, 64, 1 << 20])  # a read per byte, pieces across elements, one piece
def test_reads_equal_safetensors_reads(tmp_path, monkeypatch, piece):
    """host_tensor and read_into give safetensors' bytes for every dtype, odd offsets, empty and 0-dim tensors,
    whether a tensor is one positioned read or many on the reader threads."""
    monkeypatch.setattr(staging, "READ_PIECE", piece)
    tensors = stored_tensors()
    file = tmp_path / "shard.safetensors"
    save_file(tensors, file, metadata={"format": "pt"})
    with ShardReader(file) as reader, safe_open(file, framework="pt") as f:
        for key, expected in tensors.items():
            read = reader.host_tensor(key)
            assert read.dtype == expected.dtype and read.shape == expected.shape, key
            assert torch.equal(raw(read), raw(f.get_tensor(key))), key
            into = torch.empty_like(expected)
            raw(into).fill_(0xFF)  # every byte set: a byte left unread would show
            reader.read_into(key, into)
            assert torch.equal(raw(into), raw(expected)), key


def test_short_reads_continue(tmp_path, monkeypatch):
    """preadv may return fewer bytes than asked (a signal, a pipe-backed file): the read goes on from there."""
    preadv = os.preadv
    monkeypatch.setattr(staging.os, "preadv", lambda fd, bufs, offset: preadv(fd, [bufs[0][:5]], offset))
    tensors = stored_tensors()
    file = tmp_path / "shard.safetensors"
    save_file(tensors, file)
    with ShardReader(file) as reader:
        for key, expected in tensors.items():
            assert torch.equal(raw(reader.host_tensor(key)), raw(expected)), key


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_reads_in_a_forked_child(tmp_path, monkeypatch):
    """A child forked after the parent's reads has none of the parent's reader threads: it reads with its own."""
    monkeypatch.setattr(staging, "READ_PIECE", 16)  # several pieces: the pool is used
    tensors = stored_tensors()
    file = tmp_path / "shard.safetensors"
    save_file(tensors, file)
    with ShardReader(file) as reader:
        reader.host_tensor("f32")  # the parent's pool now exists
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if every tensor reads back right
        ok = False
        try:
            with ShardReader(file) as reader:
                ok = all(torch.equal(raw(reader.host_tensor(k)), raw(x)) for k, x in tensors.items())
        finally:
            os._exit(0 if ok else 1)
    deadline = time.time() + 30
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child's read hung")


def test_read_into_refuses_another_dtype_or_shape(tmp_path):
    file = tmp_path / "shard.safetensors"
    save_file(stored_tensors(), file)
    with ShardReader(file) as reader:
        with pytest.raises(ValueError, match="f32: read_into needs a contiguous CPU torch.float32"):
            reader.read_into("f32", torch.empty(17, dtype=torch.float16))
        with pytest.raises(ValueError, match="bf16"):
            reader.read_into("bf16", torch.empty(5, 3, dtype=torch.bfloat16))


def test_truncated_shard_is_an_error(tmp_path):
    """A shard cut short inside a tensor's bytes: the read says where the file ends, never returns short data."""
    file = tmp_path / "shard.safetensors"
    save_file({"big": torch.arange(1000, dtype=torch.float32)}, file)
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    with ShardReader(file) as reader, pytest.raises(EOFError, match="100 bytes short"):
        reader.host_tensor("big")


@pytest.mark.parametrize("chunk_bytes", [1, 7, 8, 64])  # every byte its own chunk, chunks across elements, whole
def test_stager_copies_every_byte_through_rotating_buffers(tmp_path, chunk_bytes):
    # on the CPU the same chunking runs with plain buffers: sizes below, at and across a chunk, with three buffers
    # reused in turn
    tensors = stored_tensors()
    file = tmp_path / "shard.safetensors"
    save_file(tensors, file)
    stager = Stager("cpu", chunk_bytes=chunk_bytes, buffers=3)
    with ShardReader(file) as reader:
        for key, x in tensors.items():
            out = stager.to_device(reader, key)
            assert out.dtype == x.dtype and out.shape == x.shape, key
            assert torch.equal(raw(out), raw(x)), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stager_to_gpu_through_pinned_buffers(tmp_path):
    tensors = {"big": torch.randn(3 << 20).bfloat16(), **stored_tensors()}  # 6 MiB: 3 chunks of 2 MiB
    file = tmp_path / "shard.safetensors"
    save_file(tensors, file)
    stager = Stager("cuda", chunk_bytes=2 << 20)
    with ShardReader(file) as reader:
        out = {key: stager.to_device(reader, key) for key in tensors}
    torch.cuda.synchronize()
    for key, x in tensors.items():
        assert out[key].is_cuda and torch.equal(raw(out[key].cpu()), raw(x)), key
