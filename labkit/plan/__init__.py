"""The planner: predict a strategy's timeline, memory and step time, here and at scale.

Here (a few measured numbers of the lab's machine, any model priced from its own operations)::

    machine = labkit.plan.measure(lab)                  # no model: matmuls, collectives, host costs
    pred = labkit.plan.simulate(labkit.Strategy(dp=2, dp_mode="overlap"), machine,
                                model=labkit.models.mlp(width=256, depth=8), batch=64)
    pred.metrics["step_time_s"], pred.timeline.plot()

At scale (pure arithmetic, no engines)::

    model = labkit.plan.ModelShape(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048)
    cluster = labkit.plan.Cluster(nodes=128, hardware="a100")
    print(labkit.plan.search(model, cluster, global_batch=1536).table())
    $ labkit plan --layers 96 --hidden 12288 --heads 96 --gpus 1024 --hardware a100 --global-batch 1536

A Llama-family model (grouped-query attention, SwiGLU, mixture-of-experts) from its description
or a Hugging Face config.json::

    model = labkit.plan.from_hf_config("config.json", seq=8192)     # or labkit.plan.Decoder(...)
    labkit.plan.predict(model, labkit.plan.Cluster(nodes=64, hardware="h100"), 512, strategy)
    $ labkit plan --model-config config.json --seq 8192 --gpus 512 --hardware h100 --global-batch 512
"""
from .scale.hardware import A100, H100, H200, PRESETS, AlphaBeta, Cluster, Hardware, ModelShape, hardware
from .scale.layout import ClusterStrategy
from .scale.model import Decoder, from_hf_config
from .local.search import LabSearch, search_lab
from .scale.search import SearchResult, best_at, search
from .local.machine import Machine
from .local.measure import measure

from .local.physical import Simulated, overlay, simulate
from .scale.step import Prediction, predict

__all__ = ["A100", "H100", "H200", "PRESETS", "ModelShape", "Cluster", "Hardware", "AlphaBeta", "hardware", "ClusterStrategy",
           "Decoder", "from_hf_config",
           "Prediction", "predict", "search", "best_at", "SearchResult", "Simulated", "Machine", "measure",
           "simulate", "overlay", "search_lab", "LabSearch"]

