"""Whole-tensor reads of a safetensors shard for the loader, with one host copy per byte.

`safe_open(...).get_tensor(key)` copies the tensor out of the memory-mapped file into a new host tensor, and a
`.to("cuda")` of that pageable tensor copies it again into the driver's staging memory before the transfer, one
tensor at a time (the 35B checkpoint loaded at 1.2 GB/s: README, checkpoint load). Here a shard is mapped once and
a tensor is a view of its bytes in the page cache (the header gives dtype, shape and offsets). To the CPU, the
destination's `copy_` is the one copy. To a GPU, `Stager` moves the bytes through pinned buffers of STAGE_BYTES:
each chunk is copied into a free buffer on the host while the previous chunks' asynchronous host-to-device copies
run, and a buffer is reused once its copy is done (a CUDA event per buffer).
"""

import json
import mmap
import struct
from pathlib import Path

import torch

# safetensors dtype names -> torch dtypes (the ones a checkpoint of this model can hold)
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
STAGE_BYTES = 64 << 20  # per pinned buffer: large enough that a copy's fixed cost is small, two of them in flight


class ShardReader:
    """One safetensors file, memory-mapped (copy-on-write, so tensors are writable views; nothing is written):
    `host_view(key)` is the stored tensor as a view of the mapped bytes (valid until close())."""

    def __init__(self, file: str | Path):
        self.file = Path(file)
        with open(self.file, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        (header_len,) = struct.unpack("<Q", self._map[:8])
        header = json.loads(self._map[8 : 8 + header_len])
        header.pop("__metadata__", None)
        self._entries = header
        self._data = 8 + header_len

    def host_view(self, key: str) -> torch.Tensor:
        entry = self._entries[key]
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        begin, end = entry["data_offsets"]
        if end == begin:  # frombuffer refuses zero bytes
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=self._data + begin)
        return raw.view(dtype).reshape(shape)

    def close(self) -> None:
        self._map.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Stager:
    """Host tensors to `device` through `buffers` staging buffers of `chunk_bytes` (pinned for a GPU; plain on
    the CPU, where the same chunking runs synchronously). to_device() returns a new device tensor whose copies are
    queued on the current stream: the caller's next kernels on that stream see its bytes (and PyTorch's pinned
    allocator keeps a buffer alive until the copies that read it are done)."""

    def __init__(self, device, chunk_bytes: int = STAGE_BYTES, buffers: int = 2):
        self.device = torch.device(device)
        pinned = self.device.type == "cuda"
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(buffers)]
        self._done = [None] * buffers  # the event after each buffer's last host-to-device copy
        self._next = 0

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        flat = host.reshape(-1).view(torch.uint8)
        out = torch.empty(flat.numel(), dtype=torch.uint8, device=self.device)
        chunk = self._buffers[0].numel()
        for start in range(0, flat.numel(), chunk):
            i = self._next
            self._next = (i + 1) % len(self._buffers)
            if self._done[i] is not None:
                self._done[i].synchronize()  # its previous copy has left the buffer
            n = min(chunk, flat.numel() - start)
            buffer = self._buffers[i][:n]
            buffer.copy_(flat[start : start + n])  # the one host copy: page cache -> staging buffer
            out[start : start + n].copy_(buffer, non_blocking=True)
            if self.device.type == "cuda":
                self._done[i] = torch.cuda.Event()
                self._done[i].record()
        return out.view(host.dtype).reshape(host.shape)
