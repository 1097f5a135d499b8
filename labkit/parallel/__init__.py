"""Parallelism by axis: one subpackage each (tensor, zero, …)."""
