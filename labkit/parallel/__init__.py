"""How a model is spread over ranks: the builder and the executor, then one subpackage per axis
(data, pipeline, tensor, zero)."""
