"""Context parallelism: the cp axis's checks (before engines), its groups and token layout, and
on 4 engines a llama (and labkit's GPT) equal to one process for every mode beside dp, tp, pp (every schedule)
and zero, cp=4, the contiguous split and a MoE llama; on 8, dp·pp·cp and pp·tp·cp; the bytes
each rank sends equal the formula.

Tolerance 1e-5 on parameters and losses after 3 steps (as the other axes): the online softmax
merges per-block partial sums (each block's exp-sum rescaled by e^(lse_b − lse)), a different
summation order from torch's one-pass softmax, which moves float32 results by ~1e-7 relative."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import labkit
from labkit.grid import ParallelDims
from labkit.parallel.build import RunSpec
from labkit.parallel.context.layout import token_index
from labkit.run.runner import validate

DATA = labkit.data.text(batch=8, block_size=16)
SIZES = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=DATA.vocab_size, n_kv_heads=2)
KW = dict(data=DATA, loss="cross_entropy", batch=8, steps=3, lr=0.3, seed=0)
TOL = 1e-5


def llama(**kwargs):
    return labkit.models.llama(**{**SIZES, **kwargs})


def gpt(**kwargs):
    sizes = {k: v for k, v in SIZES.items() if k != "n_kv_heads"}
    return labkit.models.gpt(**{**sizes, **kwargs})


class Plain(nn.Module):
    """Attention through torch's sdpa directly: it does not opt in to context parallelism."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(DATA.vocab_size, 16), nn.Linear(16, DATA.vocab_size)

    def forward(self, idx):
        x = self.emb(idx).unsqueeze(1)
        return self.head(nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).squeeze(1))


# -- checks, in one process -----------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=2, cp=2, sequence_parallel=True), "sequence_parallel"),
    (dict(tp=2, cp=2, tp_mode="dtensor"), "tp_mode='dtensor'"),
    (dict(dp=2, cp=2, sync_batchnorm=True), "sync_batchnorm"),
    (dict(cp=2, cp_mode="tree"), "cp_mode='tree' is unknown"),
    (dict(cp=0), "cp=0"),
])
def test_strategy_checks_its_cp_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        labkit.Strategy(**kwargs)


@pytest.mark.parametrize("model, strategy, data, match", [
    (llama(), labkit.Strategy(cp=4), labkit.data.text(batch=8, block_size=12), "12 tokens does not cut into 2·cp = 8"),
    (llama(), labkit.Strategy(cp=4, cp_balance=False), labkit.data.text(batch=8, block_size=14), "cp = 4 slices"),
    (Plain, labkit.Strategy(cp=2), DATA, "never calls labkit.parallel.context.attention nor positions"),
    (llama(n_experts=4, aux_loss_coef=0.01), labkit.Strategy(cp=2), DATA, "aux_loss_coef=0.01"),
    (gpt(dropout=0.1), labkit.Strategy(cp=2), DATA, "dropout=0.1"),
    (llama(), labkit.Strategy(cp=4, cp_mode="ulysses"), DATA, "key/value heads \\(2\\) over cp=4"),
    (llama(n_kv_heads=4), labkit.Strategy(tp=2, cp=4, cp_mode="ulysses"), DATA, "query heads \\(4 over tp=2\\)"),
])
def test_bad_input_is_refused_before_any_engine(model, strategy, data, match):
    with pytest.raises(ValueError, match=match):
        validate(RunSpec(strategy, model, data, "cross_entropy", batch=8), strategy.world_size)


def test_grid_puts_cp_between_pp_and_tp():
    dims = ParallelDims(dp=2, tp=2, cp=2)
    assert dims.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.dp_cp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [dims.cp_index(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert ParallelDims(dp=2, pp=2).dp_groups() == [[0, 2], [1, 3]]          # cp = 1: as before


def test_balanced_ranks_hold_chunks_i_and_its_mirror():
    assert [token_index(i, 2, 8, True).tolist() for i in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [token_index(i, 2, 8, False).tolist() for i in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    every = torch.cat([token_index(i, 4, 16, True) for i in range(4)]).sort().values
    assert every.tolist() == list(range(16))


def test_without_cp_the_attention_is_torchs():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 8), torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8)
    want = nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                      is_causal=True)
    assert torch.equal(labkit.parallel.context.attention(q, k, v), want)
    assert labkit.parallel.context.positions(5).tolist() == list(range(5))


# -- on engines -----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy, model", [
    (labkit.Strategy(dp=2, cp=2), llama()),
    (labkit.Strategy(dp=2, cp=2, cp_mode="allgather", dp_mode="bucketed"), llama()),
    (labkit.Strategy(tp=2, cp=2), llama()),
    (labkit.Strategy(tp=2, cp=2, cp_mode="allgather"), llama()),
    (labkit.Strategy(cp=4), llama()),
    (labkit.Strategy(cp=4, cp_mode="allgather", cp_balance=False), llama()),
    (labkit.Strategy(cp=4, cp_balance=False, dp_mode="ddp"), llama()),
    (labkit.Strategy(dp=2, cp=2), llama(n_experts=4, top_k=2, aux_loss_coef=0)),
    (labkit.Strategy(dp=2, cp=2, cp_mode="ulysses"), llama()),
    (labkit.Strategy(dp=2, cp=2, recompute="full"), llama()),           # the ring runs again in backward
    (labkit.Strategy(cp=4, cp_mode="ulysses", cp_balance=False), llama(n_head=8, n_kv_heads=4, n_embd=64)),
    (labkit.Strategy(dp=2, cp=2), gpt()),
    (labkit.Strategy(tp=2, cp=2, cp_mode="allgather"), gpt()),
], ids=["dp2cp2-ring", "dp2cp2-allgather", "tp2cp2-ring", "tp2cp2-allgather", "cp4-ring",
        "cp4-allgather-contiguous", "cp4-ring-contiguous-ddp", "dp2cp2-ring-moe", "dp2cp2-ulysses",
        "dp2cp2-ring-recompute", "cp4-ulysses-contiguous", "gpt-dp2cp2-ring", "gpt-tp2cp2-allgather"])
def test_context_parallel_equals_one_process(lab4, strategy, model):
    run, ref = lab4.run(strategy, model=model, **KW), labkit.reference(model, **KW)
    assert set(run.parameters()) == set(ref.parameters())
    assert run.losses == pytest.approx(ref.losses, abs=TOL)
    assert run.max_diff(ref) <= TOL


@pytest.mark.parametrize("strategy, model", [
    (labkit.Strategy(pp=2, cp=2, microbatches=2), llama()),
    (labkit.Strategy(pp=2, cp=2, microbatches=2, schedule="gpipe", cp_mode="allgather"), llama(tie=True)),
    (labkit.Strategy(pp=2, cp=2, microbatches=2, schedule="interleaved", chunks=2), llama(n_layer=4)),
    (labkit.Strategy(pp=2, cp=2, microbatches=2, schedule="zb-h1", cp_balance=False), llama()),
    (labkit.Strategy(pp=2, cp=2, microbatches=2, schedule="zbv", chunks=2, cp_mode="ulysses"), llama(n_layer=4)),
    (labkit.Strategy(dp=2, cp=2, zero=1), llama()),
    (labkit.Strategy(pp=2, cp=2, microbatches=2), gpt()),
    (labkit.Strategy(dp=2, cp=2, zero=3, cp_mode="allgather", prefetch=1), llama()),
], ids=["pp2cp2-1f1b-ring", "pp2cp2-gpipe-allgather-tied", "pp2cp2-interleaved-ring", "pp2cp2-zbh1-contiguous",
        "pp2cp2-zbv-ulysses", "dp2cp2-zero1", "gpt-pp2cp2-1f1b", "dp2cp2-zero3-allgather"])
def test_context_parallel_with_pipelines_and_zero_equals_one_process(lab4, strategy, model):
    """Every pipeline schedule: cp ranks of one stage run the same actions, so their rings meet;
    the stages pass each rank's slice of the sequence (the PipeChannel's header carries its shape).
    ZeRO shards over dp × cp, the ranks that average gradients."""
    run, ref = lab4.run(strategy, model=model, **KW), labkit.reference(model, **KW)
    assert run.losses == pytest.approx(ref.losses, abs=TOL)
    assert run.max_diff(ref) <= TOL


@pytest.mark.parametrize("mode", ["ring", "allgather", "ulysses"])
def test_bytes_sent_per_layer_are_the_formula(lab4, mode):
    """cp=4, batch 8 over one dp rank, 4 of 16 tokens each, 4 heads (2 kv) of 8: a K/V block is
    2·8·2·4·8 floats, q 8·4·4·8. Ring: forward cp−1 blocks, backward cp−1 blocks and cp float32
    gradient blocks; all-gather: (cp−1)/cp of the gathered K/V, and the same of its gradient;
    Ulysses: (cp−1)/cp of q, k, v and the output, each way."""
    cp, layers = 4, SIZES["n_layer"]
    model = llama(n_kv_heads=4) if mode == "ulysses" else llama()
    run = lab4.run(labkit.Strategy(cp=cp, cp_mode=mode), model=model, **{**KW, "steps": 1})
    block, q = 2 * 8 * 2 * (16 // cp) * 8 * 4, 8 * 4 * (16 // cp) * 8 * 4
    for rank in range(cp):
        sent = [e for e in run.timeline.events if e["rank"] == rank and e["name"].startswith("cp ")
                and e["kind"] in ("send", "allgather", "reduce_scatter", "all_to_all")]
        total = sum(e["bytes"] for e in sent)
        if mode == "ring":
            assert total == layers * ((cp - 1) + (cp - 1) + cp) * block
            rounds = {e["name"] for e in run.timeline.events if e["rank"] == rank and e["kind"] == "attention"}
            assert rounds == {f"ring {d} {j}" for d in ("fwd", "bwd") for j in range(cp)}
        elif mode == "allgather":
            assert total == layers * 2 * (cp - 1) * block
        else:             # 4 kv heads here: k and v as big as q
            assert total == layers * 2 * (cp - 1) * 4 * q // cp


@pytest.mark.parametrize("causal", [True, False])
def test_chunk_pairs_merged_by_lse_equal_torchs_attention_and_its_gradients(causal):
    """The ring's arithmetic without the ring: four chunks of keys taken one at a time, merged
    by the online softmax, and the hand-written backward, against torch's sdpa and autograd
    (grouped-query: 4 query heads over 2 key/value heads)."""
    from labkit.parallel.context.blocks import SKIP, block_backward, block_forward, merge, relation
    torch.manual_seed(0)
    n, c = 4, 3
    q, k, v = (torch.randn(2, h, n * c, 8, requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(2, 4, n * c, 8)
    want = labkit.parallel.context.local_attention(q, k, v, causal)
    want.backward(dout)
    chunk = [slice(i * c, (i + 1) * c) for i in range(n)]
    out, lse = torch.zeros(2, 4, n * c, 8), torch.full((2, 4, n * c), float("-inf"))
    pairs = [(a, b, relation(a, b, causal)) for a in range(n) for b in range(n)]
    pairs = [p for p in pairs if p[2] != SKIP]
    with torch.no_grad():
        for a, b, how in pairs[::-1]:          # any order: the merge is the same softmax
            merge(out[:, :, chunk[a]], lse[:, :, chunk[a]], *block_forward(q[:, :, chunk[a]], k[:, :, chunk[b]],
                                                                         v[:, :, chunk[b]], how))
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, how in pairs:
            ga, gb, gc = block_backward(q[:, :, chunk[a]], k[:, :, chunk[b]], v[:, :, chunk[b]], out[:, :, chunk[a]],
                                        dout[:, :, chunk[a]], lse[:, :, chunk[a]], how)
            dq[:, :, chunk[a]] += ga
            dk[:, :, chunk[b]] += gb
            dv[:, :, chunk[b]] += gc
    assert torch.allclose(out, want, atol=1e-6)
    for mine, grad in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(mine, grad, atol=1e-5)


def padded(step):
    """The text's batch with padding (-100) spread unevenly over the sequence: the first three
    rows' second halves and row 3's last quarter, so cp ranks hold different counts."""
    x, y = DATA(step)
    y = y.clone()
    y[:3, 8:] = -100
    y[3, 12:] = -100
    return x, y


@pytest.mark.parametrize("strategy", [labkit.Strategy(dp=2, cp=2), labkit.Strategy(cp=4, cp_balance=False)],
                         ids=["dp2cp2", "cp4-contiguous"])
def test_padded_tokens_under_cp_are_normalised_by_the_whole_count(lab4, strategy):
    """A token loss counts the whole sequences' tokens, not this rank's slice, and its sums are
    scaled by dp·cp (cp ranks average their gradients with dp)."""
    kw = dict(KW, data=padded)
    run, ref = lab4.run(strategy, model=llama(), **kw), labkit.reference(llama(), **kw)
    assert run.losses == pytest.approx(ref.losses, abs=TOL)
    assert run.max_diff(ref) <= TOL


# last: it closes the shared 4-engine lab for its own 8
@pytest.mark.slow
def test_four_axes_on_eight_engines_equal_one_process():
    """dp·pp·cp and pp·tp·cp = 8 (every axis at 2 would need 16 engines), in one lab."""
    from conftest import release_labs

    release_labs()
    ref = labkit.reference(llama(), **KW)
    with labkit.Lab.start(engines=8, timeout=60, progress=False) as lab:
        runs = [lab.run(labkit.Strategy(**kw, pp=2, cp=2, microbatches=2), model=llama(), **KW)
                for kw in (dict(dp=2), dict(tp=2, cp_mode="allgather"))]
    for run in runs:
        assert run.losses == pytest.approx(ref.losses, abs=TOL)
        assert run.max_diff(ref) <= TOL
