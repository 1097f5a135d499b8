"""Data parallelism: gradients averaged over the dp group, four ways (see :mod:`.sync`)."""
