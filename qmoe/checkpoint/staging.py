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

A sharded model's slices (`Stager.slice_to_device`) go the same way: a slice whose contiguous runs are long
(RUN_MIN bytes or more: rows of a column-parallel projection, whole experts) is read run by run into consecutive
bytes; one of short runs (a row-parallel projection's columns, an expert's intermediate columns) reads the span from
its first to its last byte, SPAN_BYTES of its leading dim's rows at a time, and takes the slice out of it on the
device. A short run costs a read call per run otherwise (at TP 2 an expert's down columns are 512-byte runs, ~800k
of them in one 122B layer); the span reads at most the tensor's bytes.
"""

import itertools
import json
import math
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
RUN_MIN = 256 << 10  # a slice's contiguous runs of at least this many bytes are read one by one, shorter ones as a span
# a short-run slice's span is read this many bytes of leading-dim rows at a time (one row at least)
SPAN_BYTES = STAGE_BYTES
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
        """out (a contiguous uint8 CPU tensor) <- the file's out.numel() bytes at offset."""
        self.read_ranges([(offset, out.numel())], out)

    def read_ranges(self, ranges: list[tuple[int, int]], out: torch.Tensor) -> None:
        """out (a contiguous uint8 CPU tensor) <- the file's byte ranges (offset, bytes), one after another,
        READ_PIECE bytes per positioned read, the pieces of all of them together on the reader threads."""
        view = memoryview(out.numpy())
        pieces, at = [], 0
        for offset, nbytes in ranges:
            pieces += [
                (view[at + s : at + min(s + READ_PIECE, nbytes)], offset + s) for s in range(0, nbytes, READ_PIECE)
            ]
            at += nbytes
        if len(pieces) <= 1:
            return _pread_exact(self._fd, *pieces[0]) if pieces else None
        for future in [_pool().submit(_pread_exact, self._fd, *piece) for piece in pieces]:
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
        self._stage(reader, [(offset, nbytes)], out)
        return out.view(dtype).reshape(shape)

    def slice_to_device(self, reader: ShardReader, key: str, index: tuple) -> torch.Tensor:
        """tensor `key`[index] as a new contiguous device tensor (index: slices of step 1 over its leading dims),
        reading its runs or its span (module docstring); its copies are queued like to_device's."""
        dtype, shape, offset, _ = reader.spec(key)
        piece = SlicePiece(tuple(shape), index)
        out = torch.empty(piece.shape, dtype=dtype, device=self.device)
        size = dtype.itemsize
        if piece.run * size >= RUN_MIN or piece.dim <= 0:  # the runs, packed: out's bytes in order
            runs = [(offset + start * size, piece.run * size) for start in piece.run_starts()]
            self._stage(reader, runs, out.reshape(-1).view(torch.uint8))
            return out
        for rows, first, count, view_shape in piece.spans(max(1, SPAN_BYTES // (piece.strides[0] * size))):
            span = torch.empty(count * size, dtype=torch.uint8, device=self.device)
            self._stage(reader, [(offset + first * size, count * size)], span)
            out[rows].copy_(span.view(dtype).as_strided(view_shape, piece.strides))
        return out

    def _stage(self, reader: ShardReader, ranges: list[tuple[int, int]], out: torch.Tensor) -> None:
        """out (uint8 on the device) <- the file's byte ranges (offset, bytes) one after another, through the
        buffers: a buffer's worth of them read, then its copy queued, the next read into the next buffer."""
        chunk, at = self._buffers[0].numel(), 0
        pieces = [(offset + s, min(chunk, nbytes - s)) for offset, nbytes in ranges for s in range(0, nbytes, chunk)]
        first = 0
        while first < len(pieces):
            last, filled = first, 0
            while last < len(pieces) and filled + pieces[last][1] <= chunk:  # whole pieces (each <= chunk)
                filled += pieces[last][1]
                last += 1
            i = self._next
            self._next = (i + 1) % len(self._buffers)
            if self._done[i] is not None:
                self._done[i].synchronize()  # its previous copy has left the buffer
            buffer = self._buffers[i][:filled]
            reader.read_ranges(pieces[first:last], buffer)  # the one host copy: page cache -> staging buffer
            out[at : at + filled].copy_(buffer, non_blocking=True)
            at, first = at + filled, last
            if self.device.type == "cuda":
                self._done[i] = torch.cuda.Event()
                self._done[i].record()


class SlicePiece:
    """Where tensor[index] of a C-order tensor of `shape` lies (elements): index is slices of step 1 over the
    leading dims (the rest whole). dim: the last dim the slice narrows (-1: none, the whole tensor); every dim after
    it is whole, so the slice is runs of `run` consecutive elements, one per index of the dims before it."""

    def __init__(self, shape: tuple, index: tuple):
        self.strides = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        self.ranges = [(0, n) for n in shape]
        for d, s in enumerate(index):
            start, stop, step = s.indices(shape[d])
            if step != 1:
                raise ValueError(f"a slice of step 1 per dim, got {index}")
            self.ranges[d] = (start, max(start, stop))
        self.shape = tuple(stop - start for start, stop in self.ranges)
        self.dim = max((d for d, r in enumerate(self.ranges) if r != (0, shape[d])), default=-1)
        self.run = 0 if 0 in self.shape else math.prod(self.shape[max(self.dim, 0) :])  # dim -1: the whole shape

    def _offset(self, index: tuple) -> int:
        return sum(i * st for i, st in zip(index, self.strides))

    def run_starts(self):
        """The first element of each run, in order (none for an empty slice)."""
        if self.run == 0:
            return
        outer = [range(start, stop) for start, stop in self.ranges[: max(self.dim, 0)]]
        first = self.ranges[self.dim][0] * self.strides[self.dim] if self.dim >= 0 else 0
        for index in itertools.product(*outer):
            yield self._offset(index) + first

    def spans(self, rows_per_span: int):
        """(the piece's leading rows, the span's first element, its elements, the rows' shape) per `rows_per_span`
        rows of dim 0: the span runs from the rows' first element of the slice to their last one."""
        if self.run == 0:
            return
        starts = tuple(start for start, _ in self.ranges)
        lasts = tuple(stop - 1 for _, stop in self.ranges)
        for r0 in range(0, self.shape[0], rows_per_span):
            r1 = min(r0 + rows_per_span, self.shape[0])
            first = self._offset((starts[0] + r0, *starts[1:]))
            last = self._offset((starts[0] + r1 - 1, *lasts[1:]))
            yield slice(r0, r1), first, last + 1 - first, (r1 - r0, *self.shape[1:])
