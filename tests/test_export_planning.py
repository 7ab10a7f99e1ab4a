"""Memory planner: no two simultaneously live tensors share a byte, never above the naive sum (property tests).

The plans of real programs are checked with the same invariant in test_export.py."""

from hypothesis import given, settings
from hypothesis import strategies as st

from qmoe.export.planning import Request, align, plan_arena


def assert_no_live_overlap(requests: list[Request], offsets: dict[str, int], size: int, alignment: int) -> None:
    for r in requests:
        assert offsets[r.key] % alignment == 0
        assert offsets[r.key] + r.nbytes <= size
    for i, a in enumerate(requests):
        for b in requests[i + 1 :]:
            live_together = a.start <= b.end and b.start <= a.end
            bytes_overlap = offsets[a.key] < offsets[b.key] + b.nbytes and offsets[b.key] < offsets[a.key] + a.nbytes
            assert not (live_together and bytes_overlap and a.nbytes and b.nbytes), (a, b, offsets)


@st.composite
def random_graph_lifetimes(draw):
    """A random DAG in topological order: node i uses a random subset of earlier nodes; a tensor is live from
    its node to its last user (some are pinned for the whole graph, like method inputs and outputs)."""
    n = draw(st.integers(1, 24))
    users = {i: [] for i in range(n)}
    for i in range(1, n):
        for j in draw(st.sets(st.integers(0, i - 1), max_size=3)):
            users[j].append(i)
    pinned = draw(st.sets(st.integers(0, n - 1)))
    sizes = draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n))
    return [
        Request(f"t{i}", sizes[i], 0 if i in pinned else i, n if i in pinned else max(users[i], default=i))
        for i in range(n)
    ]


@settings(max_examples=300, deadline=None)
@given(random_graph_lifetimes(), st.sampled_from([1, 16, 256]))
def test_plan_arena_never_overlaps_live_tensors(requests, alignment):
    offsets, size = plan_arena(requests, alignment)
    assert_no_live_overlap(requests, offsets, size, alignment)
    assert size <= sum(align(r.nbytes, alignment) for r in requests)


def test_disjoint_lifetimes_share_bytes():
    requests = [Request("a", 1000, 0, 1), Request("b", 1000, 2, 3), Request("c", 10, 1, 2)]
    offsets, size = plan_arena(requests, 256)
    assert offsets["a"] == offsets["b"] == 0 and offsets["c"] == 1024
    assert size == 1280  # not 2304: a and b never live together
