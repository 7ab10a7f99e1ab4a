"""What the profiler sees cross the bus: CUDA memcpy activity (host-to-device, device-to-host), count and bytes,
to check the transfer ledger against. Device-to-device copies are not host<->device traffic and are ignored."""

import json
import os
import tempfile

import torch

DIRECTIONS = {"HtoD": "h2d", "DtoH": "d2h"}


def memcpy_totals(trace_events: list[dict]) -> dict:
    """{h2d: {count, bytes}, d2h: {count, bytes}} of the gpu_memcpy events of a Chrome trace."""
    totals = {d: {"count": 0, "bytes": 0} for d in DIRECTIONS.values()}
    for ev in trace_events:
        if ev.get("cat") != "gpu_memcpy" or ev.get("ph") != "X":
            continue
        kind = next((d for key, d in DIRECTIONS.items() if key in ev.get("name", "")), None)
        if kind is not None:
            totals[kind]["count"] += 1
            totals[kind]["bytes"] += int(ev["args"]["bytes"])
    return totals


def profiled_memcpys(fn) -> tuple[object, dict]:
    """Run fn() under torch.profiler (CUDA activity: kernels and memcpys) -> (fn's result, memcpy_totals)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
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
    totals = {d: {"count": 0, "bytes": 0} for d in DIRECTIONS.values()}
    for t in ledger.transfers:
        if phase is None or t.phase == phase:
            totals[t.direction]["count"] += 1
            totals[t.direction]["bytes"] += t.nbytes
    return totals
