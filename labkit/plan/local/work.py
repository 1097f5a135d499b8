"""What a model asks of the machine: its operations, counted at the batch's shapes, never timed.

A forward and a backward of the model run once on this process under a dispatch mode that
records every aten operation with its FLOPs (torch's own formulas,
``torch.utils.flop_counter``) and the bytes it reads and writes. Each operation is charged to
the block it ran in (the executor's blocks: :func:`labkit.parallel.blocks.units`), to the
part outside them (embedding before, head and loss after), or to the optimizer's step, and
to the ``nn.Linear`` it belongs to, so tensor parallelism can shard the right products.
A :class:`~labkit.plan.local.machine.Machine` prices the counts (:meth:`Machine.op_seconds`).

    >>> work = count(labkit.models.mlp(width=512, depth=8), batch=16)
    >>> work.blocks[0].fwd.flops, len(work.blocks[0].fwd.ops)
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ...training import build_model, call_model, resolve_data, resolve_loss
from .price import VIEWS

@dataclass(frozen=True)
class Op:
    """One aten call: its FLOPs (0 for memory-bound ones), its bytes, and the Linear it serves."""

    name: str
    flops: float
    bytes: float
    linear: str = ""
    weight_grad: bool = False
    """A product whose output is a weight's gradient (the W half of a split backward)."""
    operands: tuple = ()
    """(storage, bytes) of each tensor it reads or writes, for the cache (:func:`warm`)."""
    cold: float = 0.0
    """Bytes it reads or writes beyond the cache in a steady step (:func:`warm`)."""
    param: int = -1
    """An ``accumulate_grad``'s parameter: its index among its block's (as ``BlockWork.params``)."""
    factor: float = 1.0
    """Its piece's measured seconds over their price (:func:`timed`): 1 where the model was not timed."""
    paid: tuple = ()
    """Seconds per byte of each operand's refetch already in its piece's measured time (the
    operand's age in the timed sequence, :func:`timed`); () where the model was not timed."""


@dataclass
class Ops:
    """The operations of one piece of work (a block's forward, its backward, ...)."""

    ops: list = field(default_factory=list)

    @property
    def flops(self) -> float:
        return sum(o.flops for o in self.ops)

    def where(self, keep) -> "Ops":
        return Ops([o for o in self.ops if keep(o)])


@dataclass
class BlockWork:
    """One block at one micro-batch size: its forward's and backward's operations, its
    parameters (numel per tensor), its output's numel and its Linear layers' names."""

    name: str
    fwd: Ops
    bwd: Ops
    params: list[int]
    out_numel: int
    linears: dict = field(default_factory=dict)      # qualified name → (in_features, out_features)
    attention: list = field(default_factory=list)
    """(B, H, T, hd, Hkv) of each call to :func:`labkit.parallel.context.attention` (counted with
    ``cp`` > 1); its ops are left out and an Op named "attention" marks where it ran."""
    moe: list = field(default_factory=list)
    """(name, module) of each MoE layer whose routed experts ran (counted with ``ep`` > 1); an
    Op named "experts" marks where."""
    routed: list = field(default_factory=list)
    """Per parameter (as ``params``): whether it is a routed expert's (ep spreads those)."""
    names: list = field(default_factory=list)
    """Per parameter (as ``params``): its qualified name in the model (tp shards by its Linear)."""


@dataclass
class ModelWork:
    """A model's work per micro-batch of ``size`` samples (see the module docstring)."""

    size: int
    blocks: list[BlockWork]
    pre: BlockWork               # outside the blocks, before them (an embedding); may be empty
    post: BlockWork              # after them: final norm, head and the loss
    optimizer: Ops               # one optimizer step over every parameter (sgd or adamw)
    order: list = field(default_factory=list)
    """Every parameter in the model's registration order (the order gradient buckets fill in):
    the (piece, index among its ``params``) places that hold it, piece -1 the ``pre`` and
    len(blocks) the ``post``; a weight two blocks share (a tied embedding and head) has two."""


class _Counter(TorchDispatchMode):
    """Records each aten call into ``self.sink`` (a list), with the Linear ``self.linear`` names."""

    def __init__(self):
        super().__init__()
        self.sink, self.linear, self.weights, self.grads = [], "", set(), {}   # grads: storage → index
        self.by_storage, self.by_shape = {}, {}     # a Linear's weight → its name (backward has no hooks)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in VIEWS:            # no arithmetic, no bytes
            self.sink.append(Op(name, 0.0, 0.0, self.linear))
            return out
        formula = flop_registry.get(func.overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula else _missing_flops(name, args, out)
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        nbytes = float(sum(t.numel() * t.element_size() for t in tensors))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        wgrad = flops > 0 and any(tuple(t.shape) in self.weights for t in outs)
        param = self.grads.get(_storage(args[0]), -1) if name == "add_" else -1
        if param >= 0:
            name, wgrad = "accumulate_grad", True       # a backward adding into a parameter's gradient
        linear = self.linear
        if not linear and flops:        # backward: the product that reads a weight, or makes its gradient
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            linear = next((self.by_storage[p] for t in ins if (p := _storage(t)) in self.by_storage), "")
            linear = linear or next((self.by_shape[tuple(t.shape)] for t in outs if tuple(t.shape) in self.by_shape), "")
        operands = tuple(dict.fromkeys((_storage(t), t.numel() * t.element_size()) for t in tensors))
        self.sink.append(Op(name, flops, nbytes, linear, wgrad, operands, param=param))
        return out


def _missing_flops(name: str, args, out) -> float:
    """Products flop_registry lacks. torch's CPU flash attention: its formulas for the CUDA
    kernels (``sdpa_flop_count``: the two batched products, causal or not). ``_grouped_mm`` (a
    transformers MoE's fused experts, every expert's rows in one call): 2 FLOPs per output
    element per element of the dimension it sums over, which for two 2-D operands (a weight's
    gradient, grouped along that dimension) is the whole of it, each group its own slice."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
    if name == "_grouped_mm":
        a, b = args[0], args[1]
        if a.dim() == 2 and b.dim() == 2:
            return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
        return 2.0 * out.numel() * a.shape[-1]
    if name == "_scaled_dot_product_flash_attention_for_cpu":
        return float(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
    if name == "_scaled_dot_product_flash_attention_for_cpu_backward":
        return float(sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape))
    return 0.0


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


class _Marks:
    """Stand-ins while counting for cp > 1 or ep > 1: attention (as the context module) and each
    MoE layer's routed experts compute as one process with their ops left out of the count (the
    planner prices the cp mode's and the ep rank's own), a zero-cost Op ("attention",
    "experts") left where they ran, forward and backward, and what they ran on kept per block."""

    def __init__(self, counter):
        self.counter, self.block, self.shapes, self.moe = counter, None, {}, {}

    def positions(self, t, device=None):
        return torch.arange(t, device=device)

    def attention(self, q, k, v, causal):
        from ...parallel.context import local_attention
        self.shapes.setdefault(self.block, []).append((*q.shape[:3], q.shape[3], k.shape[1]))
        return _Hidden.apply(self.counter, "attention", lambda *qkv: local_attention(*qkv, causal), q, k, v)

    def experts(self, name, layer, attr):
        """``layer.attr`` (one of :func:`routed_parts`) computing as one process, marked "experts"."""
        inner = getattr(type(layer), attr).__get__(layer)

        def run(*args):
            self.moe.setdefault(self.block, []).append((name, layer))
            return _Hidden.apply(self.counter, "experts", inner, *args)
        return run


def routed_parts(net) -> list:
    """(name, module, attribute) of each MoE layer's routed experts, the part expert parallelism
    moves off its block: labkit's MoE's ``_routed``, a transformers sparse block's fused experts'
    ``forward`` (:func:`labkit.parallel.expert.fused_experts`)."""
    from ...parallel.expert import fused_experts, moe_layers
    return [(n, m, "_routed") for n, m in moe_layers(net)] + [(n, m, "forward") for n, m in fused_experts(net)]


class _Hidden(torch.autograd.Function):
    """``fn(*inputs)`` whose ops, forward and backward, go to no sink; an Op ``tag`` goes instead."""

    @staticmethod
    def forward(ctx, counter, tag, fn, *inputs):
        counter.sink.append(Op(tag, 0.0, 0.0))
        keep, counter.sink = counter.sink, []
        with torch.enable_grad():
            ctx.inputs = [z.detach().requires_grad_() if z.is_floating_point() else z for z in inputs]
            ctx.out = fn(*ctx.inputs)
        counter.sink, ctx.counter, ctx.tag = keep, counter, tag
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.counter.sink.append(Op(ctx.tag, 0.0, 0.0))
        keep, ctx.counter.sink = ctx.counter.sink, []
        wants = [z for z in ctx.inputs if z.requires_grad]
        got = iter(torch.autograd.grad(ctx.out, wants, grad, allow_unused=True))
        ctx.counter.sink = keep
        return (None, None, None, *[next(got) if z.requires_grad else None for z in ctx.inputs])


def _ops(fn) -> list:
    """The ops ``fn()`` runs, counted."""
    counter = _Counter()
    with counter:
        fn()
    return counter.sink


def _rows(x, fn):
    return {k: fn(v) for k, v in x.items()} if isinstance(x, dict) else fn(x)


def count(model, batch: int, data=None, loss="mse", optimizer: str = "sgd", blocks: str | None = None,
          cp: int = 1, ep: int = 1, marked: bool = True) -> ModelWork:
    """Count ``model``'s work on a micro-batch of ``batch`` samples (``data``: as lab.run's);
    ``cp`` > 1: on one cp rank's 1/cp of every sequence, attention marked, not counted;
    ``ep`` > 1: the MoE layers' routed experts marked, not counted; ``marked=False``: on the
    same shapes, attention and the experts counted as one process runs them."""
    from ...parallel.blocks import find_blocks
    net = build_model(model, 0)
    found = find_blocks(net, blocks)
    if not found:
        raise ValueError(f"count: {type(net).__name__} has no blocks (an nn.Sequential's children or an "
                         "nn.ModuleList of layers); the planner prices a model block by block")
    x, y = resolve_data(data, net, batch, 0)(0)
    x, y = _rows(x, lambda v: v[:batch]), y[:batch]      # a dict of inputs: each of its tensors
    if cp > 1:                       # a cp rank's share of the tokens (cp splits the sequence)
        x, y = _rows(x, lambda v: v[:, :v.shape[1] // cp]), y[:, :y.shape[1] // cp]
    rec = _Recording(net, found, marked=marked and (cp > 1 or ep > 1))
    for name, layer, attr in (routed_parts(net) if ep > 1 and marked else []):
        setattr(layer, attr, rec.marks.experts(name, layer, attr))
    rec.step(x, y, resolve_loss(loss), optimizer, cp)
    return rec.work(batch)


class _Recording:
    """One step of ``net`` under a :class:`_Counter`, each op sunk into the piece it ran in:
    (block i, "fwd"/"bwd"), ("pre" or "post", phase) outside the blocks, ("opt", "fwd")."""

    def __init__(self, net, found, marked: bool, counter=None):
        self.net, self.found, self.counter = net, found, counter if counter is not None else _Counter()
        self.marks = _Marks(self.counter) if marked else None
        self.pieces, self.outputs = {}, {}
        self.inside = {id(p) for _, b in found for p in b.parameters()}

    def sink(self, piece, phase: str) -> list:
        return self.pieces.setdefault((piece, phase), [])

    def watch(self) -> list:
        """Hooks: each Linear's name while it runs (tp shards by it), each block's entry and exit,
        forward and backward (which piece the ops go to)."""
        c, hooks = self.counter, []
        c.weights = {tuple(p.shape) for p in self.net.parameters() if p.dim() >= 2}
        for qual, mod in self.net.named_modules() if isinstance(c, _Counter) else ():
            if isinstance(mod, nn.Linear):
                c.by_storage.setdefault(_storage(mod.weight), qual)
                c.by_shape.setdefault(tuple(mod.weight.shape), qual)
                hooks += [mod.register_forward_pre_hook(lambda m, a, q=qual: setattr(c, "linear", q)),
                          mod.register_forward_hook(lambda m, a, o: setattr(c, "linear", ""))]
        if not isinstance(c, _Counter):        # timed: tensor hooks, as the lab's own spans (a full
            return self.watch_cheaply()         # backward hook's extra autograd nodes cost as much as a block)
        for i, (_, block) in enumerate(self.found):
            hooks += [block.register_forward_pre_hook(lambda m, a, i=i: self.enter(i, "fwd")),
                      block.register_forward_hook(lambda m, a, o, i=i: self.leave_forward(i, o)),
                      block.register_full_backward_pre_hook(lambda m, g, i=i: self.enter(i, "bwd")),
                      block.register_full_backward_hook(lambda m, gi, go, i=i: self.leave_backward(i, gi))]
        return hooks

    def watch_cheaply(self) -> list:
        """Each block's entry and exit in forward; in backward, its output's gradient arriving
        (its backward begins) and its input's (the piece before it begins)."""
        def entered(i, args):
            self.enter(i, "fwd")
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if i == 0 and first is not None and first.requires_grad:
                first.register_hook(lambda g: setattr(self.counter, "sink", self.sink("pre", "bwd")))

        def left(i, o):
            self.leave_forward(i, o)
            out = o[0] if isinstance(o, (tuple, list)) else o
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: self.enter(i, "bwd"))
        return [h for i, (_, block) in enumerate(self.found)
                for h in (block.register_forward_pre_hook(lambda m, a, i=i: entered(i, a)),
                          block.register_forward_hook(lambda m, a, o, i=i: left(i, o)))]

    def enter(self, i: int, phase: str) -> None:
        self.counter.sink = self.sink(i, phase)
        if self.marks is not None and phase == "fwd":
            self.marks.block = i

    def leave_forward(self, i: int, o) -> None:
        # timed: what runs from here to the next block's entry is this block's (or the loss's)
        self.counter.sink = self.sink("post" if isinstance(self.counter, _Counter) else ("after", i), "fwd")
        self.outputs[i] = o[0] if isinstance(o, (tuple, list)) else o

    def leave_backward(self, i: int, grads) -> None:
        # with an input that needs no gradient torch calls this before the block's own
        # backward has run: keep charging the block then
        if any(g is not None for g in grads):
            self.counter.sink = self.sink(i - 1 if i > 0 else "pre", "bwd")

    def step(self, x, y, lossfn, optimizer: str, cp: int) -> None:
        """Forward, loss, backward and the optimizer's step, as the executor runs them: every
        gradient already a tensor of zeros, so each backward adds into it."""
        from ...parallel import context
        from ...training import build_optimizer

        net, c = self.net, self.counter
        opt = build_optimizer(net.parameters(), lr=0.1, optimizer=optimizer)
        for p in net.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        for params in [[p for p in net.parameters() if id(p) not in self.inside]] + \
                [list(b.parameters()) for _, b in self.found]:
            c.grads.update((_storage(p.grad), j) for j, p in enumerate(params) if p.grad is not None)
        from contextlib import nullcontext
        from ...parallel.context.hf import routed

        hooks, before = self.watch(), context.current()
        marked = cp > 1 and self.marks is not None          # attention goes through the stand-in
        with c, routed(net) if marked else nullcontext():   # a transformers model's too, as the lab routes it
            c.sink = self.sink("pre", "fwd")
            if marked:
                context.activate(self.marks)
            try:
                value = lossfn(call_model(net, x), y)   # a dict as keyword tensors, as lab.run
                c.sink = self.sink("post", "bwd")
                with warnings.catch_warnings():     # block 0's input needs no gradient: torch says so, and it is fine
                    warnings.simplefilter("ignore", UserWarning)
                    value.backward()
            finally:
                context.activate(before)
                for h in hooks:
                    h.remove()
            c.sink = self.sink("opt", "fwd")
            opt.step()
            opt.zero_grad(set_to_none=False)

    def work(self, batch: int) -> ModelWork:
        linears = {q: (m.in_features, m.out_features) for q, m in self.net.named_modules() if isinstance(m, nn.Linear)}
        works = [self.block(i, name, module, linears) for i, (name, module) in enumerate(self.found)]
        ops = lambda piece, phase: Ops(self.pieces.get((piece, phase), []))       # noqa: E731
        in_blocks = {q for w in works for q in w.linears}
        # outside the blocks, by where the forward reads it: after the blocks (the final norm, the
        # head) the post's, held by the last pipeline stage; before them the pre's (the first
        # stage's); a weight both read (a tied embedding and head) both's, as the stages hold it
        outside = [(q, p) for q, p in self.net.named_parameters() if id(p) not in self.inside]
        read = {piece: {key for o in ops(piece, "fwd").ops for key, _ in o.operands} for piece in ("pre", "post")}
        parts = {"pre": [(q, p) for q, p in outside if _storage(p) in read["pre"] or _storage(p) not in read["post"]],
                 "post": [(q, p) for q, p in outside if _storage(p) in read["post"]]}
        pre, post = (BlockWork(piece, ops(piece, "fwd"), ops(piece, "bwd"), [p.numel() for _, p in parts[piece]], 0,
                               {q: v for q, v in linears.items() if q not in in_blocks} if piece == "pre" else {},
                               names=[q for q, _ in parts[piece]]) for piece in ("pre", "post"))
        where = {}
        for k, own in [(-1, [p for _, p in parts["pre"]])] + [(i, list(b.parameters())) for i, (_, b) in
                                                              enumerate(self.found)] + [(len(works), [p for _, p in parts["post"]])]:
            for j, p in enumerate(own):
                where.setdefault(id(p), []).append((k, j))
        order = [where[id(p)] for _, p in self.net.named_parameters() if id(p) in where]
        return ModelWork(batch, works, pre, post, ops("opt", "fwd"), order)

    def block(self, i: int, name: str, module, linears: dict) -> BlockWork:
        quals = {f"{name}.{q}" if q else name for q, m in module.named_modules() if isinstance(m, nn.Linear)}
        o, marks = self.outputs.get(i), self.marks
        return BlockWork(name, Ops(self.pieces.get((i, "fwd"), [])), Ops(self.pieces.get((i, "bwd"), [])),
                         [p.numel() for p in module.parameters()], 0 if o is None else o[0].numel(),
                         {q: linears[q] for q in quals}, marks.shapes.get(i, []) if marks else [],
                         marks.moe.get(i, []) if marks else [],
                         [".experts." in f".{q}" for q, _ in module.named_parameters()],
                         [f"{name}.{q}" for q, _ in module.named_parameters()])


def in_step_order(work: ModelWork) -> list:
    """[(key, Ops)] of ``work``'s pieces in the order a step runs them: the forwards, the loss,
    the backwards last block first, the optimizer; keys as :func:`labkit.plan.local.profile.profile`
    times them ((block i, "pre", "post" or "opt"), ("fwd" or "bwd"))."""
    n = len(work.blocks)
    return ([(("pre", "fwd"), work.pre.fwd)] + [((i, "fwd"), b.fwd) for i, b in enumerate(work.blocks)]
            + [(("post", "fwd"), work.post.fwd), (("post", "bwd"), work.post.bwd)]
            + [((i, "bwd"), work.blocks[i].bwd) for i in reversed(range(n))]
            + [(("pre", "bwd"), work.pre.bwd), (("opt", "fwd"), work.optimizer)])


def with_pieces(work: ModelWork, fn) -> ModelWork:
    """``work`` with each piece's Ops replaced by ``fn(key, ops)`` (keys as :func:`in_step_order`)."""
    from dataclasses import replace

    def block(b, name):
        return replace(b, fwd=fn((name, "fwd"), b.fwd), bwd=fn((name, "bwd"), b.bwd))
    return replace(work, blocks=[block(b, i) for i, b in enumerate(work.blocks)], pre=block(work.pre, "pre"),
                   post=block(work.post, "post"), optimizer=fn(("opt", "fwd"), work.optimizer))


def warm(work: ModelWork, cache_bytes: float) -> ModelWork:
    """``work`` with each op's ``cold`` bytes: the operands a cache of ``cache_bytes`` (least
    recently used out first) does not hold when the op runs, in a steady step's order (forward,
    backward, optimizer; the second of two steps). Weights a model reads once a step miss when
    the step touches more than the cache; a freed buffer the allocator hands out again hits."""
    from collections import OrderedDict
    from dataclasses import replace

    cache, held, cold = OrderedDict(), 0.0, {}
    for second in (False, True):
        for piece, ops in in_step_order(work):
            for k, op in enumerate(ops.ops):
                missed = 0.0
                for key, nbytes in op.operands:
                    if key in cache:
                        cache.move_to_end(key)
                        if nbytes > cache[key]:
                            held, cache[key] = held + nbytes - cache[key], nbytes
                    else:
                        missed, held, cache[key] = missed + nbytes, held + nbytes, nbytes
                    while held > cache_bytes and len(cache) > 1:
                        held -= cache.popitem(last=False)[1]
                if second:
                    cold[piece, k] = missed
    return with_pieces(work, lambda piece, ops: Ops([replace(op, cold=cold[piece, k]) for k, op in enumerate(ops.ops)]))


def unaccumulated(work: ModelWork) -> ModelWork:
    """``work`` without its backwards' adds into the gradients: ZeRO-3 hands each backward's
    gradients to its reduce-scatter and keeps none to add into."""
    from dataclasses import replace
    keep = lambda b: replace(b, bwd=b.bwd.where(lambda o: o.name != "accumulate_grad"))  # noqa: E731
    return replace(work, blocks=[keep(b) for b in work.blocks], pre=keep(work.pre), post=keep(work.post))
