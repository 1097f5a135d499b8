"""The losses labkit trains with, and the contract a user's loss keeps.

A loss is ``"mse"``, ``"cross_entropy"`` or a callable ``loss(output, target)`` that returns
the MEAN over the rows (or tokens) it is given: labkit averages it over dp replicas and
micro-batches, which equals one process's loss only for a mean (a sum would be divided by
dp × microbatches; checked on the first batch). A loss over tokens where some do not count
(padding) is a :func:`token_loss`: its sums are divided once by the global count.
"""
from .training import TokenLoss, cross_entropy, mse_loss, token_loss

__all__ = ["TokenLoss", "cross_entropy", "mse_loss", "token_loss"]
