"""The strategy: how a model is spread over the engines.

A :class:`Strategy` is a small keyword-only dataclass, validated on construction, so an
impossible combination fails in the notebook before any engine is touched. Widgets derive
new strategies with ``dataclasses.replace``.

Each field is declared once, with :func:`setting`: its docstring, its axis, its choices and
how a control or a run label shows it. The CLI's flags (:func:`labkit.cli`), the dashboard's
controls and run labels (:meth:`Strategy.label`) are derived from that metadata, so a new
field is one declaration here. Each axis checks its own fields in its own package
(``labkit/parallel/<axis>/axis.py``); ``Strategy.__post_init__`` calls every axis of the
registry (:data:`labkit.parallel.axes.AXES`) in turn, then the compute rule
(``labkit.parallel.check_compute``) (torchtitan: "configs live near their owner").

>>> Strategy(dp=2, dp_mode="bucketed", bucket_mb=0.5).world_size
2
>>> Strategy(dp=2, pp=2, microbatches=4).label()
'dp=2 pp=2 1f1b mb=4 overlap 1 MiB'
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from .parallel import context as _context
from .parallel import expert as _expert
from .parallel import zero as _zero
from .grid import ORDER, check_order
from .parallel.axes import AXES, grid_of
from .parallel.axes import check_strategy as _check_axes
from .parallel.data import COMPRESSIONS, DP_MODES
from .parallel.pipeline.schedules import SCHEDULES
from .parallel import PRECISIONS, RECOMPUTE_MODES, check_compute
from .parallel.tensor.axis import TP_MODES

__all__ = ["Strategy", "setting", "strategy_fields", "SCHEDULES", "DP_MODES", "COMPRESSIONS", "TP_MODES"]


def setting(default, doc: str, *, axis: str, choices=None, control=None, title: str | None = None,
            label: str | None = None, show: str = "axis"):
    """A Strategy field and what every view needs to know about it.

    ``axis``: "dp", "pp", "tp", "zero" (the field matters when that axis is on), "degrees", or
    "compute" (how every stage computes: precision, recompute; always on).
    ``control``: how the dashboard shows it: "degree", "choice", "bool", ("int", lo, hi),
    ("log2", lo, hi), or None (no control; the CLI still has a flag).
    ``label``: a format for run labels ("dp={}"); ``show``: "always", "axis" (while the axis
    is on) or "changed" (while the axis is on and the value is not the default).
    """
    return field(default=default, metadata={"doc": doc, "axis": axis, "choices": choices, "control": control,
                                             "title": title, "label": label, "show": show})


def _check_choice(name: str, value, choices) -> None:
    # a string first: ``array in tuple`` would raise numpy's "truth value is ambiguous"
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"Strategy.{name}={value!r} is unknown; use one of {', '.join(map(repr, choices))}")


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Strategy.{name}={value!r} must be a whole number ≥ 1")


# Each axis's own rule in registry order, then how every stage computes: Strategy.__post_init__.
AXIS_CHECKS = (_check_axes, check_compute)


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """Degrees of parallelism and the knobs of each; ``dp * pp * cp * tp`` must equal the engines."""

    dp: int = setting(1, "Data-parallel degree: replicas that each see 1/dp of the global batch.",
                      axis="degrees", control="degree", label="dp={}", show="always")
    pp: int = setting(1, "Pipeline-parallel degree: consecutive blocks of the model on different ranks.",
                      axis="degrees", control="degree", label="pp={}")
    tp: int = setting(1, "Tensor-parallel degree: each layer's matrices split over tp ranks (Megatron-LM).",
                      axis="degrees", control="degree", label="tp={}")
    order: str = setting(ORDER, "Rank order, the fastest-varying axis first: the default keeps tp (then cp) inside a "
                                "node, as ranks fill nodes in order; 'dp,cp,pp,tp' puts tp across nodes on purpose "
                                "(labkit.grid).", axis="degrees", label="order={}", show="changed")
    ep: int = setting(1, "Expert-parallel degree: each MoE layer's experts split over ep consecutive dp ranks, "
                         "tokens sent to them and back by all-to-all (DeepSeek-V3, Megatron-Core); divides dp "
                         "and takes no ranks of its own.", axis="degrees", label="ep={}")
    ep_overlap: str = setting("none", "ep > 1: 'microbatch' cuts each MoE layer's tokens in two, one half's "
                                      "all-to-all in flight while the other's experts compute, forward and "
                                      "backward (DeepSeek-V3's two-micro-batch overlap).", axis="ep",
                              choices=_expert.EP_OVERLAPS, title="ep overlap",
                              label="ep_overlap={}", show="changed")
    cp: int = setting(1, "Context-parallel degree: every sequence cut over cp ranks, attention computed across "
                         "them (labkit.parallel.context); the model's attention must opt in.",
                      axis="degrees", label="cp={}")
    cp_mode: str = setting("ring", "How attention crosses the cp ranks: 'ring' (K/V blocks passed round the ring "
                                   "under each round's compute), 'allgather' (K/V gathered once, Llama 3) or "
                                   "'ulysses' (all-to-all to head-split and back; heads divide by cp).",
                           axis="cp", choices=_context.CP_MODES, label="{}")
    cp_balance: bool = setting(True, "Causal load balancing: rank i holds sequence chunks i and 2·cp−1−i (equal "
                                     "work under the causal mask); False: contiguous slices.", axis="cp",
                               label="cp_balance={}", show="changed")
    tp_mode: str = setting("megatron", "Tensor parallelism by hand ('megatron': f/g over labkit.comm, on the "
                                       "timeline) or torch's parallelize_module ('dtensor').", axis="tp",
                           choices=TP_MODES, control="choice", title="tp mode", label="{}")
    sequence_parallel: bool = setting(False, "Megatron mode: LayerNorm regions cut along the sequence "
                                             "(all-gather / reduce-scatter in place of f and g).", axis="tp",
                                      control="bool", title="sequence parallel", label="sp", show="changed")
    zero: int = setting(0, "ZeRO stage over the dp group: 1 shards the optimizer state, 2 also the gradients, "
                           "3 also the parameters (labkit.parallel.zero).", axis="zero",
                        control=("int", 0, 3), label="zero={}", show="changed")
    zero_mode: str = setting("labkit", "Sharding by hand ('labkit') or torch's fully_shard ('fsdp2'; zero=2 or 3).",
                             axis="zero", choices=_zero.ZERO_MODES, control="choice", title="zero mode",
                             label="{}", show="changed")
    prefetch: int = setting(0, "zero=3: blocks whose all-gather is issued ahead (the forward overlap).",
                            axis="zero", control=("int", 0, 2), label="prefetch={}", show="changed")
    dp_shard: int | None = setting(None, "HSDP: ZeRO shards inside runs of dp_shard consecutive dp ranks, the runs "
                                         "replicas whose gradients are all-reduced (FSDP's HYBRID_SHARD); None: "
                                         "shard over the whole dp group.", axis="zero",
                                   label="dp_shard={}", show="changed")
    schedule: str = setting("1f1b", "Pipeline schedule, used when pp > 1.", axis="pp", choices=SCHEDULES,
                            control="choice", label="{}")
    microbatches: int = setting(1, "Micro-batches per step; each rank's share of the batch is split into this many.",
                                axis="pp", control=("int", 1, 16), title="micro-batches", label="mb={}",
                                show="always")
    chunks: int = setting(1, "Model chunks (virtual stages) per pipeline rank; > 1 only with "
                             "schedule='interleaved'.", axis="pp", control=("int", 1, 4), title="chunks / rank",
                          label="chunks={}", show="changed")
    dp_mode: str = setting("overlap", "How gradients are averaged over dp.", axis="dp", choices=DP_MODES,
                           control="choice", title="dp mode", label="{}")
    bucket_mb: float = setting(1.0, "Bucket size in MiB for the 'bucketed', 'overlap' and 'ddp' modes.",
                               axis="dp", control=("log2", -6, 4), title="bucket (MiB)", label="{:g} MiB")
    compression: str = setting("none", "Gradient compression on the wire: fp16, bf16, int8, fp8_e4m3, fp8_e5m2 "
                                       "(int8 and fp8: bucketed, overlap) or powersgd (ddp); see "
                                       "labkit.compression.", axis="dp",
                               choices=COMPRESSIONS, control="choice", label="{}", show="changed")
    error_feedback: bool = setting(True, "Add what compression rounded away to the next step's gradient: fp16, "
                                         "bf16, int8 and fp8 in the bucketed and overlap modes, powersgd in ddp "
                                         "(torch's fp16/bf16 DDP hooks have none).", axis="dp", control="bool",
                                   title="error feedback", label="error_feedback={}", show="changed")
    split_at: tuple[int, ...] = setting((), "Pipeline stage boundaries: the block indices where stages 1, 2, … "
                                            "start (pp·chunks − 1 of them); empty means balanced by parameter "
                                            "count (interleaved: equal block counts).", axis="pp",
                                        label="split_at={}", show="changed")
    sync_batchnorm: bool = setting(False, "Batch-norm statistics over the whole global batch (all dp replicas), as "
                                          "one process computes them; without it each replica normalises by its "
                                          "own rows (torch's default under DDP, a different model). See "
                                          "labkit.parallel.data.batchnorm.", axis="dp", control="bool",
                                   title="sync batch norm", label="sync_batchnorm={}", show="changed")
    # How each stage computes, whatever the degrees (labkit.parallel.precision, .recompute).
    precision: str = setting("fp32", "Compute precision under autocast, fp32 master weights: fp32, bf16, or fp16 "
                                     "(dynamic loss scaling; skipped steps in run.metrics).", axis="compute",
                             choices=PRECISIONS, control="choice", label="{}", show="changed")
    recompute: str = setting("none", "Activation recomputation per stage: none, full (every block) or selective "
                                     "(submodules named 'core': attention's softmax region).", axis="compute",
                             choices=RECOMPUTE_MODES, control="choice", label="recompute={}", show="changed")

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type in ("int", int) and f.name not in ("zero", "prefetch"):   # 0 allowed; zero checks them
                _check_positive_int(f.name, getattr(self, f.name))
            if f.metadata["choices"] is not None:
                _check_choice(f.name, getattr(self, f.name), f.metadata["choices"])
        for check in AXIS_CHECKS:
            check(self)
        try:
            check_order(self.order)
        except ValueError as error:
            raise ValueError(f"Strategy.{error}") from None

    @property
    def world_size(self) -> int:
        """Ranks this strategy needs: the product of the degrees of the axes that take ranks of
        their own (dp * pp * cp * tp; ep and zero live inside dp)."""
        return self.grid().world_size

    def grid(self):
        """The rank grid this strategy lays out (:class:`labkit.grid.ParallelDims`)."""
        return grid_of(self)

    def axis_on(self, axis: str) -> bool:
        """Whether ``axis`` (an axis of the registry: "dp", "pp", "tp", "cp", "ep", "zero"; or
        "degrees", "compute") does anything here: a degree above 1, or zero > 0."""
        if axis not in {a.NAME for a in AXES}:
            return True
        return getattr(self, axis) > (0 if axis == "zero" else 1)

    def label(self) -> str:
        """The settings that matter for these degrees, short: "dp=2 pp=2 1f1b mb=4 overlap 1 MiB"."""
        parts = []
        for f in strategy_fields():
            m, value = f.metadata, getattr(self, f.name)
            if m["label"] is None or m["show"] != "always" and not self._shows(f, value):
                continue
            parts.append(m["label"].format(value))
        return " ".join(parts)

    def _shows(self, f, value) -> bool:
        m = f.metadata
        on = self.axis_on(f.name if m["axis"] == "degrees" else m["axis"])
        if not self._averages_by(f.name):
            return False
        return on and (m["show"] == "axis" or value != f.default)

    def _averages_by(self, name: str) -> bool:
        """Whether ``dp_mode`` or ``bucket_mb`` is what averages the gradients in this run: with
        zero > 0 the sharded sync replaces the dp mode; labkit's ZeRO-1/2 still cut buckets of
        ``bucket_mb``, while ZeRO-3 gathers a block at a time and FSDP2 is torch's own, so a
        label saying "overlap 1 MiB" there would name something that did not run."""
        if name == "dp_mode":
            return self.zero == 0
        if name == "bucket_mb":
            if self.zero:
                return self.zero_mode == "labkit" and self.zero < 3
            return self.dp_mode != "naive"          # the naive mode has no buckets
        return True

    def check_engines(self, engines: int) -> None:
        """Raise ValueError unless this strategy fits exactly ``engines`` ranks."""
        if self.world_size != engines:
            cp = f"*{self.cp}" if self.cp > 1 else ""
            raise ValueError(f"Strategy needs dp*pp*{'cp*' if cp else ''}tp = {self.dp}*{self.pp}{cp}*{self.tp} = "
                             f"{self.world_size} "
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


def strategy_fields() -> tuple:
    """Strategy's fields with their metadata, in declaration order (CLI, dashboard, labels)."""
    return fields(Strategy)
