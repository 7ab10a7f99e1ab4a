"""Layout: which slice of every sharded dimension this rank holds (torch-free: settings validate with it).

Ranks form a tp x ep grid, rank = ep_rank * tp + tp_rank. The mixers (attention, DeltaNet) are tensor parallel
over the tp ranks of one ep row (replicated across rows) and end in an all-reduce over that row; the MoE block
is sharded over every rank (routed experts: E / ep per row, each expert's intermediate dim split tp ways; the
shared expert's intermediate dim split over the world) and ends in one all-reduce over the world; lm_head is
vocab-parallel over the world. The router, norms and embedding are replicated.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    rank: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.ep

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def heads(self, n: int) -> tuple[int, int]:
        """(first, count) of `n` heads on this rank's tp slice; with tp > n each head is replicated on tp / n
        ranks (count 1), so that grouped heads (GQA, DeltaNet's value-head groups) stay with their key head."""
        if self.tp > n:
            return self.tp_rank // (self.tp // n), 1
        return self.tp_rank * (n // self.tp), n // self.tp

    def experts(self, n: int) -> tuple[int, int]:
        """(first, count) of the routed experts this rank's ep row holds."""
        return self.ep_rank * (n // self.ep), n // self.ep

    def tp_part(self, n: int) -> tuple[int, int]:
        """(first, count) of a dimension split tp ways (an expert's intermediate dim)."""
        return self.tp_rank * (n // self.tp), n // self.tp

    def world_part(self, n: int) -> tuple[int, int]:
        """(first, count) of a dimension split over every rank (shared-expert intermediate dim, vocabulary)."""
        return self.rank * (n // self.world), n // self.world


SINGLE = Layout()  # one process: nothing sharded


def heads_error(n: int, tp: int) -> str | None:
    """Why `n` heads cannot be split `tp` ways (None if they can): tp must divide n, or n divide tp."""
    if n % tp == 0 or tp % n == 0:
        return None
    return f"{n} is not divisible by parallel.tp={tp}, nor parallel.tp by it"


def fp8_layout_errors(arch: dict, tp: int, ep: int, block: int = 128) -> list[str]:
    """'model.arch.<field>: ...' for each row-parallel projection whose K would be split off the fp8 scale blocks
    (every `block` columns): a rank then holds exactly the slice of the unsharded FP8 model (values and scales;
    expert parallel slices whole experts, whose blocks stay whole)."""
    world = tp * ep
    k_splits = [  # (field, K of the row-parallel projection it sets, ways it is split)
        ("head_dim", arch["num_attention_heads"] * arch["head_dim"], tp),  # attention o_proj
        ("linear_value_head_dim", arch["linear_num_value_heads"] * arch["linear_value_head_dim"], tp),  # out_proj
        ("moe_intermediate_size", arch["moe_intermediate_size"], tp),  # the experts' down
        ("shared_expert_intermediate_size", arch["shared_expert_intermediate_size"], world),  # the shared down
    ]
    errors = []
    for field, k, ways in k_splits:
        if (k // ways) % block:
            errors.append(f"model.arch.{field}: fp8 needs each rank's share of the {k} columns it sets to be a "
                          f"multiple of {block} (the fp8 scale blocks), got {k} / {ways} = {k // ways}")  # fmt: skip
    return errors


def layout_errors(arch: dict, tp: int, ep: int) -> list[str]:
    """'model.arch.<field>: ...' for each dimension of the architecture that the tp x ep layout cannot split."""
    world = tp * ep
    nq, nkv = arch["num_attention_heads"], arch["num_key_value_heads"]
    nk, nv = arch["linear_num_key_heads"], arch["linear_num_value_heads"]
    checks = [
        ("num_attention_heads", nq % tp == 0, f"{nq} is not divisible by parallel.tp={tp}"),
        ("num_key_value_heads", heads_error(nkv, tp) is None, f"{heads_error(nkv, tp)}"),
        ("linear_num_value_heads", nv % tp == 0, f"{nv} is not divisible by parallel.tp={tp}"),
        ("linear_num_key_heads", heads_error(nk, tp) is None, f"{heads_error(nk, tp)}"),
        ("num_experts", arch["num_experts"] % ep == 0, f"{arch['num_experts']} is not divisible by parallel.ep={ep}"),
        (
            "moe_intermediate_size",
            arch["moe_intermediate_size"] % tp == 0,
            f"{arch['moe_intermediate_size']} is not divisible by parallel.tp={tp}",
        ),
        (
            "shared_expert_intermediate_size",
            arch["shared_expert_intermediate_size"] % world == 0,
            f"{arch['shared_expert_intermediate_size']} is not divisible by parallel.tp x parallel.ep={world}",
        ),
        ("vocab_size", arch["vocab_size"] % world == 0, f"{arch['vocab_size']} is not divisible by tp x ep={world}"),
    ]
    return [f"model.arch.{key}: {why}" for key, ok, why in checks if not ok]
