"""Whole-tensor reads of a safetensors shard for the loader: positioned reads from the page cache straight into
the destination's bytes, split across threads.

A memory-mapped shard (this module until 6b130c5) faults each 4 KB page into the process as a copy touches it, on
one thread: the 35B 4-layer checkpoint loaded to the H200 at 1.38 GB/s bf16 and 0.87 GB/s FP8, below safetensors'
own load_file (3.61 / 2.87 GB/s; results/bench_checkpoint_load*.json). Here `os.preadv` copies file bytes into
a buffer in the kernel, READ_PIECE bytes per call, the pieces of one read on READ_THREADS threads (the call
releases the GIL). To the CPU, a tensor is read into its destination when that holds the stored dtype, else into
a host tensor that the caller converts. To a GPU, `Stager` moves the bytes through pinned buffers of STAGE_BYTES:
a chunk is read into a free buffer while the previous chunks' asynchronous host-to-device copies run, and a
buffer is reused once its copy is done (a CUDA event per buffer).
"""

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# safetensors dtype names -> torch dtypes (the ones a checkpoint of this model can hold)
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
STAGE_BYTES = 64 << 20  # per pinned buffer: large enough that a copy's fixed cost is small, two of them in flight
READ_PIECE = 8 << 20  # bytes per positioned read: a stage's pieces go to the threads together
READ_THREADS = min(8, os.cpu_count() or 1)
_readers: dict[int, ThreadPoolExecutor] = {}  # pid -> its pool, made at its first read that has several pieces


def _pool() -> ThreadPoolExecutor:
    """This process's reader threads (a forked child gets its own: the parent's threads do not exist in it)."""
    pid = os.getpid()
    if pid not in _readers:
        _readers[pid] = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="qmoe-read")
    return _readers[pid]


def _pread_exact(fd: int, view: memoryview, offset: int) -> None:
    """view <- the file's len(view) bytes at offset (a short read continues; end of file is an error)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"the file ends {len(view) - done} bytes short of offset {offset + len(view)}")
        done += n


class ShardReader:
    """One safetensors file, opened for positioned reads: `read_into(key, out)` fills a CPU tensor with a stored
    tensor's bytes, `host_tensor(key)` returns a new one; `spec(key)` is (dtype, shape, file offset, bytes)."""

    def __init__(self, file: str | Path):
        self.file = Path(file)
        self._fd = os.open(self.file, os.O_RDONLY)
        (header_len,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        header = bytearray(header_len)
        _pread_exact(self._fd, memoryview(header), 8)
        entries = json.loads(header)
        entries.pop("__metadata__", None)
        self._entries = entries
        self._data = 8 + header_len

    def spec(self, key: str) -> tuple[torch.dtype, list, int, int]:
        entry = self._entries[key]
        begin, end = entry["data_offsets"]
        return DTYPES[entry["dtype"]], entry["shape"], self._data + begin, end - begin

    def read_range(self, offset: int, out: torch.Tensor) -> None:
        """out (a contiguous uint8 CPU tensor) <- the file's out.numel() bytes at offset, READ_PIECE at a time on
        the reader threads."""
        view = memoryview(out.numpy())
        pieces = range(0, len(view), READ_PIECE)
        read = lambda start: _pread_exact(self._fd, view[start : start + READ_PIECE], offset + start)  # noqa: E731
        if len(pieces) <= 1:
            return read(0) if len(view) else None
        for future in [_pool().submit(read, start) for start in pieces]:
            future.result()

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """out (a contiguous CPU tensor of the stored dtype and shape) <- tensor `key`."""
        dtype, shape, offset, nbytes = self.spec(key)
        if out.dtype != dtype or list(out.shape) != shape or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"{key}: read_into needs a contiguous CPU {dtype} {shape}, got {out.dtype} {out.shape}")
        self.read_range(offset, out.reshape(-1).view(torch.uint8) if nbytes else out.new_empty(0, dtype=torch.uint8))

    def host_tensor(self, key: str) -> torch.Tensor:
        dtype, shape, _, _ = self.spec(key)
        out = torch.empty(shape, dtype=dtype)
        self.read_into(key, out)
        return out

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Stager:
    """Stored tensors to `device` through `buffers` staging buffers of `chunk_bytes` (pinned for a GPU; plain on
    the CPU, where the same chunking runs synchronously). to_device() returns a new device tensor whose copies are
    queued on the current stream: the caller's next kernels on that stream see its bytes (and PyTorch's pinned
    allocator keeps a buffer alive until the copies that read it are done)."""

    def __init__(self, device, chunk_bytes: int = STAGE_BYTES, buffers: int = 2):
        self.device = torch.device(device)
        pinned = self.device.type == "cuda"
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(buffers)]
        self._done = [None] * buffers  # the event after each buffer's last host-to-device copy
        self._next = 0

    def to_device(self, reader: ShardReader, key: str) -> torch.Tensor:
        dtype, shape, offset, nbytes = reader.spec(key)
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        chunk = self._buffers[0].numel()
        for start in range(0, nbytes, chunk):
            i = self._next
            self._next = (i + 1) % len(self._buffers)
            if self._done[i] is not None:
                self._done[i].synchronize()  # its previous copy has left the buffer
            buffer = self._buffers[i][: min(chunk, nbytes - start)]
            reader.read_range(offset + start, buffer)  # the one host copy: page cache -> staging buffer
            out[start : start + buffer.numel()].copy_(buffer, non_blocking=True)
            if self.device.type == "cuda":
                self._done[i] = torch.cuda.Event()
                self._done[i].record()
        return out.view(dtype).reshape(shape)
