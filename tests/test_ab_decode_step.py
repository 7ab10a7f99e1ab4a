"""experiments/ab_decode_step.py's variants run the checkout's launch tables: a kernel file reads its table
relative to itself, so a copy under .ab/ found none and ran the op's default configs (at M = 1 the MoE's two-wave
grids, +220 us a step on the H200), and an A/B compared configs instead of code."""

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ab(monkeypatch):
    """experiments/ab_decode_step.py, imported when a test runs (not at collection, in every worker) with
    experiments/ on sys.path for that test only."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    return importlib.import_module("ab_decode_step")


@pytest.mark.parametrize(
    "group, tables",
    [("moe", ("CONFIG_TABLE",)), ("linear", ("CONFIG_TABLE",)), ("attention", ("DECODE_OPTIONS", "PREFILL_OPTIONS"))],
)
def test_a_variant_file_shares_the_checkouts_tables(ab, tmp_path, monkeypatch, group, tables):
    checkout = __import__(f"kernels.{group}.triton", fromlist=["triton"])
    copy = tmp_path / f"{group}_copy.py"  # no configs/ beside it: on its own it reads no table
    copy.write_text((ROOT / f"kernels/{group}/triton.py").read_text())
    for name in tables:  # a table the checkout holds (on the CPU the real ones are empty: no GPU to key them)
        monkeypatch.setitem(getattr(checkout, name), "probe", {"1": {"BLOCK_K": 64}})
    name, modules = ab.parse_variant(f"copy:{group}={copy}")
    variant = modules[group]
    assert name == "copy" and variant is not checkout
    for table in tables:
        assert getattr(variant, table) == getattr(checkout, table)
        assert getattr(variant, table) is not getattr(checkout, table)  # a copy: the variant's own dict
