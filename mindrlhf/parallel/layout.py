"""`Layout`: how one network is split over the ranks of the job (pipeline stages x data parallel x tensor
parallel).

Rank order follows MindSpore: pipeline stages outermost, then the device matrix ``[dp, tp]`` of a stage with the
tensor-parallel index varying fastest, ``rank = stage * dp * tp + dp_rank * tp + tp_rank``. In a strategy file's
``tensor_map`` the axes are counted from the right, so the tp axis is 0 and the dp axis is 1 (see
:data:`TP_AXIS`, :data:`DP_AXIS`).
"""
from __future__ import annotations

from dataclasses import dataclass

TP_AXIS = 0  # tensor_map value of a dimension split over the tensor-parallel axis
DP_AXIS = 1  # tensor_map value of a dimension split over the data-parallel axis
NOT_SPLIT = -1

_created_groups: set[str] = set()


class LayoutError(ValueError):
    """A layout that does not fit the job (world size, divisibility)."""


@dataclass(frozen=True)
class Layout:
    """Pipeline stages x data-parallel size x tensor-parallel size over `world_size` ranks, seen from `rank`.

    `coords`, the tp and dp groups and the device matrix are those of `rank`'s stage; the pp group links the
    ranks with the same (dp, tp) coordinates across the stages.
    """

    dp: int = 1
    tp: int = 1
    rank: int = 0
    pp: int = 1

    def __post_init__(self):
        if self.dp < 1 or self.tp < 1 or self.pp < 1:
            raise LayoutError(f"invalid layout dp={self.dp} tp={self.tp} pp={self.pp}: sizes must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise LayoutError(f"rank {self.rank} is outside layout {self} (world size {self.world_size})")

    @classmethod
    def for_world(cls, dp: int, tp: int, world_size: int, rank: int, source: str = "layout", pp: int = 1) -> Layout:
        """A layout that must cover exactly `world_size` ranks (the job's)."""
        if dp * tp * pp != world_size:
            stages = f" x pipeline_stage={pp}" if pp > 1 else ""
            raise LayoutError(f"{source}: data_parallel={dp} x model_parallel={tp}{stages} = {dp * tp * pp} ranks, but "
                              f"the job has {world_size}; the train and infer layouts must each cover every rank")
        return cls(dp=dp, tp=tp, rank=rank, pp=pp)

    @classmethod
    def from_config(cls, parallel_config, world_size: int, rank: int, source: str = "parallel_config") -> Layout:
        """The layout a YAML's `parallel_config` places a net in; it must cover the job's `world_size` ranks."""
        return cls.for_world(parallel_config.data_parallel, parallel_config.model_parallel, world_size, rank, source,
                             pp=parallel_config.pipeline_stage)

    # ---------------------------------------------------------------- arithmetic
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage (dp x tp)."""
        return self.dp * self.tp

    @property
    def dev_matrix(self) -> list[int]:
        """MindSpore device matrix of a stage of this layout (outermost axis first)."""
        return [self.dp, self.tp]

    def stage_of(self, rank: int | None = None) -> int:
        """Pipeline stage of `rank` (default: this rank)."""
        return (self.rank if rank is None else rank) // self.stage_size

    @property
    def stage(self) -> int:
        return self.stage_of()

    def coords(self, rank: int | None = None) -> tuple[int, int]:
        """(dp_rank, tp_rank) of `rank` (default: this rank) within its stage."""
        rank = self.rank if rank is None else rank
        return divmod(rank % self.stage_size, self.tp)

    @property
    def dp_rank(self) -> int:
        return self.coords()[0]

    def row_owners(self) -> list[int]:
        """The ranks whose rows are the batch's, in dp order: one tp rank a dp rank (tp peers hold identical rows),
        of the first pipeline stage."""
        return [r for r in range(self.world_size) if self.coords(r)[1] == 0 and self.stage_of(r) == 0]

    @property
    def tp_rank(self) -> int:
        return self.coords()[1]

    def tp_group_ranks(self, rank: int | None = None) -> list[int]:
        dp_rank, _ = self.coords(rank)
        base = self.stage_of(rank) * self.stage_size
        return [base + dp_rank * self.tp + i for i in range(self.tp)]

    def dp_group_ranks(self, rank: int | None = None) -> list[int]:
        _, tp_rank = self.coords(rank)
        base = self.stage_of(rank) * self.stage_size
        return [base + j * self.tp + tp_rank for j in range(self.dp)]

    def pp_group_ranks(self, rank: int | None = None) -> list[int]:
        """The ranks holding the same (dp, tp) coordinates in every stage, first stage first."""
        local = (self.rank if rank is None else rank) % self.stage_size
        return [stage * self.stage_size + local for stage in range(self.pp)]

    def next_stage_pair(self, stage: int, rank: int | None = None) -> list[int]:
        """[the rank of `stage`, the rank of `stage + 1`] with `rank`'s (dp, tp) coordinates: the two ranks an
        activation (forward) or its gradient (backward) moves between."""
        ranks = self.pp_group_ranks(rank)
        return ranks[stage:stage + 2]

    def end_stage_ranks(self, rank: int | None = None) -> list[int]:
        """[the rank of the first stage, the rank of the last] with `rank`'s (dp, tp) coordinates: the two holders
        of a tied embedding, whose gradients they sum."""
        ranks = self.pp_group_ranks(rank)
        return [ranks[0], ranks[-1]]

    def shard_of(self, shards: int, rank: int | None = None) -> int:
        """Index of the shard `rank` holds of a tensor cut into `shards` (a divisor of tp) over the tp axis:
        consecutive tp ranks share a shard (key/value heads when tp exceeds them)."""
        return self.coords(rank)[1] // (self.tp // shards)

    def shard_group_ranks(self, shards: int, rank: int | None = None) -> list[int]:
        """The tp peers of `rank` that hold the same shard of a tensor cut into `shards` over the tp axis."""
        dp_rank, tp_rank = self.coords(rank)
        share = self.tp // shards
        first = self.stage_of(rank) * self.stage_size + dp_rank * self.tp + tp_rank // share * share
        return list(range(first, first + share))

    def shard_group(self, shards: int) -> str | None:
        """Communication group of this rank's peers holding the same one of `shards` shards (None if alone)."""
        ranks = self.shard_group_ranks(shards)
        return group_name(ranks, self.world_size) if len(ranks) > 1 else None

    def __str__(self) -> str:
        return f"dp={self.dp} x tp={self.tp}" + (f" x pp={self.pp}" if self.pp > 1 else "")

    # ---------------------------------------------------------------- groups
    @property
    def tp_group(self) -> str | None:
        """Communication group of this rank's tensor-parallel peers (None when tp == 1)."""
        return group_name(self.tp_group_ranks(), self.world_size) if self.tp > 1 else None

    @property
    def dp_group(self) -> str | None:
        """Communication group of this rank's data-parallel peers (None when dp == 1)."""
        return group_name(self.dp_group_ranks(), self.world_size) if self.dp > 1 else None

    @property
    def pp_group(self) -> str | None:
        """Communication group of this rank's peers in the other stages (None when pp == 1)."""
        return group_name(self.pp_group_ranks(), self.world_size) if self.pp > 1 else None

    def pair_group(self, stage: int) -> str:
        """Communication group of the pair `next_stage_pair(stage)` (this rank must be in it)."""
        return group_name(self.next_stage_pair(stage), self.world_size)

    @property
    def end_stages_group(self) -> str | None:
        """Communication group of `end_stage_ranks` (this rank in the first or the last stage; None when pp == 1)."""
        return group_name(self.end_stage_ranks(), self.world_size) if self.pp > 1 else None

    def init_groups(self) -> Layout:
        """Creates this rank's tp, dp and pp groups, its groups of tp peers sharing a shard for every divisor of
        tp, its pairs with the neighbouring stages and (first and last stage) the pair of end stages (once per
        process; idempotent). Needs `init()` first."""
        shared = [self.shard_group_ranks(shards) for shards in range(2, self.tp) if self.tp % shards == 0]
        pairs = [self.next_stage_pair(stage) for stage in (self.stage - 1, self.stage) if 0 <= stage < self.pp - 1]
        if self.pp > 1 and self.stage in (0, self.pp - 1):
            pairs.append(self.end_stage_ranks())
        for ranks in (self.tp_group_ranks(), self.dp_group_ranks(), self.pp_group_ranks(), *shared, *pairs):
            ensure_group(ranks, self.world_size)
        return self


def group_name(ranks: list[int], world_size: int) -> str:
    """Deterministic group name for a rank list; the whole world maps to MindSpore's world group.

    Two layouts whose groups hold the same ranks share one group.
    """
    if len(ranks) == world_size and world_size > 1:
        from mindspore.communication import GlobalComm
        return GlobalComm.WORLD_COMM_GROUP
    return "mindrlhf_" + "_".join(str(r) for r in ranks)


def ensure_group(ranks: list[int], world_size: int) -> str | None:
    """Creates the group for `ranks` if it is a proper sub-group not yet created; returns its name."""
    if len(ranks) <= 1:
        return None
    name = group_name(ranks, world_size)
    if len(ranks) < world_size and name not in _created_groups:
        from mindspore.communication import create_group
        create_group(name, list(ranks))
        _created_groups.add(name)
    return name


def tensor_parallel_refusal(num_heads: int, n_kv_heads: int, vocab_size: int, intermediate_size: int,
                            tp: int) -> str | None:
    """Why a model cannot be split over `tp` tensor-parallel ranks (a `model_config.` field and the rule it
    breaks), or None when it can: tp divides the query heads, the vocabulary and the MLP width, and the key/value
    heads divide tp or it them (`kv_head_shards`)."""
    for name, value in (("num_heads", num_heads), ("vocab_size", vocab_size),
                        ("intermediate_size", intermediate_size)):
        if value % tp:
            return f"{name}={value} is not divisible by parallel_config.model_parallel={tp}"
    try:
        kv_head_shards(n_kv_heads, tp)
    except LayoutError as err:
        return f"{err} (parallel_config.model_parallel; fewer kv heads than tp ranks are replicated)"
    return None


def tensor_parallel_sizes(num_heads: int, n_kv_heads: int, vocab_size: int, intermediate_size: int,
                          largest: int = 64) -> list[int]:
    """The tensor-parallel sizes up to `largest` a model allows (`tensor_parallel_refusal` finds no reason)."""
    return [tp for tp in range(1, largest + 1)
            if tensor_parallel_refusal(num_heads, n_kv_heads, vocab_size, intermediate_size, tp) is None]


def kv_head_shards(n_kv_heads: int, tp: int) -> int:
    """Into how many shards the key/value heads are cut over tp: tp itself, or with tp > n_kv_heads (a multiple
    of it) one head per rank, each head held by tp / n_kv_heads ranks (Megatron's and vLLM's replication)."""
    if n_kv_heads % tp == 0:
        return tp
    if tp % n_kv_heads == 0:
        return n_kv_heads
    raise LayoutError(f"n_kv_heads={n_kv_heads} and the tensor-parallel size {tp}: one must divide the other")
