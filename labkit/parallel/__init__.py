"""How a model is spread over ranks: the builder, then one subpackage per axis (data, pipeline,
tensor, zero)."""
