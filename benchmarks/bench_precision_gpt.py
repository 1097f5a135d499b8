"""A GPT on text under each gradient compression and mixed precision: bytes, loss, drift.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_precision_gpt.py     # ~30 s on 2 engines

Every setting trains the same seeded GPT for 30 steps at dp=2 (overlap mode; PowerSGD in ddp)
and is compared with the fp32 single-process reference (labkit.bench.curves.loss_curves).
"""
import labkit
from labkit.bench.curves import loss_curves
data = labkit.data.text(batch=16, block_size=32, seed=0)
model = labkit.models.gpt(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=data.vocab_size)
with labkit.Lab.start(engines=2, progress=False) as lab:
    settings = ["fp32", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "powersgd",
                labkit.Strategy(dp=2, precision="bf16")]
    c = loss_curves(lab, model, settings=settings, batch=16, steps=30, lr=0.3, data=data, loss="cross_entropy")
    print(f"reference: final loss {c.reference_losses[-1]:.4f}, val {c.reference_val_losses[-1]:.4f}")
    print(f"{'setting':>22} {'KiB/step':>9} {'final loss':>10} {'val loss':>9} {'max|Δparam|':>12} {'step ms':>8}")
    for k in c.curves:
        label = k.label if k.label != "overlap none" else "autocast bf16 (precision)"
        print(f"{label:>22} {k.bytes_per_step[-1]/1024:9.1f} {k.losses[-1]:10.4f} {k.val_losses[-1]:9.4f} "
              f"{max(k.param_gaps):12.2e} {1000*k.step_time_s:8.1f}")
