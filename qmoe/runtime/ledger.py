"""TransferLedger: every copy the runtime makes between memory spaces (host<->device) or between two buffers of
one device, with direction, bytes, method and step."""

from collections import defaultdict
from dataclasses import dataclass

HOST = "cpu"  # the host memory space; any other space ("cuda:0", the staged "cpu:1") is a device's
DIRECTIONS = ("h2d", "d2h", "d2d")
# copy_node: an explicit h2d/d2h node of an exported method; delegate: the delegate's own copies of CPU
# inputs/outputs when device memory planning is off; runner: the runner's copies (token reads and writes, and an
# input a caller passes that is not its planned buffer).
SOURCES = ("copy_node", "delegate", "runner")


def direction(src_space: str, dst_space: str) -> str | None:
    """The transfer a copy from `src_space` to `dst_space` is; None for host to host (not a transfer)."""
    if src_space == HOST:
        return None if dst_space == HOST else "h2d"
    return "d2h" if dst_space == HOST else "d2d"


def transfer(dst, src, src_space: str, dst_space: str, ledger, method: str, source: str):
    """dst.copy_(src) -> dst: the one place the runtime copies a tensor between buffers, recorded in `ledger`
    (if any) unless it is host to host."""
    kind = direction(src_space, dst_space)
    if kind is not None and ledger is not None:
        ledger.record(kind, src.nbytes, method, source)
    return dst.copy_(src)


@dataclass(frozen=True)
class Transfer:
    direction: str
    nbytes: int
    method: str
    phase: str  # "prefill" | "decode" | "warmup"
    step: int
    source: str


class TransferLedger:
    def __init__(self):
        self.transfers: list[Transfer] = []
        self.phase, self.step = "prefill", 0

    def record(self, direction: str, nbytes: int, method: str, source: str) -> None:
        if direction not in DIRECTIONS or source not in SOURCES:
            raise ValueError(f"bad transfer {direction!r} from {source!r}")
        self.transfers.append(Transfer(direction, int(nbytes), method, self.phase, self.step, source))

    def at(self, phase: str, step: int) -> "TransferLedger":
        """Tag the transfers recorded from now on with this phase and step; returns self."""
        self.phase, self.step = phase, step
        return self

    def clear(self) -> None:
        self.transfers.clear()

    def summary(self, decode_tokens: int) -> dict:
        """Counts and bytes per phase x method x direction; prefill totals; decode per generated token, in all and
        per method (decode_tokens: the tokens produced by decode steps, all rows)."""
        per = defaultdict(lambda: {"count": 0, "bytes": 0})
        for t in self.transfers:
            for key in (f"{t.phase}/{t.method}/{t.direction}", f"{t.phase}/all/{t.direction}"):
                per[key]["count"] += 1
                per[key]["bytes"] += t.nbytes
        zero = {"count": 0, "bytes": 0}
        out = {
            "measured": True,
            "by_phase_method_direction": dict(per),
            "prefill": {d: per.get(f"prefill/all/{d}", zero) for d in DIRECTIONS},
        }
        if decode_tokens > 0:
            methods = sorted({t.method for t in self.transfers if t.phase == "decode"})
            out["per_decode_token"] = {
                d: {k: v / decode_tokens for k, v in per.get(f"decode/all/{d}", zero).items()} for d in DIRECTIONS
            }
            out["per_decode_token_by_method"] = {
                m: {d: {k: v / decode_tokens for k, v in per.get(f"decode/{m}/{d}", zero).items()} for d in DIRECTIONS}
                for m in methods
            }
        return out
