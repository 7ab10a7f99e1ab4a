"""TransferLedger: every copy the runtime makes between memory spaces (host<->device) or between two buffers of
one device, with direction, bytes, method and step; and, across GPUs, every collective this rank runs (kind,
bytes, method, group), recorded by qmoe.parallel.collectives.record."""

from collections import defaultdict
from dataclasses import dataclass

HOST = "cpu"  # the host memory space; any other space ("cuda:0", the staged "cpu:1") is a device's
DIRECTIONS = ("h2d", "d2h", "d2d")
# copy_node: an explicit h2d/d2h node of an exported method; delegate: the delegate's own copies of CPU
# inputs/outputs when device memory planning is off; runner: the runner's copies (token reads and writes, and an
# input a caller passes that is not its planned buffer).
SOURCES = ("copy_node", "delegate", "runner")
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "all_to_all")


def direction(src_space: str, dst_space: str) -> str | None:
    """The transfer a copy from `src_space` to `dst_space` is; None for host to host (not a transfer)."""
    if src_space == HOST:
        return None if dst_space == HOST else "h2d"
    return "d2h" if dst_space == HOST else "d2d"


def transfer(dst, src, src_space: str, dst_space: str, ledger, method: str, source: str, non_blocking=False):
    """dst.copy_(src) -> dst: the one place the runtime copies a tensor between buffers, recorded in `ledger`
    (if any) unless it is host to host. non_blocking: a device-to-pinned-host copy returns before it is done."""
    kind = direction(src_space, dst_space)
    if kind is not None and ledger is not None:
        ledger.record(kind, src.nbytes, method, source)
    return dst.copy_(src, non_blocking=non_blocking)


@dataclass(frozen=True)
class Transfer:
    direction: str
    nbytes: int
    method: str
    phase: str  # "prefill" | "decode" | "warmup"
    step: int
    source: str


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce | all_gather | all_to_all
    nbytes: int  # all_reduce: the reduced tensor; all_gather: the gathered output
    method: str
    phase: str
    step: int
    group: str  # "tp" | "world"


def tally(records, field: str) -> dict:
    """Count and bytes of records (transfers or collectives) per "phase/method/<field>" and "phase/all/<field>"."""
    per = defaultdict(lambda: {"count": 0, "bytes": 0})
    for r in records:
        value = getattr(r, field)
        for key in (f"{r.phase}/{r.method}/{value}", f"{r.phase}/all/{value}"):
            per[key]["count"] += 1
            per[key]["bytes"] += r.nbytes
    return per


class TransferLedger:
    def __init__(self):
        self.transfers: list[Transfer] = []
        self.collectives: list[Collective] = []
        self.phase, self.step = "prefill", 0

    def record(self, direction: str, nbytes: int, method: str, source: str) -> None:
        if direction not in DIRECTIONS or source not in SOURCES:
            raise ValueError(f"bad transfer {direction!r} from {source!r}")
        self.transfers.append(Transfer(direction, int(nbytes), method, self.phase, self.step, source))

    def record_collective(self, kind: str, nbytes: int, method: str, group: str) -> None:
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"bad collective {kind!r}")
        self.collectives.append(Collective(kind, int(nbytes), method, self.phase, self.step, group))

    def at(self, phase: str, step: int) -> "TransferLedger":
        """Tag the transfers recorded from now on with this phase and step; returns self."""
        self.phase, self.step = phase, step
        return self

    def clear(self) -> None:
        self.transfers.clear()
        self.collectives.clear()

    def inter_gpu(self, decode_tokens: int) -> dict:
        """Collectives of this rank: prefill totals per kind; per generated token of decode, per kind and per
        method x kind (count and bytes)."""
        per = tally(self.collectives, "kind")
        zero = {"count": 0, "bytes": 0}
        out = {"prefill": {k: per.get(f"prefill/all/{k}", zero) for k in COLLECTIVE_KINDS}}
        if decode_tokens > 0:
            methods = sorted({c.method for c in self.collectives if c.phase == "decode"})
            out["per_decode_token"] = {
                k: {f: v / decode_tokens for f, v in per.get(f"decode/all/{k}", zero).items()} for k in COLLECTIVE_KINDS
            }
            out["per_decode_token_by_method"] = {
                m: {
                    k: {f: v / decode_tokens for f, v in per.get(f"decode/{m}/{k}", zero).items()}
                    for k in COLLECTIVE_KINDS
                }
                for m in methods
            }
        return out

    def summary(self, decode_tokens: int) -> dict:
        """Counts and bytes per phase x method x direction; prefill totals; decode per generated token, in all and
        per method (decode_tokens: the tokens produced by decode steps, all rows)."""
        per = tally(self.transfers, "direction")
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
        if self.collectives:
            out["inter_gpu"] = self.inter_gpu(decode_tokens)
        return out
