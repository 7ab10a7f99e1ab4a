"""TransferLedger: every host<->device copy the runtime makes, with direction, bytes, method and step."""

from collections import defaultdict
from dataclasses import dataclass

DIRECTIONS = ("h2d", "d2h")
# copy_node: an explicit h2d/d2h node of an exported method; delegate: the delegate's own copies of CPU
# inputs/outputs when device memory planning is off; runner: the runner's token reads and writes.
SOURCES = ("copy_node", "delegate", "runner")


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
        """Counts and bytes per phase x method x direction, and per generated token in decode."""
        per = defaultdict(lambda: {"count": 0, "bytes": 0})
        for t in self.transfers:
            for key in (f"{t.phase}/{t.method}/{t.direction}", f"{t.phase}/all/{t.direction}"):
                per[key]["count"] += 1
                per[key]["bytes"] += t.nbytes
        out = {"measured": True, "by_phase_method_direction": dict(per)}
        decode = {d: per.get(f"decode/all/{d}", {"count": 0, "bytes": 0}) for d in DIRECTIONS}
        if decode_tokens > 0:
            out["per_decode_token"] = {
                d: {"count": v["count"] / decode_tokens, "bytes": v["bytes"] / decode_tokens} for d, v in decode.items()
            }
        return out
