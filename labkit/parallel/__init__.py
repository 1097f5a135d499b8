"""How a model is spread over ranks, one subpackage per axis: the builder and executor, data/,
pipeline/, tensor/ (zero/ next)."""
