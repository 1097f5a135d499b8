"""Data the course trains on: ``labkit.data.text`` builds a character corpus from text that
ships with Python (no download).

>>> data = labkit.data.text(batch=8, block_size=64)
>>> x, y = data(0); data.decode(x[0])
"""
from .text import TextData, text

__all__ = ["TextData", "text"]
