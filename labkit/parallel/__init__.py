"""How a model is spread over ranks: the builder and the executor, then one subpackage per axis
(tensor, context, pipeline, data, zero, expert), each with an ``axis.py`` that the registry
(:mod:`.axes`) lists in the order the axes apply."""

# How every stage computes, whatever the degrees: the choices of Strategy.precision
# (labkit.parallel.precision) and Strategy.recompute (labkit.parallel.recompute). Kept here,
# importing nothing, so Strategy validates without torch.distributed.
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE_MODES = ("none", "full", "selective")


def check_compute(s) -> None:
    """Raise ValueError naming the field and the fix for an impossible precision setting.

    fp16's loss scaler multiplies gradients by up to 65536 and skips the steps where they
    overflow; labkit's compressed gradient sync refuses non-finite gradients instead (it stops
    every rank with the bucket's name rather than spread inf), so the two cannot be combined.
    """
    if s.precision == "fp16" and s.compression != "none" and s.dp > 1:
        raise ValueError(f"Strategy.precision='fp16' with compression={s.compression!r}: the loss scaler's "
                         "overflowing steps (skipped, by design) would stop the compressed sync; use "
                         "precision='bf16' (no scaling), or compression='none'")
