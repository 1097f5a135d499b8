"""Hugging Face ``transformers`` causal language models from a config, with random weights.

``from_hf(config)`` takes a ``transformers`` config object or the path of a ``config.json``
(or of the folder holding one) and returns a picklable zero-argument factory: each call
builds ``AutoModelForCausalLM.from_config(config)`` under torch's current seed, so every
engine and :func:`labkit.reference` start from the same weights. Nothing is downloaded: the
config is read from the file or object given and the weights are drawn, never fetched
(``HF_HUB_OFFLINE=1`` is set, unless already set, before ``transformers`` is imported).

The model is called as ``model(x)`` and its ``.logits`` are used: labkit's data already
gives ``y`` shifted by one, so no ``labels`` are passed. A MoE model's router loss is off
(``output_router_logits=False``): transformers computes it over the whole batch (the
fraction of all tokens sent to each expert times the mean probability), a product of two
batch means that data-parallel shards do not reproduce, so runs could not equal one process.
``use_cache`` is off too: training needs no key/value cache.

A model built any other way (``transformers.Qwen2ForCausalLM(config)`` in the user's own
factory) is trained as it is: tensor parallelism reads its own ``model.tp_plan``
(:func:`model_tp_plan`), context parallelism reaches its attention through transformers'
attention registry (:mod:`labkit.parallel.context.hf`) and expert parallelism its sparse
blocks' fused experts (:func:`labkit.parallel.expert.fused_experts`).

Tensor parallelism uses the config's own ``base_model_tp_plan``, prefixed with the base
model's attribute (``model.layers.*.self_attn.q_proj``), in labkit's two styles:

* ``colwise``, ``rowwise`` are kept; ``local_colwise``/``local_rowwise`` (the same split,
  output left local) become them;
* a module whose parameters transformers replicates with an all-reduced gradient
  (``replicated_with_grad_allreduce``: Qwen3's per-head q/k norms) needs a gradient sum
  labkit's plans cannot express, so the whole attention it sits in stays unsplit;
* any other style (``colwise_rep``, ``gather``, ``sequence_parallel``, expert styles), and
  keys naming no ``nn.Linear`` of the model (dense-MLP keys on an all-MoE model; 3-d expert
  weights), are dropped. ``factory.dropped`` says what was dropped and why.

>>> make = labkit.models.from_hf("tests/data/hf/llama.json")
>>> make.n_head, make.n_kv_heads, sorted(make.tp_plan)[:1]
(4, 2, ['model.layers.*.mlp.down_proj'])
"""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
KEPT_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "local_colwise": "colwise", "local_rowwise": "rowwise"}
GRAD_ALLREDUCE = "replicated_with_grad_allreduce"
VOCAB_STYLES = {"colwise_gather_output": "colwise_gather_output", "embedding_rowwise": "rowwise"}


def _transformers():
    """Import transformers with hub access off (an optional extra: ``pip install -e ".[hf]"``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as err:
        raise ImportError('labkit.models.from_hf needs transformers: pip install -e ".[hf]"') from err
    return transformers


@dataclass(frozen=True)
class HFModel:
    """A factory for a transformers causal LM; ``config_json`` is its config as JSON text."""

    config_json: str
    attn_implementation: str = "sdpa"
    """"sdpa" (torch's scaled_dot_product_attention) or "eager": both exact on CPU."""

    @property
    def config(self):
        """A fresh transformers config object, with the router loss and the kv cache off."""
        fields = json.loads(self.config_json)
        config = _transformers().AutoConfig.for_model(**fields)
        config.use_cache = False
        if hasattr(config, "output_router_logits"):
            config.output_router_logits = False
        return config

    @property
    def model_type(self) -> str:
        return json.loads(self.config_json)["model_type"]

    @property
    def n_head(self) -> int:
        return self.config.num_attention_heads

    @property
    def n_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.n_head

    @property
    def block_size(self) -> int:
        return self.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def __call__(self) -> nn.Module:
        model = _transformers().AutoModelForCausalLM.from_config(
            self.config, attn_implementation=self.attn_implementation, dtype=torch.float32)
        self._annotate(model)
        return model

    def _annotate(self, model: nn.Module) -> None:
        """labkit's attributes on the built model: its tp plan and the head counts that tensor
        parallelism must divide."""
        model.tp_plan = dict(self.tp_plan)
        model.n_head, model.n_kv_heads, model.block_size = self.n_head, self.n_kv_heads, self.block_size

    @cached_property
    def _plans(self) -> tuple[dict, dict]:
        """(labkit's tp plan, {dropped key: why}), read off a model built on the meta device
        (no memory, no weights drawn)."""
        config = self.config
        with torch.device("meta"):
            model = _transformers().AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return translate_tp_plan(config.base_model_tp_plan or {}, model.base_model_prefix, model)

    @property
    def tp_plan(self) -> dict[str, str]:
        """The config's ``base_model_tp_plan`` in labkit's styles (see the module docstring)."""
        return self._plans[0]

    @property
    def dropped(self) -> dict[str, str]:
        """The keys of ``base_model_tp_plan`` left out of ``tp_plan``, each with the reason."""
        return self._plans[1]

    def check_tp(self, tp: int) -> None:
        """Raise ValueError unless ``tp`` ranks can each hold whole query and key/value heads."""
        for name, heads in (("num_attention_heads", self.n_head), ("num_key_value_heads", self.n_kv_heads)):
            if self.tp_plan and heads % tp:
                raise ValueError(f"from_hf: config.{name}={heads} does not divide by Strategy.tp={tp}: tp ranks "
                                 f"split the heads; use a tp that divides {heads}")

    def check_data(self, data) -> None:
        """Raise ValueError (naming the field and the fix) unless ``data`` fits this model."""
        t, vocab = getattr(data, "block_size", None), getattr(data, "vocab_size", None)
        if t is not None and t > self.block_size:
            raise ValueError(f"text: block_size={t} is longer than the config's max_position_embeddings="
                             f"{self.block_size}; use labkit.data.text(block_size≤{self.block_size})")
        if vocab is not None and vocab > self.vocab_size:
            raise ValueError(f"the config's vocab_size={self.vocab_size} is smaller than the data's vocab_size="
                             f"{vocab}; use a config with vocab_size ≥ {vocab}")


def translate_tp_plan(base_plan: dict, prefix: str, model: nn.Module) -> tuple[dict, dict]:
    """transformers' ``base_model_tp_plan`` → (labkit's plan, {dropped key: why})."""
    from labkit.parallel.tensor.plan import match_plan

    plan, dropped = {}, {}
    unsplit = {key.rpartition(".")[0] for key, style in base_plan.items() if style == GRAD_ALLREDUCE}
    for key, style in base_plan.items():
        full = f"{prefix}.{key}" if prefix else key
        if style == GRAD_ALLREDUCE:
            dropped[full] = f"{style!r}: labkit's plans cannot sum a replicated weight's gradient over tp"
        elif key.rpartition(".")[0] in unsplit:
            dropped[full] = (f"{style!r}: a sibling is {GRAD_ALLREDUCE!r}, so this module's parent stays whole "
                             f"(its replicated weight then sees every head on every rank)")
        elif style not in KEPT_STYLES:
            dropped[full] = f"{style!r} is not a split labkit does (colwise or rowwise)"
        else:
            matched = match_plan(model, {full: style})
            if not matched:
                dropped[full] = "names no module of this model"
            elif not all(isinstance(model.get_submodule(n), nn.Linear) for n in matched):
                dropped[full] = "names a module that is not an nn.Linear (labkit splits Linear layers)"
            else:
                plan[full] = KEPT_STYLES[style]
    return plan, dropped


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """A transformers model's own plan (``model.tp_plan``: its config's ``base_model_tp_plan``
    under the base model, with the head's and the embedding's) in labkit's styles, by
    :func:`translate_tp_plan`'s rules; the head ``colwise_gather_output`` and the embedding
    ``embedding_rowwise`` are split by vocabulary (tied: one shard serves both)."""
    own = dict(getattr(model, "tp_plan", None) or {})
    plan = translate_tp_plan(own, "", model)[0]
    for key, style in own.items():
        if style in VOCAB_STYLES and match_plan_modules(model, key, (nn.Linear, nn.Embedding)):
            plan[key] = VOCAB_STYLES[style]
    return plan


def match_plan_modules(model: nn.Module, key: str, kinds: tuple) -> bool:
    """Whether ``key`` names modules of ``model``, all of ``kinds``."""
    from labkit.parallel.tensor.plan import match_plan
    names = match_plan(model, {key: "colwise"})
    return bool(names) and all(isinstance(model.get_submodule(n), kinds) for n in names)


def from_hf(config, attn_implementation: str = "sdpa") -> HFModel:
    """A factory for a transformers causal LM of ``config`` (a config object, or the path of a
    ``config.json`` or of its folder) with random weights. Families: ``SUPPORTED``.

    >>> data = labkit.data.text(batch=8, block_size=64)
    >>> model = labkit.models.from_hf("tests/data/hf/qwen3_moe.json")
    >>> ref = labkit.reference(model, data=data, loss="cross_entropy", batch=8, lr=1e-3, optimizer="adamw")
    """
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"from_hf: attn_implementation={attn_implementation!r}; use 'sdpa' or 'eager'")
    fields = _config_fields(config)
    model_type = fields.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"from_hf: model_type={model_type!r} is not supported; use a config of one of "
                         f"{', '.join(SUPPORTED)}")
    return HFModel(json.dumps(fields, sort_keys=True), attn_implementation)


def _config_fields(config) -> dict:
    """The config as a plain dict (with ``model_type``), from an object or a JSON file."""
    if isinstance(config, (str, os.PathLike)):
        path = pathlib.Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"from_hf: config={str(config)!r} is not a file; pass the path of a config.json "
                             f"(or of the folder holding one) or a transformers config object")
        return json.loads(path.read_text())
    transformers = _transformers()
    if not isinstance(config, transformers.PretrainedConfig):
        raise ValueError(f"from_hf: config is a {type(config).__name__}; pass a transformers config object "
                         f"(e.g. transformers.LlamaConfig(...)) or the path of a config.json")
    return config.to_dict()
