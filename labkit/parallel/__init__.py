"""How a model is spread over ranks: the builder, data parallelism, pipelines (tensor and zero later)."""
