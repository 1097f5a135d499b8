"""One file per strategy. :mod:`.data_parallel` holds the four ways to average gradients."""
