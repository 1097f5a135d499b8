"""A character-level corpus built on the machine from text that ships with Python: no download.

Two sources:

* ``"pydoc"`` — the language reference's topics that ``help()`` shows (``pydoc_data.topics``),
  about 0.46 M characters of English prose about Python;
* ``"stdlib"`` — the standard library's own sources (tests left out), about 12 M characters
  of Python code.

Either is filtered to printable ASCII, newline and tab (≥ 99.99 % of both), so the vocabulary
is the same small set of characters on every machine with that Python. The first 90 % is the
training split, the last 10 % is held out for validation.

:class:`TextData` is what ``lab.run`` ships to the engines: a few numbers, pickled by value.
The corpus itself is built on first use on each engine and cached per process, so a 12 MB
text is never pickled.

>>> data = text(batch=8, block_size=64)
>>> x, y = data(0)                      # (8, 64) token ids; y is x shifted by one
>>> data.decode(x[0])[:20], data.vocab_size
"""
from __future__ import annotations

import functools
import pathlib
import sysconfig
from dataclasses import dataclass

import torch

SOURCES = ("pydoc", "stdlib")
KEPT = "\t\n" + "".join(chr(c) for c in range(32, 127))     # printable ASCII, tab, newline
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    """The text as token ids (uint8: < 256 characters) and the characters they stand for."""

    chars: str
    ids: torch.Tensor
    val_start: int

    @property
    def vocab_size(self) -> int:
        return len(self.chars)


def _pydoc_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def _stdlib_text() -> str:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts))
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


@functools.lru_cache(maxsize=4)
def load_corpus(source: str, val_fraction: float) -> Corpus:
    """Read, filter and encode ``source`` once per process (cached)."""
    raw = _pydoc_text() if source == "pydoc" else _stdlib_text()
    kept = set(KEPT)
    text = "".join(ch for ch in raw if ch in kept)
    chars = "".join(sorted(set(text)))
    cpu = torch.device("cpu")      # even when first read inside a factory built under torch.device("meta")
    table = torch.zeros(128, dtype=torch.uint8, device=cpu)
    table[torch.tensor([ord(c) for c in chars], device=cpu)] = torch.arange(len(chars), dtype=torch.uint8, device=cpu)
    ids = table[torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()]
    return Corpus(chars, ids, int(len(ids) * (1 - val_fraction)))


@dataclass(frozen=True)
class TextData:
    """``data(step) -> (x, y)``: the step's global batch of random windows from the training
    split, seeded by (seed, step) so every engine and the reference draw the same batch."""

    batch: int = 8
    block_size: int = 64
    seed: int = 0
    source: str = "pydoc"
    val_fraction: float = 0.1

    def __post_init__(self):
        for name in ("batch", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"text: {name}={value!r} must be a whole number ≥ 1")
        if self.source not in SOURCES:
            raise ValueError(f"text: source={self.source!r} is unknown; use one of {', '.join(map(repr, SOURCES))}")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"text: val_fraction={self.val_fraction!r} must be in (0, 0.5)")

    @property
    def corpus(self) -> Corpus:
        return load_corpus(self.source, self.val_fraction)

    @property
    def vocab_size(self) -> int:
        """Distinct characters: pass it to ``labkit.models.gpt(vocab_size=...)``."""
        return self.corpus.vocab_size

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        corpus = self.corpus
        return self._windows(corpus.ids[:corpus.val_start], self.seed * 1_000_003 + step)

    def val(self, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A validation batch from the held-out split (never seen in training)."""
        corpus = self.corpus
        return self._windows(corpus.ids[corpus.val_start:], (self.seed + 1) * 2_000_029 + step)

    def _windows(self, ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.block_size
        if len(ids) <= t + 1:
            raise ValueError(f"text: block_size={t} is longer than the {self.source!r} split ({len(ids)} "
                             f"characters); use a smaller block_size")
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(ids) - t - 1, (self.batch,), generator=g)
        rows = ids[starts[:, None] + torch.arange(t + 1)].long()      # (B, T+1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def encode(self, s: str) -> torch.Tensor:
        """Text → token ids (int64); characters outside the vocabulary raise ValueError."""
        index = {c: i for i, c in enumerate(self.corpus.chars)}
        missing = sorted(set(s) - set(index))
        if missing:
            raise ValueError(f"text: characters {missing[:5]} are not in the vocabulary (printable ASCII)")
        return torch.tensor([index[c] for c in s], dtype=torch.long)

    def decode(self, ids) -> str:
        """Token ids (a tensor or list) → text."""
        chars = self.corpus.chars
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(chars[i] for i in values)


def text(batch: int = 8, block_size: int = 64, seed: int = 0, source: str = "pydoc",
         val_fraction: float = 0.1) -> TextData:
    """Character-level batches over text that ships with Python (``source``: "pydoc" | "stdlib").

    >>> data = labkit.data.text(batch=8, block_size=64)
    >>> model = labkit.models.gpt(block_size=64, vocab_size=data.vocab_size)
    >>> run = lab.run(labkit.Strategy(dp=2), model=model, data=data, loss="cross_entropy", batch=8)
    """
    return TextData(batch, block_size, seed, source, val_fraction)


@dataclass(frozen=True)
class RandomTokens:
    """Seeded random token ids over ``vocab_size``: ``data(step) -> (x, y)``, y the next token of
    x (what the planner's ``search(verify=lab)`` trains a GPT of any vocabulary on)."""

    vocab_size: int
    batch: int
    block_size: int
    seed: int = 0

    def __call__(self, step: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ids = torch.randint(self.vocab_size, (self.batch, self.block_size + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
