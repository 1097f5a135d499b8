"""A stage's backward split in two: ``I`` (input gradient, now) and ``W`` (weight gradients, later).

Zero-bubble schedules (Qi et al., ICLR 2024, arXiv 2401.10241, §2) need the gradient w.r.t. a
stage's input at once, since the upstream stage waits for it, while the weight gradients can
wait to fill an idle slot. Both come from one autograd graph, so the split is:

* :func:`backward_input` runs the graph from the output down to the stage input only
  (``torch.autograd.grad(..., inputs=[stage_input], retain_graph=True)``). On the way it
  captures, with node pre-hooks, the gradient arriving at every node where a branch to the
  parameters leaves the input's path (for ``y = x @ W.T + b`` that is the ``addmm`` node: its
  input-grad half runs now, its weight half later).
* :func:`backward_weight` restarts autograd from those captured gradients
  (``torch.autograd.graph.GradientEdge``) towards the parameters only
  (``torch.autograd.backward(..., inputs=params)``). It recomputes nothing of the input path,
  and autograd's own AccumulateGrad fills ``.grad``, so gradient hooks fire in W as in a
  fused ``backward()``: post-accumulate hooks (labkit's overlap buckets, backward spans) and
  DDP's reducer.

The same arithmetic in the same order as the fused backward, so the gradients are bitwise
equal. torch.distributed.pipelining does it likewise (``stage_backward_input`` /
``stage_backward_weight`` in ``_backward.py``).

    >>> stage, x = nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    >>> out = stage(x)
    >>> grad_in, kept = backward_input(out, torch.ones_like(out), x, stage)   # send it upstream
    >>> grad_in.shape, stage.weight.grad is None
    (torch.Size([2, 4]), True)
    >>> backward_weight(kept)                        # later: the stage's .grad filled
    >>> stage.weight.grad.shape
    torch.Size([4, 4])
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class WeightGrad:
    """What one micro-batch's W needs from its I: per group of parameters, the graph nodes
    where their branch leaves the input path and the gradients captured there. Holding it
    keeps the stage's autograd graph (its saved activations) alive until W; W drops it."""

    params: list[nn.Parameter]
    groups: list[tuple[list, list[nn.Parameter]]] = field(default_factory=list)  # (nodes, params)
    captured: dict = field(default_factory=dict)     # node -> gradients arriving at it in I
    whole: tuple | None = None   # (output, output_grad) when no input path: W does it all

    def release(self) -> None:
        self.groups, self.captured, self.whole = [], {}, None


def backward_input(output: torch.Tensor, output_grad: torch.Tensor | None,
                   stage_input: torch.Tensor | None, module: nn.Module):
    """Gradient of the stage's `output` w.r.t. `stage_input`, and the state W needs.

    `output_grad` is the gradient from downstream (None for a scalar loss: ones). Returns
    ``(input_grad, state)``; ``input_grad`` is None when the input needs no gradient (the
    first stage) or the output does not depend on it, and then W does the whole backward.
    The caller should drop its own reference to `output` afterwards.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if output_grad is None:
        output_grad = torch.ones_like(output)
    state = WeightGrad(params)
    if not output.requires_grad:          # a stage with nothing to differentiate
        return None, state
    start = output.grad_fn or get_gradient_edge(output).node
    target = None
    if stage_input is not None and stage_input.requires_grad:
        target = get_gradient_edge(stage_input).node
    path = _input_path(start, target)
    if not path:
        state.whole = (output, output_grad)
        return None, state
    state.groups = _param_groups(path, params)
    handles = [node.register_prehook(_capture(state.captured, node))
               for nodes, _ in state.groups for node in nodes]
    try:
        (grad,) = torch.autograd.grad(output, stage_input, output_grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return grad, state


def backward_weight(state: WeightGrad) -> None:
    """Accumulate the weight gradients of one micro-batch into ``.grad``; frees its graph."""
    if state.whole is not None:
        output, grad = state.whole
        torch.autograd.backward(output, grad, inputs=state.params)
    for nodes, params in state.groups:
        edges, grads = [], []
        for node in nodes:
            for i, g in enumerate(state.captured.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        # Nodes of one group may feed each other (a parameter used twice): pin each to the
        # gradient it had in I, so what flows between them now is not counted twice.
        pins = [n.register_prehook(lambda _g, kept=state.captured.get(n): kept)
                for n in nodes] if len(nodes) > 1 else []
        try:
            torch.autograd.backward(edges, grads, inputs=params)
        finally:
            for h in pins:
                h.remove()
    state.release()


# -- the graph: which nodes lie on the input's path, which parameters hang off them ----------
def _input_path(start, target) -> set:
    """Nodes from which `target` (the stage input's node) is reachable; empty if none."""
    if target is None:
        return set()
    reaches, stack = {}, [(start, False)]
    while stack:                                   # iterative post-order: deep stages are fine
        node, expanded = stack.pop()
        if node in reaches:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if expanded:
            reaches[node] = node is target or any(reaches.get(c, False) for c in children)
            continue
        stack.append((node, True))
        stack += [(c, False) for c in children if c not in reaches]
    return {node for node, ok in reaches.items() if ok}


def _param_groups(path: set, params: list) -> list[tuple[list, list]]:
    """Per path node, the parameters on its branches off the path; nodes sharing a parameter
    are merged into one group."""
    by_leaf = {get_gradient_edge(p).node: p for p in params}
    owner: dict[int, int] = {}                      # id(param) -> group index
    groups: list[tuple[list, list]] = []
    for node in path:
        found = _params_below([c for c, _ in node.next_functions if c is not None and c not in path],
                              by_leaf)
        if not found:
            continue
        hit = sorted({owner[id(p)] for p in found if id(p) in owner})
        nodes, mine = [node], list(found)
        for g in hit:                               # merge with groups that share a parameter
            nodes += groups[g][0]
            mine += [p for p in groups[g][1] if all(p is not q for q in mine)]
            groups[g] = ([], [])
        groups.append((nodes, mine))
        for p in mine:
            owner[id(p)] = len(groups) - 1
    return [g for g in groups if g[0]]


def _params_below(roots: list, by_leaf: dict) -> list:
    seen, stack, found = set(), list(roots), []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in by_leaf:
            found.append(by_leaf[node])
        stack += [c for c, _ in node.next_functions if c is not None]
    return found


def _capture(store: dict, node):
    def hook(grad_outputs):
        store[node] = grad_outputs
    return hook
