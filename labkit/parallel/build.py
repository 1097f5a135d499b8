"""A run on one rank: the spec that travels from the notebook, and the one builder that
composes the axes into a job, in one commented order.

Order of composition (picotron: TP → PP → DP; torchtitan: TP → AC → compile → FSDP). The
axes themselves, and the order their hooks run in, are the registry :data:`.axes.AXES`:

1. the model, built under the run's seed (so every rank starts from the reference's weights):
   whole, or, for a model too big to build whole on every engine, on ``meta`` with only this
   rank's pieces materialised, the same values (:mod:`.materialize`, ``RunSpec.init``);
2. every axis's ``shape_model`` on the whole model, in registry order: tp splits the planned
   layers, cp routes a transformers model's attention, dp syncs batch norm when asked, ep
   keeps this rank's experts; and every axis's ``shape_data`` (cp: this rank's tokens);
3. the pipeline split: which blocks form each stage, and which stages live on this rank
   (``pp == 1``: one stage holding every block);
4. per stage, the gradient sync, every axis's ``wrap_sync`` in registry order: dp's average
   over the ranks holding the same blocks (the four modes; dp = 1: none), zero's sharded sync
   in its place (:mod:`.zero`), ep's experts averaged apart around it; and for a weight tied
   across the first and last stage, the embedding group's sum (:mod:`.pipeline.tied`);
5. one :class:`~labkit.parallel.executor.Executor` running this rank's schedule actions, with
   the run's precision (autocast, fp16 loss scaling: :mod:`.precision`) and optimizer (with
   zero: over this rank's shards).

Activation recomputation (:mod:`.recompute`) is applied per stage in step 4, before the sync
wraps the stage's blocks.

    >>> job = build_job(spec, groups, recorder, device)     # engine side (labkit.engine.setup_run)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from ..training import build_optimizer, resolve_data, resolve_loss
from ..record.instrument import ActivationMeter, BackwardSpan, instrument_backward, instrument_forward
from .axes import AXES
from .executor import Executor, Stage, global_batch  # noqa: F401 (global_batch: the one rows check)
from .pipeline.schedules import build_schedule, global_stage, placement_of
from .pipeline.stages import PipeChannel, stage_blocks, stage_module
from .blocks import blocks_path as find_path, find_blocks, units
from .materialize import build_rank_model
from .precision import build_precision
from .recompute import apply_recompute
from .pipeline.tied import build_tied_sync

if TYPE_CHECKING:       # a name in annotations only: config imports each axis's checks from parallel/
    from ..config import Strategy


@dataclass
class RunSpec:
    """Everything a rank needs to build its part of a run (pickled to the engines)."""

    strategy: Strategy
    model: Any
    data: Any = None
    loss: Any = "mse"
    batch: int = 64
    steps: int = 5
    lr: float = 0.1
    momentum: float = 0.0
    seed: int = 0
    record: bool = True
    extra: dict = field(default_factory=dict)
    allow_nonfinite: bool = False
    """Carry on through NaN/inf losses (by default the first one stops the run, naming its step)."""
    tp_plan: dict | None = None   # tensor-parallel plan (DTensor's convention); None: the model's tp_plan
    optimizer: str = "sgd"        # "sgd" | "adamw": torch's own, torch's defaults, this lr
    blocks: str | None = None     # the dotted name of the ModuleList of repeated blocks; None: found
    init: str = "auto"            # "whole" | "per_rank": each rank materialises what it holds (.materialize)


def build_job(spec: RunSpec, groups, recorder, device, run_id: str | None = None) -> Executor:
    """This rank's job for ``spec``, on the groups already built for its degrees."""
    s = spec.strategy
    dp_index, pp_index, tp_index = groups.coords
    full = build_rank_model(spec, groups, device)                          # 1. under the seed
    data = resolve_data(spec.data, full, spec.batch, spec.seed)           # shaped by the whole model
    for axis in AXES:                                                     # 2. tp, cp, dp, ep
        full = axis.shape_model(full, spec, groups)
        data = axis.shape_data(data, spec, groups)
    if s.pp == 1:                         # 3. pipeline split: none, the whole model is the stage
        blocks, held = [None], [0]
        stages = [build_stage(full, None, 0, 0, s, groups, recorder, device, spec.blocks)]   # 4. grad sync
    else:
        blocks, held = stage_blocks(full, s), my_stages(s, pp_index)
        stages = [build_stage(full, blocks[g], g, c, s, groups, recorder, device)            # 4. grad sync
                  for c, g in enumerate(held)]
    tied = build_tied_sync(full, blocks, held, groups) if s.pp > 1 else None   # + the embedding group
    params = [p for st in stages for p in st.module.parameters() if p.requires_grad]
    if s.precision == "fp16" and not params:      # its scaler would miss the overflow vote
        raise ValueError(f"Strategy.precision='fp16': pipeline rank {pp_index} holds no trainable parameters, "
                         "so it cannot join the loss scaler's overflow check; move a block with "
                         "parameters onto it (Strategy.split_at) or use precision='bf16'")
    return Executor(                                                       # 5. one executor
        spec, stages, len(blocks) - 1, build_actions(s, pp_index),
        PipeChannel(groups.pp_ranks, groups.pp, device, p2p_tag(run_id)), data, resolve_loss(spec.loss),
        build_step_optimizer(spec, stages, params), ActivationMeter(params),
        recorder, device, dp_index, owns_parameters=dp_index == 0, tied=tied,
        tp_group=groups.tp if s.tp > 1 else None, tp_index=tp_index,
        precision=build_precision(s.precision, device))                    # autocast, loss scaling


def p2p_tag(run_id: str | None) -> int:
    """The point-to-point tag of a run's pipeline messages: one per run, the same on every rank
    (it comes from the run id the notebook chose), so a failed run's stray messages match
    nothing later. A per-engine counter would drift apart once a build failed on some ranks."""
    return int(run_id[:7], 16) if run_id else 0


def build_step_optimizer(spec: RunSpec, stages: list[Stage], params: list):
    """Step 5's optimizer: torch's own over this rank's parameters; with zero, over its shards."""
    if not params:
        return None
    if spec.strategy.zero:
        from .zero.sync import build_sharded_optimizer
        return build_sharded_optimizer([st.sync for st in stages], spec, params)
    return build_optimizer(params, spec.lr, spec.momentum, spec.optimizer)


@dataclass
class StageSync:
    """What a stage's gradient sync is built over (each axis's ``wrap_sync`` reads it)."""

    group: Any               # the ranks holding the same blocks: dp, or dp × cp
    size: int
    has_grads: bool          # False: a stage with no trainable parameters syncs nothing
    recorder: Any
    path: str | None         # the dotted name of its repeated blocks (ZeRO-3 and FSDP2 shard them)


def my_stages(s: Strategy, pp_index: int) -> list[int]:
    """The global stages pipeline rank ``pp_index`` holds, by local chunk: the schedule's
    placement (loop: stage c·pp + r, Megatron; v: r and 2·pp − 1 − r, ZB-V)."""
    if s.pp == 1:
        return [0]
    place = placement_of(s.schedule)
    return [global_stage(pp_index, c, s.pp, place) for c in range(s.chunks)]


def build_stage(full: nn.Module, blocks: range | None, index: int, chunk: int, s: Strategy, groups,
                recorder, device, blocks_path: str | None = None) -> Stage:
    """Step 4: one stage's blocks, on the device, wrapped by its gradient sync.

    ``blocks`` None (pp = 1): the stage is the whole model, any ``nn.Module``, its state_dict
    keys its own; its repeated blocks (:mod:`.blocks`, ``blocks_path`` or found) are what
    recompute checkpoints, ZeRO-3 and FSDP2 shard one by one and backward is timed by.

    Backward is timed per block when a rank holds the whole model (the data-parallel lesson:
    buckets overlap with the backward of earlier blocks), per micro-batch otherwise (the
    pipeline's lesson). Either way a span ends when the gradients exist, not when
    ``backward()`` returns: DDP waits for its all-reduces inside ``backward()``, and that wait
    is comm, not compute.
    """
    module = full if blocks is None else stage_module(full, blocks, s.microbatches)
    module = module.to(device)
    path = find_path(module, blocks_path)
    # Activation recomputation, per stage, before any wrapper sees the blocks (torchtitan
    # applies AC before FSDP/compile likewise): "full" checkpoints each of the stage's blocks.
    apply_recompute(module, s.recompute, path)
    has_grads = any(p.requires_grad for p in module.parameters())
    # cp ranks hold the same parameters (and a slice of each sequence): they average with dp, and
    # ZeRO shards over them too (Megatron's distributed optimizer over its dp × cp group)
    group, size = (groups.dp_cp, s.dp * s.cp) if s.cp > 1 else (groups.dp, s.dp)
    stage, sync = StageSync(group, size, has_grads, recorder, path), None
    for axis in AXES:                                                     # 4. dp, zero, ep
        sync = axis.wrap_sync(sync, s, groups, stage)
    span = _time_stage(module, blocks is None, path, sync, s, recorder)
    return Stage(index, chunk, module, sync.wrap(module), sync, span)


def _time_stage(module: nn.Module, whole: bool, path: str | None, sync, s: Strategy, recorder):
    """Compute spans: per unit for the whole model (a sharded sync times its blocks itself,
    around its gathers, and the modules around them, a model's embedding, norm and head, are
    timed here), per micro-batch for a pipeline stage (returned)."""
    named_blocks = {name for name, _ in find_blocks(module, path)}
    around = [(n, m) for n, m in units(module, path) if n not in named_blocks] if whole else []
    if sync.times_forward:
        instrument_forward(around, recorder)
    if sync.times_backward:
        instrument_backward(module, recorder, around)
    elif s.pp == 1:
        instrument_backward(module, recorder, units(module, path))
    else:
        return _stage_span(module, recorder)
    return None


def _stage_span(module: nn.Module, recorder) -> BackwardSpan:
    params = [p for p in module.parameters() if p.requires_grad]
    span = BackwardSpan(recorder, "B", len(params))
    if recorder.enabled:
        for p in params:
            p.register_post_accumulate_grad_hook(span.param_ready)
    return span


def build_actions(s: Strategy, pp_index: int) -> list:
    """Step 5's list: this rank's schedule actions (pp = 1: forward then backward per micro-batch)."""
    if s.pp == 1:
        return build_schedule("1f1b", 1, s.microbatches, 1)[0]
    return build_schedule(s.schedule, s.pp, s.microbatches, s.chunks)[pp_index]
