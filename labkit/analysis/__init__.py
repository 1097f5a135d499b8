"""Pure analysis of gathered events: metrics, wait splitting, hang reports (no torch.distributed, no ipyparallel)."""
