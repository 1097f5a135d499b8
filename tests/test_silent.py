"""No silent wrong results: the exactness check reads every rank's copy, and a model a user
writes that labkit would train differently from one process is made exact, refused before the
engines with the fix, or warned about."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import labkit
from labkit.parallel.build import RunSpec
from labkit.parallel.data import SyncFault, sync_fault
from labkit.run.runner import validate

SETUP = dict(batch=16, steps=4, lr=0.1, seed=0)


# -- 1. the check reads every replica ------------------------------------------------------------
@pytest.mark.slow
def test_max_diff_reads_every_replica_and_names_the_one_that_departs(lab2):
    model = labkit.models.mlp(width=48, depth=3)
    bucketed = labkit.Strategy(dp=2, dp_mode="bucketed", bucket_mb=0.004)
    ref = labkit.reference(model, **SETUP)
    with sync_fault(lab2, SyncFault("skip", bucket=0, rank=1, from_step=2)):
        broken = lab2.run(bucketed, model=model, **SETUP)
    diff = broken.max_diff(ref)
    assert diff > 1e-5 and diff.rank == 1 and diff.parameter in ("4.weight", "4.bias")
    assert "rank 1 departs" in repr(diff)
    assert set(broken.copies) == {1}
    healthy = lab2.run(bucketed, model=model, **SETUP)
    assert healthy.max_diff(ref) < 1e-5 and healthy.copies == {}
    assert repr(healthy.max_diff(ref)) == repr(float(healthy.max_diff(ref)))


def refused(strategy, model, data=None, loss="mse", match="", batch=8, **extra):
    """``lab.run``'s checks, as they run before any engine is called."""
    with pytest.raises((ValueError, TypeError), match=match):
        validate(RunSpec(strategy, model, data, loss, batch=batch, extra=extra), strategy.world_size)


# -- 2. cp, unbalanced, on a sequence 2·cp does not divide ---------------------------------------
@pytest.mark.parametrize("mode", ["ring", "allgather", "ulysses"])
def test_unbalanced_cp_on_a_sequence_that_leaves_tokens_out_is_refused(mode):
    data = labkit.data.text(batch=8, block_size=6)
    model = labkit.models.llama(n_layer=1, n_head=2, n_kv_heads=2, n_embd=16, block_size=6, vocab_size=data.vocab_size)
    refused(labkit.Strategy(cp=2, cp_mode=mode, cp_balance=False), model, data, "cross_entropy",
            match="6 tokens does not cut into cp = 2 slices of two equal chunks .* multiple of 4")
