"""What the profiler sees copied: CUDA memcpy activity (host-to-device, device-to-host, device-to-device), count
and bytes, to check the transfer ledger against. A device-to-device memcpy launched inside a delegate call (its
profiler range, program.DELEGATE_RANGE: an internal copy of the exported graph) is the delegate's own work,
like a kernel, and is not counted; the executor's copy of an output into its planned buffer runs outside that
range and is counted, as the ledger counts it; a host<->device memcpy is counted wherever it is launched."""

import json
import os
import tempfile

import torch

from qmoe.export.program import DELEGATE_RANGE
from qmoe.runtime.ledger import DIRECTIONS

KINDS = {"HtoD": "h2d", "DtoH": "d2h", "DtoD": "d2d"}


def _zero() -> dict:
    return {d: {"count": 0, "bytes": 0} for d in DIRECTIONS}


def memcpy_totals(trace_events: list[dict]) -> dict:
    """{h2d, d2h, d2d: {count, bytes}} of the gpu_memcpy events of a Chrome trace, less the DtoD memcpys whose
    launch (the runtime call with the same correlation id) lies inside a DELEGATE_RANGE on its thread."""
    ranges = [
        (ev["tid"], ev["ts"], ev["ts"] + ev["dur"])
        for ev in trace_events
        if ev.get("ph") == "X" and ev.get("name") == DELEGATE_RANGE and ev.get("cat") == "user_annotation"
    ]
    launches = {
        ev["args"]["correlation"]: ev
        for ev in trace_events
        if ev.get("cat") == "cuda_runtime" and "correlation" in ev.get("args", {})
    }

    def in_delegate(ev) -> bool:
        launch = launches.get(ev["args"].get("correlation"))
        return launch is not None and any(t == launch["tid"] and s <= launch["ts"] <= e for t, s, e in ranges)

    totals = _zero()
    for ev in trace_events:
        if ev.get("cat") != "gpu_memcpy" or ev.get("ph") != "X":
            continue
        kind = next((d for key, d in KINDS.items() if key in ev.get("name", "")), None)
        if kind is None or (kind == "d2d" and in_delegate(ev)):
            continue
        totals[kind]["count"] += 1
        totals[kind]["bytes"] += int(ev["args"]["bytes"])
    return totals


def profiled_memcpys(fn) -> tuple[object, dict]:
    """Run fn() under torch.profiler (CPU ranges and CUDA activity) -> (fn's result, memcpy_totals)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return result, memcpy_totals(events)


def ledger_totals(ledger, phase: str | None = None) -> dict:
    """The same totals from a TransferLedger (optionally one phase)."""
    totals = _zero()
    for t in ledger.transfers:
        if phase is None or t.phase == phase:
            totals[t.direction]["count"] += 1
            totals[t.direction]["bytes"] += t.nbytes
    return totals
