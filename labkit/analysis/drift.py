"""Where a distributed run left the single-process one: ``labkit.drift(run, reference)``.

>>> run = lab.run(s, model=m, steps=5, snapshots=True)
>>> ref = labkit.reference(m, steps=5, snapshots=True)
>>> labkit.drift(run, ref)          # None, or the first (step, parameter, rank) that departs
>>> run.grad_norms()                # the gradient check: every parameter's gradient norm, per rank

What is recorded, and why. With ``snapshots=True`` every rank keeps, after each step, a
float32 copy of its parameters — its own copy, whole: each dp replica's, each stage's, ZeRO
shards gathered (ZeRO-1/2 write the updated shards back after the optimizer's step) and tp
pieces gathered onto the replica's first tp rank — and the norm of each gradient (the
averaged gradient the optimizer just used). Full copies cost ``4 bytes × parameters held ×
ranks × steps`` in the notebook, plus one copy per step for the reference: 28 KB a step per
rank for the tests' 7 k-parameter MLP, 2.1 MB for the default ``mlp()`` (526 k), 3.2 MB for a
0.8 M GPT — fine for the tens of steps a lesson looks at, and the reason the option is off by
default (when on, the gradient norms are taken in the optimizer step). The cheap alternative, a
norm and a checksum per parameter, fails exactly where this tool is needed:

* a norm sees only the part of a departure along the weights (‖p + d‖ − ‖p‖ ≈ p̂·d): a
  random error of 1e-4 per element on a 1024×1024 weight (‖d‖ = 0.10) moves its norm by
  2e-4 (measured), and a permutation or sign error — two same-shaped gradients unpacked into
  each other's places — not at all;
* a checksum says "bitwise different", which every fp32 reordering of a sum already is
  (a correct run differs from the reference by ~1e-8), so it cannot apply a tolerance.

Full copies make the comparison exact and give it the same meaning as ``run.max_diff``:
the largest absolute difference of any element, against ``tol``.

How a departure is classified. Data-parallel replicas apply the same averaged gradient, so
they stay equal to each other (bitwise, in every mode measured here) whatever the arithmetic does to the
average. If the replicas holding a parameter disagree beyond ``tol``, gradients were not
averaged alike: a **sync** bug (a rank skipped or mis-ordered a bucket). If they agree with
each other but not with the reference, the average itself differs, and the snapshots say why
where they can: the replicas' **buffers** differ (a buffer the forward writes, updated from each
replica's own rows), or the run's buffers differ from the reference's (updated once per
micro-batch); the first step's loss is a constant multiple of the reference's (a loss **reduction**
that is not a mean over the rows, e.g. a sum); else a **precision** or math effect
(compression, mixed precision, a wrong averaging factor, summation order).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from .tables import CellTable

SYNC, PRECISION, UNKNOWN, BUFFERS, REDUCTION = "sync", "precision", "unknown", "buffers", "reduction"


# -- recording (engine side and reference) ----------------------------------------------------
def check_snapshots(value) -> bool:
    """The ``snapshots=`` run option: ValueError unless True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"snapshots={value!r} must be True or False (True: record parameters and gradient "
                         "norms after every step, for labkit.drift and run.grad_norms)")
    return value


def take_snapshot(model: torch.nn.Module) -> dict:
    """Every parameter of ``model`` as a float32 CPU copy, and its gradient's norm (0 if none);
    its buffers too (float32 copies), for the buffer check of :func:`drift`."""
    params, grad_norms = {}, {}
    for name, p in model.named_parameters():
        params[name] = p.detach().float().cpu().clone()
        grad_norms[name] = float(p.grad.detach().float().norm()) if p.grad is not None else 0.0
    return {"params": params, "grad_norms": grad_norms, "buffers": _buffers(model)}


def _buffers(model: torch.nn.Module) -> dict:
    return {name: b.detach().float().cpu().clone() for name, b in model.named_buffers()
            if isinstance(b, torch.Tensor) and not b.is_meta}


class StepSnapshots:
    """Takes a snapshot of ``model`` after every ``optimizer.step()``; :meth:`pop` hands it over.

    A step post-hook, so the gradients are still there (jobs zero them right after the step).
    ``copy``: where :meth:`pop` takes the parameters from instead, after the whole step (an
    engine's job: its rank's own copy, ZeRO shards and tp pieces gathered, as ZeRO-1/2 write
    the updated shards back only after the optimizer's step and ZeRO-3 holds shards alone).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 copy: Callable[[], dict] | None = None):
        self.model, self.latest, self.copy = model, {}, copy
        if optimizer is not None:         # a pipeline stage without parameters has no optimizer
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self._take())

    def _take(self) -> None:
        if self.copy is None:
            self.latest = take_snapshot(self.model)
            return
        # the parameters come from the copy at pop(); ZeRO-3's own may be freed here (not read)
        self.latest = {"params": {}, "buffers": _buffers(self.model),
                       "grad_norms": {name: float(p.grad.detach().float().norm()) if p.grad is not None else 0.0
                                      for name, p in self.model.named_parameters()}}

    def pop(self) -> dict:
        out, self.latest = self.latest or {"params": {}, "grad_norms": {}}, {}
        if self.copy is not None:         # every rank calls it (a collective where shards are gathered)
            buffers = {name for name, _ in self.model.named_buffers()}
            out["params"] = {k: v.detach().float().cpu().clone() for k, v in self.copy().items() if k not in buffers}
        return out


def build_step_snapshots(job) -> StepSnapshots:
    """Snapshots for an engine's job (anything with ``.model`` and ``.optimizer``); the
    parameters from its ``full_state_dict(every=True)`` where it has one: this rank's copy,
    whole."""
    whole = getattr(job, "full_state_dict", None)
    return StepSnapshots(job.model, getattr(job, "optimizer", None),
                         (lambda: whole(every=True)) if whole is not None else None)


# -- the gradient check -----------------------------------------------------------------------
@dataclass(repr=False)      # the table's __repr__ (CellTable)
class GradNorms(CellTable):
    """Every parameter's gradient norm, per step and rank: ``norms[(step, parameter, rank)]``.

    Shows as a table (one row per step and parameter, one column per rank, and the
    reference's column when given); the gradient is the averaged one the optimizer used, so
    dp replicas should agree and equal the reference to float32 rounding.
    """

    norms: dict
    columns: list
    order: list = field(repr=False)

    def __getitem__(self, key) -> float:
        return self.norms[key]

    def _cells(self):
        heads = ["step", "parameter"] + [c if isinstance(c, str) else f"rank {c}" for c in self.columns]
        body = [[str(step), name] + [f"{self.norms[(step, name, c)]:.6g}" if (step, name, c) in self.norms else ""
                                     for c in self.columns] for step, name in self.order]
        return heads, body


def grad_norms(snapshots: list[dict], reference=None) -> GradNorms:
    """The table for a run's (or a reference's) ``snapshots``: a list, per step, of {rank: snapshot}."""
    _need(snapshots, "run")
    norms, order, ranks = {}, [], sorted({r for by_rank in snapshots for r in by_rank})
    for step, by_rank in enumerate(snapshots):
        names = list(dict.fromkeys(n for r in sorted(by_rank) for n in by_rank[r]["grad_norms"]))
        order += [(step, n) for n in names]
        for rank, snap in by_rank.items():
            norms.update({(step, n, rank): v for n, v in snap["grad_norms"].items()})
    columns = list(ranks)
    if reference is not None:
        ref = _need(getattr(reference, "snapshots", None), "reference")
        for step, by_rank in enumerate(ref[:len(snapshots)]):
            norms.update({(step, n, "reference"): v for n, v in by_rank[0]["grad_norms"].items()})
        columns.append("reference")
    return GradNorms(norms, columns, order)


# -- the drift finder -------------------------------------------------------------------------
@dataclass(frozen=True)
class Drift:
    """The first place a run departs from its reference, and what kind of departure it is."""

    step: int
    parameter: str
    rank: int
    size: float
    """max |run − reference| over the parameter's elements, on ``rank``, after ``step``."""
    spread: float
    """max |replica − replica| over the ranks holding the parameter (0 with one replica)."""
    kind: str
    """"sync" (replicas disagree), "precision" (replicas agree, the average differs) or "unknown"
    (one rank holds the parameter: nothing to compare it with but the reference)."""
    tol: float
    replicas: tuple = ()
    departed: tuple = ()
    """Every (parameter, rank, size) beyond ``tol`` at this step, in model and rank order."""
    detail: str = ""
    """For "buffers" and "reduction": what was seen (the buffer and ranks, the losses' ratio)."""

    def __str__(self) -> str:
        where = f"step {self.step}, parameter {self.parameter!r}, rank {self.rank}"
        what = f"departs from the reference by {self.size:.3g} (tol {self.tol:g})"
        if len(self.replicas) < 2:
            why = "only one rank holds it, so replicas cannot be compared"
        elif self.kind in (BUFFERS, REDUCTION):
            why = self.detail
        elif self.kind == SYNC:
            why = (f"dp replicas (ranks {list(self.replicas)}) disagree by {self.spread:.3g}: a sync bug — "
                   "their gradients were not averaged alike")
        else:
            why = (f"dp replicas (ranks {list(self.replicas)}) agree with each other (within {self.spread:.3g}) "
                   "but not with the reference: a math or precision effect (compression, precision, the "
                   "averaging factor, summation order)")
        return f"{where}: {what}; {why}"


def _need(snapshots, what: str) -> list:
    if not snapshots:
        fix = "lab.run(..., snapshots=True)" if what == "run" else "labkit.reference(..., snapshots=True)"
        raise ValueError(f"the {what} recorded no snapshots; run it with {fix}")
    return snapshots


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _compare(step: int, name: str, want: torch.Tensor, by_rank: dict, tol: float) -> Drift | None:
    held = {r: snap["params"][name] for r, snap in sorted(by_rank.items()) if name in snap["params"]}
    if not held:
        raise ValueError(f"step {step}: no rank recorded parameter {name!r}; is the run of the same model?")
    sizes = {r: _max_abs(t, want) for r, t in held.items()}
    departed = [r for r in held if sizes[r] > tol]
    if not departed:
        return None
    first = next(iter(held.values()))
    spread = max(_max_abs(t, first) for t in held.values())
    kind = UNKNOWN if len(held) < 2 else SYNC if spread > tol else PRECISION
    return Drift(step, name, departed[0], sizes[departed[0]], spread, kind, tol,
                 replicas=tuple(held), departed=tuple((name, r, sizes[r]) for r in departed))


def drift(run, reference, tol: float = 1e-5) -> Drift | None:
    """The first (step, parameter, rank) where ``run`` departs from ``reference`` by more than ``tol``.

    Steps in order; within a step, parameters in the model's order and ranks in rank order.
    Both must have been recorded with ``snapshots=True``; None when nothing departs.
    """
    if not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"tol={tol!r} must be a number ≥ 0 (largest allowed |run − reference|)")
    ours = _need(getattr(run, "snapshots", None), "run")
    theirs = _need(getattr(reference, "snapshots", None), "reference")
    for step, (by_rank, ref) in enumerate(zip(ours, theirs)):
        found = [d for name, want in ref[0]["params"].items()
                 if (d := _compare(step, name, want, by_rank, tol)) is not None]
        if found:
            first = replace(found[0], departed=tuple(x for d in found for x in d.departed))
            return _explain(first, ours[:step + 1], theirs[:step + 1], getattr(run, "losses", None),
                            getattr(reference, "losses", None), tol)
    return None


def _explain(found: Drift, ours: list, theirs: list, losses, ref_losses, tol: float) -> Drift:
    """Replicas that agree but depart: name buffers that differ, or a loss reduction mismatch."""
    if found.kind == SYNC:
        return found
    for step, (by_rank, ref) in enumerate(zip(ours, theirs)):
        for name, want in ref[0].get("buffers", {}).items():
            held = {r: snap["buffers"][name] for r, snap in sorted(by_rank.items())
                    if name in snap.get("buffers", {}) and snap["buffers"][name].shape == want.shape}
            if len(held) > 1 and max(_max_abs(t, next(iter(held.values()))) for t in held.values()) > tol:
                return replace(found, kind=BUFFERS, detail=(
                    f"replicas' buffers differ: {name!r} after step {step} differs between ranks {list(held)} "
                    "(a buffer the forward writes, updated from each replica's own rows; sync it, or accept "
                    "the departure)"))
            off = {r: _max_abs(t, want) for r, t in held.items()}
            if off and max(off.values()) > tol:
                return replace(found, kind=BUFFERS, detail=(
                    f"the buffer {name!r} after step {step} differs from the reference's by {max(off.values()):.3g} "
                    "on every rank holding it (a buffer the forward writes, updated once per micro-batch or "
                    "from part of the batch)"))
    ratio = _loss_ratio(losses, ref_losses)
    if ratio is not None:
        return replace(found, kind=REDUCTION, detail=(
            f"the run's first loss is {ratio:.4g}× the reference's, a loss reduction mismatch: the loss is not a "
            "mean over the rows it is given (labkit averages it over replicas and micro-batches); return "
            "a mean (.mean(), reduction=\"mean\"), or use labkit.losses.token_loss for tokens with padding"))
    return found


def _loss_ratio(losses, ref_losses) -> float | None:
    """The run's first loss over the reference's when it is a whole multiple or fraction (1/2,
    1/4, 2, …: a sum divided by dp × microbatches), else None. At step 0 the weights are the
    reference's, so a correct run's first loss equals the reference's; dropout's differs by
    no simple factor."""
    if not losses or not ref_losses or not ref_losses[0]:
        return None
    r = losses[0] / ref_losses[0]
    if abs(r - 1) < 1e-3 or r <= 0:
        return None
    k = round(1 / r) if r < 1 else round(r)
    return r if k >= 2 and abs((r * k if r < 1 else r / k) - 1) < 1e-3 else None
