"""ZeRO-3 (P_os+g+p, Rajbhandari et al. 2020): parameters live as shards; each block is gathered
just before its forward and freed after, gathered again for its backward, and its gradient
reduce-scattered once its backward is done.

``prefetch`` = k: the gathers of the next k blocks are issued before a block's forward, the
previous k before its backward, so they run beside compute (FSDP's forward and backward
prefetch; torch's ``set_modules_to_forward_prefetch``). Without it every gather is waited for
on the spot.

Compute spans are taken here, per block, forward and backward, because where the wait sits
decides what the timeline says: a block's backward span opens only after its gather has been
waited for, and only after the block behind it (in backward order) has closed its span, so a
gather's wait is never drawn as compute. That is why the "backward starts" hook of block k is
called from the hook on block k+1's input (the same tensor as block k's output): one hook,
in a fixed order, instead of two hooks on one tensor whose order would decide the picture.
"""
from __future__ import annotations

import torch
from torch import nn

from ...record.instrument import BackwardSpan
from ..blocks import find_blocks, outside_blocks
from .shard import FlatUnit
from .sync import Zero2Sync


class Zero3Sync(Zero2Sync):
    """ZeRO-3: a unit per block, gathered around its forward and its backward, freed between."""

    times_forward = times_backward = True       # block spans taken here (see the module docstring)
    COLLECT_ON_SEND = False     # the oldest reduce-scatter is waited for between blocks, not inside one

    blocks_path = ""          # where the blocks are (labkit.parallel.blocks); "": a Sequential's children

    def build_units(self, model):
        """A unit per block with parameters, then the root's own group (what no block holds:
        embeddings, the final norm, the head), as FSDP's root ``fully_shard`` holds it."""
        units, self.unit_of = [], {}
        for name, block in self.blocks:
            members = [(f"{name}.{n}", p) for n, p in block.named_parameters() if p.requires_grad]
            if members:
                self.unit_of[name] = len(units)
                units.append(FlatUnit(len(units), members, self.group, self.dp, self.rank, f"block {name}"))
        self.n_blocks, self.root_unit = len(units), None
        rest = outside_blocks(model, self.blocks)
        if rest:
            self.root_unit = len(units)
            units.append(FlatUnit(len(units), rest, self.group, self.dp, self.rank, "root"))
        return units

    def wrap(self, model):
        self.blocks = find_blocks(model, self.blocks_path)
        names = [n for n, _ in self.blocks]
        self.previous = dict(zip(names[1:], names[:-1]))
        self.last_block = names[-1]
        self.spans = {}
        for name, block in self.blocks:
            params = [p for p in block.parameters() if p.requires_grad]
            span = self.spans[name] = BackwardSpan(self.recorder, f"{type(block).__name__} {name}", len(params))
            for p in params:       # before the reduce-scatter hooks: a span closes before any wait
                p.register_post_accumulate_grad_hook(span.param_ready)
        super().wrap(model)        # units (params become views), reduce-scatter hooks
        for unit in self.units:
            unit.free()
        if self.root_unit is not None:
            # Gathered for the whole forward and kept through backward (its parameters are used
            # at both ends of the model), freed once its gradient is sent: FSDP2 does not
            # reshard its root after forward, for the same reason.
            model.register_forward_pre_hook(lambda m, a: self._gather_root())
        self.outputs, self.chained = {}, set()
        for name, block in self.blocks:
            block.register_forward_pre_hook(lambda m, a, n=name: self._before_forward(n))
            block.register_forward_hook(lambda m, a, kw, out, n=name: self._after_forward(n, a, kw, out),
                                        with_kwargs=True)
        return model

    # -- forward: gather this block (and the next ``prefetch``), free after ----------------------
    def _gather_root(self) -> None:
        self._gather(self.root_unit)
        self.units[self.root_unit].wait()

    def _before_forward(self, name: str) -> None:
        i = self.unit_of.get(name)
        if i is not None:
            self._gather(i)
            self.units[i].wait()
            for j in range(i + 1, min(i + 1 + self.prefetch, self.n_blocks)):
                self._gather(j)             # issued now: runs beside this block's compute
        self._fwd_start = self.recorder.mark()

    def _after_forward(self, name: str, args, kwargs, out) -> None:
        self.recorder.add("fwd", f"F block {name}", self._fwd_start, self.recorder.mark(),
                          microbatch=getattr(self.recorder, "microbatch", None))
        if name in self.unit_of:
            self._free(self.unit_of[name])
        span = self.spans[name]
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        span.expects_input_grad = first is not None and first.requires_grad
        if span.expects_input_grad:
            first.register_hook(lambda _g, n=name: self._input_ready(n))
        if isinstance(out, (tuple, list)) and out:           # a layer that returns (hidden, …)
            out = out[0]
        self._link(name, first)
        if name == self.last_block and getattr(out, "requires_grad", False):
            out.register_hook(lambda _g, n=name: self._begin_backward(n))
        elif isinstance(out, torch.Tensor):
            self.outputs[name] = out

    def _link(self, name: str, first) -> None:
        """How block ``name``'s predecessor starts its backward. When this block's input is the
        predecessor's output (``x = layer(x)``), from this block's input gradient, one hook in a
        fixed order (the module docstring); otherwise (a residual added outside the blocks) from
        the predecessor's own output gradient, which autograd computes before that block's
        backward needs its gathered parameters."""
        before = self.previous.get(name)
        held = self.outputs.pop(before, None) if before is not None else None
        if held is None or held is first:
            self.chained.add(name)
            return
        self.chained.discard(name)
        if held.requires_grad:
            held.register_hook(lambda _g, n=before: self._begin_backward(n))

    # -- backward: gather again (and the previous ``prefetch``), reduce-scatter, free ------------
    def _input_ready(self, name: str) -> None:
        """Block ``name``'s input gradient exists: its span closes, the block before it begins.

        Its parameters' AccumulateGrad nodes may still be queued behind this hook; they only add
        a computed gradient into ``.grad``, so the span does not wait for them (it would
        otherwise stay open across the next block's gather and draw that wait as compute)."""
        self.spans[name].pending = 0
        self.spans[name].inputs_ready(None)
        if name in self.previous and name in self.chained:
            self._begin_backward(self.previous[name])

    def _begin_backward(self, name: str) -> None:
        self._collect_beyond(self.MAX_IN_FLIGHT)
        i = self.unit_of.get(name)
        if i is not None:
            self._gather(i)
            self.units[i].wait()
            for j in range(i - 1, max(i - 1 - self.prefetch, -1), -1):
                self._gather(j)
        self.spans[name].open(None)

    def _send_grads(self, unit):
        super()._send_grads(unit)
        self._free(unit.index)

    def _gather(self, i: int) -> None:
        unit = self.units[i]
        if not unit.gathered and unit.handle is None:
            self.param_meter.add(unit.nbytes)
        unit.gather()

    def _free(self, i: int) -> None:
        unit = self.units[i]
        if unit.gathered:
            unit.free()
            self.param_meter.sub(unit.nbytes)

    def finish(self) -> None:
        super().finish()
        for span in self.spans.values():
            span.finish()              # a block whose parameters got no gradient

    def after_step(self) -> None:
        pass                        # the next forward gathers the updated shards

    def full_state_dict(self, module: nn.Module) -> dict:
        """Every block gathered (a collective on every dp rank), copied, freed again."""
        for i in range(len(self.units)):
            self._gather(i)
        for i in range(len(self.units)):
            self.units[i].wait()
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        for i in range(len(self.units)):
            self._free(i)
        return state

    def held_bytes(self, module):
        shards = sum(u.shard_bytes() for u in self.units)
        held = {"params": shards, "params_peak": shards + self.param_meter.peak,
                "grads": shards, "grads_peak": shards + self.grad_meter.peak}
        self.param_meter.reset()
        self.grad_meter.reset()
        return held
