"""Sharding (ZeRO, Rajbhandari et al. 2020, arXiv 1910.02054) as a data-parallel axis.

Plain data parallelism keeps a whole copy of the model states on every rank: parameters,
gradients and optimizer state. ZeRO keeps 1/dp of them on each rank instead, stage by stage:

* ``zero=1`` (P_os)      — the optimizer state: each rank steps only its shard of the
                           parameters, then the updated shards are all-gathered;
* ``zero=2`` (P_os+g)    — and the gradients: buckets are reduce-scattered during backward,
                           so each rank keeps only its shard's gradient;
* ``zero=3`` (P_os+g+p)  — and the parameters: each block is all-gathered just before its
                           forward and freed after, gathered again for its backward.

``prefetch`` (zero=3) issues the gathers of the next blocks before the current block's forward
(the previous blocks' in backward), so gathers run under compute: the forward twin of
backward overlap. ``zero_mode="fsdp2"`` is torch's own ``fully_shard`` as a comparator.

This file owns the axis's settings and their rules (:func:`check_strategy`, called by
``Strategy``) and the paper's memory formula; it imports nothing heavy, so a notebook can use
both without torch.distributed. The by-hand syncs are in :mod:`.sync`, torch's in :mod:`.fsdp2`.

>>> model_state_bytes(1_000_000, dp=4, stage=3, k=8)["total"]
4000000.0
"""
from __future__ import annotations

ZERO_STAGES = (0, 1, 2, 3)
ZERO_MODES = ("labkit", "fsdp2")
PREFETCH = (0, 1, 2)


def check_strategy(s) -> None:
    """Raise ValueError naming the field and the fix for an impossible sharding setting."""
    for name, allowed in (("zero", ZERO_STAGES), ("prefetch", PREFETCH)):
        value = getattr(s, name)
        if isinstance(value, bool) or value not in allowed:
            raise ValueError(f"Strategy.{name}={value!r} must be one of {', '.join(map(str, allowed))}")
    if s.zero == 0:
        if s.prefetch:
            raise ValueError(f"Strategy.prefetch={s.prefetch} gathers sharded parameters ahead, and zero=0 "
                             "shards none; use zero=3, or prefetch=0")
        return
    if s.dp == 1:
        raise ValueError(f"Strategy.zero={s.zero} shards over the dp group, and dp=1 has no one to share "
                         "with; use dp ≥ 2, or zero=0")
    if s.zero > 1 and s.pp > 1:
        raise ValueError(f"Strategy.zero={s.zero} with pp={s.pp}: sharded gradients and parameters are not "
                         "built for pipelines here; use zero=1 with pp > 1, or pp=1")
    if s.prefetch and s.zero != 3:
        raise ValueError(f"Strategy.prefetch={s.prefetch} gathers parameters ahead, and only zero=3 shards "
                         f"them (zero={s.zero}); use zero=3, or prefetch=0")
    if s.zero_mode == "fsdp2" and s.zero == 1:
        raise ValueError("Strategy.zero_mode='fsdp2' is torch's fully_shard, which shards gradients too; "
                         "use zero=2 (reshard_after_forward=False) or zero=3, or zero_mode='labkit'")
    if s.compression != "none":
        raise ValueError(f"Strategy.compression={s.compression!r} works on all-reduce buckets, and zero "
                         f"reduce-scatters; use compression='none' with zero={s.zero}")


def check_model(s, built, blocks: str | None = None) -> None:
    """The model-dependent rule (called by ``run/runner.py:validate``, before any engine): a
    parameter shared by two blocks (a GPT's tied embedding and head) is one tensor that a
    sharded layout would put in two places. zero=3 flattens each block into its own unit, and
    FSDP2 refuses a parameter in two ``fully_shard`` groups; across pipeline stages the tied
    copies' gradient sum (``parallel/pipeline/tied.py``) runs after the sync, which with zero
    has already consumed the full gradients."""
    if s.zero == 0:
        return
    from ..blocks import find_blocks
    units = [name + "." for name, _ in find_blocks(built, blocks)]
    blocks_of: dict[int, set] = {}        # parameter → the units that hold it (a block, or the root)
    for name, p in built.named_parameters(remove_duplicate=False):
        unit = next((u for u in units if name.startswith(u)), "root")
        blocks_of.setdefault(id(p), set()).add(unit)
    shared = any(len(blocks) > 1 for blocks in blocks_of.values())
    if shared and (s.zero == 3 or s.zero_mode == "fsdp2" or s.pp > 1):
        how = "" if s.zero == 3 else f" with pp={s.pp}" if s.pp > 1 else f" with zero_mode={s.zero_mode!r}"
        raise ValueError(f"Strategy.zero={s.zero}{how}: the model shares a parameter "
                         "between blocks (a tied embedding and head), which a sharded layout would hold in two "
                         "places; use labkit.models.gpt(tie=False), or zero_mode='labkit' with zero=1 or 2 and "
                         "pp=1, or zero=0")


# -- the paper's model-state memory, fp32 ----------------------------------------------------
def model_state_bytes(psi: float, dp: int, stage: int, k: float = 8, param_bytes: int = 4,
                      grad_bytes: int = 4) -> dict:
    """Bytes of model state per rank, ZeRO paper Figure 1, for fp32 training.

    The paper counts mixed precision: (2 + 2 + K)·Ψ with K = 12 (fp32 master weights, momentum
    and variance for Adam). Here everything is fp32 and the optimizer steps the parameters
    themselves, so it is (4 + 4 + K)·Ψ with K = 8 for AdamW's two fp32 moments (K = 0 for
    SGD without momentum, 4 with momentum). Stage 1 divides the K·Ψ term by N_d = dp, stage 2
    the gradients too, stage 3 the parameters too.
    """
    params, grads, optim = param_bytes * psi, grad_bytes * psi, k * psi
    if stage >= 1:
        optim /= dp
    if stage >= 2:
        grads /= dp
    if stage >= 3:
        params /= dp
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


def optimizer_state_factor(optimizer: str, momentum: float = 0.0) -> int:
    """K of the formula: optimizer-state bytes per parameter (fp32)."""
    if optimizer == "adamw":
        return 8
    return 4 if momentum else 0
