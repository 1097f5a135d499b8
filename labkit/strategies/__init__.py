"""Old home of the strategy modules; they live in :mod:`labkit.parallel` now (see labkit._moved)."""
