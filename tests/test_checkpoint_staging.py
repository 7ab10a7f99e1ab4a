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


# (shape, index, why): the shapes and slices the sharded loader reads, each way a slice can lie in the bytes
SLICES = [
    ((6, 5), (slice(2, 4),), "rows (column-parallel): one run"),
    ((6, 10), (slice(0, 6), slice(5, 10)), "columns (row-parallel): short runs, one span"),
    ((6, 10), (slice(1, 5), slice(0, 3)), "rows and columns: the span starts and ends inside rows"),
    ((4, 6, 5), (slice(1, 3),), "whole experts (expert parallel): one run"),
    ((4, 6, 5), (slice(0, 4), slice(3, 6)), "an expert's up rows (tp inside experts): a run per expert"),
    ((4, 6, 5), (slice(1, 3), slice(0, 6), slice(2, 4)), "experts' down columns: the span over two experts"),
    ((4, 6, 5), (slice(0, 4), slice(2, 5), slice(1, 2)), "one column of some rows: runs of one element"),
    ((7, 3), (), "the whole tensor"),
    ((7, 3), (slice(3, 3),), "an empty slice"),
    ((), (), "a 0-dim tensor"),
]


@pytest.mark.parametrize("run_min", [1, 1 << 30], ids=["runs", "spans"])  # every slice read both ways
@pytest.mark.parametrize("span_bytes", [1, 64, 1 << 20], ids=["row-spans", "2-row-spans", "one-span"])
@pytest.mark.parametrize("chunk_bytes", [8, 1 << 20])  # runs and spans across the buffers, or in one
def test_slices_equal_safetensors_slices(tmp_path, monkeypatch, run_min, span_bytes, chunk_bytes):
    """slice_to_device gives safetensors' get_slice for every way a slice lies in the file: read as its runs or as
    spans (of one row, a few or all), through buffers smaller than a run or holding them all, and READ_PIECE
    pieces on the reader threads."""
    monkeypatch.setattr(staging, "RUN_MIN", run_min)
    monkeypatch.setattr(staging, "SPAN_BYTES", span_bytes)
    monkeypatch.setattr(staging, "READ_PIECE", 3)
    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(shape, generator=g).bfloat16() for i, (shape, _, _) in enumerate(SLICES)}
    tensors["pad"] = torch.randn(3, generator=g).half()  # the next tensors start off an element boundary of theirs
    tensors["fp8"] = torch.randn(4, 6, 5, generator=g).to(torch.float8_e4m3fn)
    file = tmp_path / "shard.safetensors"
    save_file(tensors, file)
    stager = Stager("cpu", chunk_bytes=chunk_bytes, buffers=2)
    cases = [(f"t{i}", index, why) for i, (_, index, why) in enumerate(SLICES)]
    cases.append(("fp8", (slice(1, 3), slice(0, 6), slice(2, 4)), "fp8 experts' down columns"))
    with ShardReader(file) as reader, safe_open(file, framework="pt") as f:
        for key, index, why in cases:
            expected = f.get_slice(key)[index] if index else f.get_tensor(key)
            out = stager.slice_to_device(reader, key, index)
            assert out.dtype == expected.dtype and out.shape == expected.shape, why
            assert out.is_contiguous() and torch.equal(raw(out), raw(expected.contiguous())), why


def test_slice_reads_only_its_span(tmp_path, monkeypatch):
    """A slice of short runs reads the bytes from its first to its last element and no others (here: the down
    columns of two experts read 2 x 30 - 2 - 1 elements, not the tensor's 120); long runs read exactly the slice."""
    monkeypatch.setattr(staging, "RUN_MIN", 64)
    file = tmp_path / "shard.safetensors"
    save_file({"w": torch.randn(4, 6, 5).bfloat16()}, file)
    with ShardReader(file) as reader:
        read = []
        ranges = reader.read_ranges
        monkeypatch.setattr(reader, "read_ranges", lambda r, out: (read.extend(r), ranges(r, out)))
        Stager("cpu").slice_to_device(reader, "w", (slice(1, 3), slice(0, 6), slice(2, 4)))
        assert sum(n for _, n in read) == (2 * 30 - 2 - 1) * 2  # elements 32 .. 89: from (1, 0, 2) to (2, 5, 3)
        read.clear()
        Stager("cpu").slice_to_device(reader, "w", (slice(0, 4), slice(2, 5)))  # 15-element (30-byte) runs: a span
        assert sum(n for _, n in read) == (3 * 30 + 15) * 2
        monkeypatch.setattr(staging, "RUN_MIN", 30)
        read.clear()
        Stager("cpu").slice_to_device(reader, "w", (slice(0, 4), slice(2, 5)))  # now read run by run
        assert sorted(read) == [(reader.spec("w")[2] + (e * 30 + 10) * 2, 30) for e in range(4)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stager_to_gpu_through_pinned_buffers(tmp_path):
    tensors = {"big": torch.randn(3 << 20).bfloat16(), **stored_tensors()}  # 6 MiB: 3 chunks of 2 MiB
    file = tmp_path / "shard.safetensors"
    save_file(tensors, file)
    stager = Stager("cuda", chunk_bytes=2 << 20)
    with ShardReader(file) as reader:
        out = {key: stager.to_device(reader, key) for key in tensors}
        columns = stager.slice_to_device(reader, "big", (slice(1 << 20, 3 << 20),))  # a run across chunks
        rows = (slice(1, 4), slice(1, 100))
        span = stager.slice_to_device(reader, "fp8", rows)  # a span, sliced on the device
    torch.cuda.synchronize()
    for key, x in tensors.items():
        assert out[key].is_cuda and torch.equal(raw(out[key].cpu()), raw(x)), key
    assert torch.equal(raw(columns.cpu()), raw(tensors["big"][1 << 20 : 3 << 20]))
    assert span.is_cuda and torch.equal(raw(span.cpu()), raw(tensors["fp8"][rows].contiguous()))
