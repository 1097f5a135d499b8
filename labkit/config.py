"""The strategy: how a model is spread over the engines.

A :class:`Strategy` is a small keyword-only dataclass, validated on construction, so an
impossible combination fails in the notebook before any engine is touched. Widgets derive
new strategies with ``dataclasses.replace``.

>>> Strategy(dp=2, dp_mode="bucketed", bucket_mb=0.5).world_size
2
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")
DP_MODES = ("naive", "bucketed", "overlap", "ddp")
COMPRESSIONS = ("none", "fp16", "bf16", "int8", "powersgd")


def _check_choice(field: str, value, choices) -> None:
    # a string first: ``array in tuple`` would raise numpy's "truth value is ambiguous"
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"Strategy.{field}={value!r} is unknown; use one of {', '.join(map(repr, choices))}")


def _check_positive_int(field: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Strategy.{field}={value!r} must be a whole number ≥ 1")


# Buckets from 1 KiB (one per small tensor) to 1 TiB (everything in one): outside that range a
# value is a typo (1e-9, 2**70), and inf would make the bucket arithmetic meaningless.
BUCKET_MB_RANGE = (2 ** -10, 2 ** 20)


def _check_bucket_mb(value) -> None:
    low, high = BUCKET_MB_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"Strategy.bucket_mb={value!r} must be a number of MiB from 1/1024 (1 KiB) to "
                         "2**20 (1 TiB), e.g. 1.0 (DDP uses 25)")


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """Degrees of parallelism and the knobs of each; ``dp * pp * tp`` must equal the engines."""

    dp: int = 1
    """Data-parallel degree: replicas that each see 1/dp of the global batch."""
    pp: int = 1
    """Pipeline-parallel degree: consecutive blocks of the model on different ranks."""
    tp: int = 1
    """Tensor-parallel degree (this version supports tp=1)."""
    zero: int = 0
    """ZeRO stage for sharding optimizer state (this version supports zero=0)."""
    schedule: str = "1f1b"
    """Pipeline schedule, used when pp > 1: "gpipe", "1f1b" or "interleaved"."""
    microbatches: int = 1
    """Micro-batches per step; each rank's share of the batch is split into this many."""
    chunks: int = 1
    """Model chunks (virtual stages) per pipeline rank; > 1 only with schedule="interleaved"."""
    dp_mode: str = "overlap"
    """How gradients are averaged over dp: "naive", "bucketed", "overlap" or "ddp"."""
    bucket_mb: float = 1.0
    """Bucket size in MiB for the "bucketed", "overlap" and "ddp" modes."""
    compression: str = "none"
    """Gradient compression on the wire: "none", "fp16", "bf16", "int8" (bucketed, overlap)
    or "powersgd" (ddp); see labkit.compression."""
    error_feedback: bool = True
    """Add what compression rounded away to the next step's gradient: fp16, bf16 and int8 in the
    bucketed and overlap modes, powersgd in ddp (torch's fp16/bf16 DDP hooks have none)."""
    split_at: tuple[int, ...] = ()
    """Pipeline stage boundaries: the block indices where stages 1, 2, … start (pp·chunks − 1
    of them); empty means balanced by parameter count (interleaved: equal block counts)."""
    sync_batchnorm: bool = False
    """Batch-norm statistics over the whole global batch (all dp replicas), as one process
    computes them; without it each replica normalises by its own rows (torch's default under
    DDP, a different model). See labkit.parallel.data.batchnorm."""

    def __post_init__(self) -> None:
        for field in ("dp", "pp", "tp", "microbatches", "chunks"):
            _check_positive_int(field, getattr(self, field))
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("dp_mode", self.dp_mode, DP_MODES)
        _check_choice("compression", self.compression, COMPRESSIONS)
        self._check_compression()
        _check_bucket_mb(self.bucket_mb)
        if not isinstance(self.sync_batchnorm, bool):
            raise ValueError(f"Strategy.sync_batchnorm={self.sync_batchnorm!r} must be True or False")
        if self.tp != 1:
            raise ValueError("Strategy.tp: tensor parallelism is not available in this version; use tp=1")
        if type(self.zero) is not int or self.zero != 0:
            raise ValueError("Strategy.zero: ZeRO sharding is not available in this version; use zero=0")
        self._check_pipeline()

    def _check_compression(self) -> None:
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"Strategy.error_feedback={self.error_feedback!r} must be True or False")
        c, mode = self.compression, self.dp_mode
        if c != "none" and mode == "naive":
            raise ValueError(f"Strategy.compression={c!r} works per bucket, and dp_mode='naive' has no buckets; "
                             "use dp_mode='bucketed', 'overlap' or 'ddp'")
        if c == "int8" and mode == "ddp":
            raise ValueError("Strategy.compression='int8': torch has no int8 DDP hook; use dp_mode='bucketed' "
                             "or 'overlap' (labkit's int8), or compression='fp16'/'bf16'/'powersgd' with ddp")
        if c == "powersgd" and mode != "ddp":
            raise ValueError("Strategy.compression='powersgd' is torch's DDP comm hook; use dp_mode='ddp'")

    def _check_pipeline(self) -> None:
        if not isinstance(self.split_at, tuple):
            if not isinstance(self.split_at, (list, range)):
                raise ValueError(f"Strategy.split_at={self.split_at!r} must be a tuple of block indices")
            object.__setattr__(self, "split_at", tuple(self.split_at))
        if self.split_at:
            at = self.split_at
            stages = self.pp * self.chunks
            if not all(isinstance(b, int) and not isinstance(b, bool) for b in at) or \
                    list(at) != sorted(set(at)) or at[0] < 1:
                raise ValueError(f"Strategy.split_at={at} must be increasing block indices ≥ 1, "
                                 "e.g. (3, 6) for three stages starting at blocks 0, 3 and 6")
            if len(at) != stages - 1:
                raise ValueError(f"Strategy.split_at has {len(at)} boundaries but pp*chunks = {stages} "
                                 f"stages need {stages - 1}; give {stages - 1} or leave split_at empty")
        if self.pp == 1 and (self.chunks > 1 or self.split_at):
            field = "chunks" if self.chunks > 1 else "split_at"
            raise ValueError(f"Strategy.{field}={getattr(self, field)!r} splits a pipeline, and pp=1 has none "
                             f"(it would be ignored); set pp > 1 or leave {field} at its default")
        if self.chunks > 1 and self.schedule != "interleaved":
            raise ValueError(f"Strategy.chunks={self.chunks} needs schedule='interleaved'; "
                             "set chunks=1 or schedule='interleaved'")
        if self.schedule == "interleaved" and self.pp > 1:
            if self.chunks < 2:
                raise ValueError("Strategy.chunks: the interleaved schedule needs chunks ≥ 2 "
                                 "(model chunks per rank); or use schedule='1f1b'")
            if self.microbatches % self.pp:
                raise ValueError(f"Strategy.microbatches={self.microbatches} must be a multiple of "
                                 f"pp={self.pp} for the interleaved schedule")

    @property
    def world_size(self) -> int:
        """Ranks this strategy needs: dp * pp * tp."""
        return self.dp * self.pp * self.tp

    def check_engines(self, engines: int) -> None:
        """Raise ValueError unless this strategy fits exactly ``engines`` ranks."""
        if self.world_size != engines:
            raise ValueError(f"Strategy needs dp*pp*tp = {self.dp}*{self.pp}*{self.tp} = {self.world_size} "
                             f"ranks but the lab has {engines} engines; change the degrees so their "
                             f"product is {engines}, or start the lab with engines={self.world_size}")

    def check_batch(self, batch: int) -> None:
        """Raise ValueError unless the global batch splits evenly over dp and micro-batches."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch={batch!r} must be a whole number ≥ 1")
        if batch % self.dp:
            raise ValueError(f"batch={batch} does not divide by dp={self.dp}; use a multiple of {self.dp}")
        per_rank = batch // self.dp
        if per_rank % self.microbatches:
            raise ValueError(f"each dp rank's batch ({per_rank}) does not divide into microbatches="
                             f"{self.microbatches}; use a batch that is a multiple of "
                             f"{self.dp * self.microbatches} or change microbatches")

    def to_dict(self) -> dict:
        return asdict(self)
