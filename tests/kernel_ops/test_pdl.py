"""kernels/pdl.py: the PDL switch reads QMOE_PDL per call (experiments time both settings in one process)."""

from types import SimpleNamespace

from kernels import pdl


def test_qmoe_pdl_is_read_per_call(monkeypatch):
    """Setting and unsetting QMOE_PDL in this process turns PDL off and on for the next call."""
    monkeypatch.setattr(pdl, "_INTERPRET", False)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    cuda_tensor = SimpleNamespace(is_cuda=True, get_device=lambda: 0)
    monkeypatch.delenv("QMOE_PDL", raising=False)
    assert pdl.pdl(cuda_tensor)
    monkeypatch.setenv("QMOE_PDL", "0")
    assert not pdl.pdl(cuda_tensor)
    monkeypatch.setenv("QMOE_PDL", "1")
    assert pdl.pdl(cuda_tensor)
    monkeypatch.setenv("QMOE_PDL", "0")
    assert not pdl.pdl(cuda_tensor)
    monkeypatch.delenv("QMOE_PDL")
    assert pdl.pdl(cuda_tensor)
    assert not pdl.pdl(SimpleNamespace(is_cuda=False))
