"""How a model is spread over ranks: the builder, then one subpackage per axis (data, pipeline,
tensor, zero)."""

# How every stage computes, whatever the degrees: the choices of Strategy.precision
# (labkit.parallel.precision) and Strategy.recompute (labkit.parallel.recompute). Kept here,
# importing nothing, so Strategy validates without torch.distributed.
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE_MODES = ("none", "full", "selective")
