"""Recording on the engines: per-rank event buffers and the backward / activation hooks."""
