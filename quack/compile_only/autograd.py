"""Autograd's backward pass walked in Python, for fake CUDA tensors without a GPU.

torch's C++ autograd engine cannot run a graph of fake CUDA tensors on a
machine without a GPU: before any node runs it asks the CUDA runtime about
every device the fake device guard reports (``hasPrimaryContext``), which
throws.  Every route into that engine (``Tensor.backward``,
``torch.autograd.grad``, ``torch.func``, AOTAutograd) fails the same way.

The graph itself is fine: each node can be called from Python.  So while
compile-only mode is active on a CUDA build of torch, ``run_backward``
stands in for ``torch.autograd.graph._engine_run_backward`` (the one
function ``torch.autograd.backward`` and ``torch.autograd.grad`` hand the
engine's work to) and runs the graph as the engine does: dependencies
counted, ready nodes taken latest-created first, each gradient summed to
its input's shape and cast to its dtype, custom ``autograd.Function``
backwards called through their nodes, leaves' ``.grad`` accumulated with
their hooks.  The backward kernels of quack's ops (and of a user's own
Functions) are thereby warmed where the GPU run calls them.

Not reproduced (C++ state Python cannot read): hooks on non-leaf tensors and
on nodes (``grad_fn.register_hook``, module full backward hooks,
``register_multi_grad_hook`` and the DDP/FSDP reducers built on them), and
``retain_grad()`` of a non-leaf tensor (its ``.grad`` stays None).  A second
backward through a graph whose first ran without ``retain_graph`` succeeds
(the GPU run raises).  ``torch.func.vjp``'s returned function cannot be
walked (its graph belongs to a functorch level already exited): it fails
with a message saying so.
"""

from __future__ import annotations

import heapq
from typing import Any, Sequence

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, get_gradient_edge

_AccumulateGrad = type(get_gradient_edge(torch.zeros(1, requires_grad=True)).node)


def run_backward(
    outputs: Sequence[torch.Tensor | GradientEdge],
    grad_outputs: Sequence[torch.Tensor | None],
    keep_graph: bool,
    create_graph: bool,
    inputs: Sequence[torch.Tensor | GradientEdge] = (),
    allow_unused: bool = False,
    accumulate_grad: bool = True,
    allow_unreachable: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """``_engine_run_backward``'s contract: with ``accumulate_grad``
    (``backward``), accumulate into the leaves' ``.grad`` (only those of
    ``inputs`` when given) and return ``()``; without (``grad``), return the
    gradients of ``inputs``, None for an unused one where allowed."""
    del keep_graph  # the walk frees nothing
    with torch.set_grad_enabled(create_graph):
        walk = _Walk(outputs, grad_outputs, inputs, accumulate_grad, create_graph)
        return walk.run(allow_unused or allow_unreachable)


def _edge(t: torch.Tensor | GradientEdge, what: str, index: int) -> tuple[Any, int]:
    if isinstance(t, GradientEdge):
        return t.node, t.output_nr
    if not t.requires_grad:
        raise RuntimeError(f"element {index} of {what} does not require grad and does not have a grad_fn")
    try:
        with torch.enable_grad():
            edge = get_gradient_edge(t)
    except AttributeError as err:  # a dead functorch wrapper (torch.func.vjp's returned function)
        raise RuntimeError(
            f"compile-only mode cannot walk this backward graph ({err}): torch.func.vjp's returned function "
            "and other functorch transforms whose level has exited are not supported; use "
            "torch.autograd.grad, or mark the test no_compile_only"
        ) from None
    return edge.node, edge.output_nr


class _Walk:
    """One backward pass: the graph reachable from the roots, run node by node."""

    def __init__(self, outputs, grad_outputs, inputs, accumulate: bool, create_graph: bool):
        self.accumulate = accumulate
        self.create_graph = create_graph
        self.roots = [(*_edge(t, "tensors", i), g) for i, (t, g) in enumerate(zip(outputs, grad_outputs))]
        self.inputs = list(inputs)
        self.targets = [_edge(t, "inputs", i) for i, t in enumerate(self.inputs)]
        self.children = self._discover()
        self.runs = self._nodes_to_run()

    def _discover(self) -> dict:
        """Each reachable node's ``next_functions`` (iteratively: graphs may be deep)."""
        children, stack = {}, [node for node, _, _ in self.roots]
        while stack:
            node = stack.pop()
            if node in children:
                continue
            children[node] = [(child, nr) for child, nr in node.next_functions]
            stack.extend(child for child, _ in children[node] if child is not None and child not in children)
        return children

    def _nodes_to_run(self) -> set:
        """Every node without ``inputs``; with them, the nodes that hand a
        gradient on towards one (the engine's ``exec_info``), and the
        targets' own AccumulateGrad nodes when accumulating."""
        if not self.targets:
            return set(self.children)
        target_nodes = {node for node, _ in self.targets}
        needed = set(target_nodes)
        for node in reversed(self._topological()):
            if any(child in needed for child, _ in self.children[node] if child is not None):
                needed.add(node)
        runs = {n for n in needed if any(c in needed for c, _ in self.children.get(n, ()) if c is not None)}
        if self.accumulate:
            runs |= {n for n in target_nodes if isinstance(n, _AccumulateGrad)}
        return runs

    def _topological(self) -> list:
        """The reachable nodes, each before every node it hands gradients to."""
        pending = {node: 0 for node in self.children}
        for node, kids in self.children.items():
            for child, _ in kids:
                if child is not None:
                    pending[child] += 1
        order = [node for node, count in pending.items() if count == 0]
        for node in order:
            for child, _ in self.children[node]:
                if child is not None:
                    pending[child] -= 1
                    if pending[child] == 0:
                        order.append(child)
        return order

    def run(self, allow_unused: bool) -> tuple:
        target_nodes = {node for node, _ in self.targets}
        relevant = self.runs | target_nodes
        pending = dict.fromkeys(relevant, 0)
        for node in self.runs & self.children.keys():
            for child, _ in self.children[node]:
                if child in pending:
                    pending[child] += 1
        buffers: dict[Any, list] = {}
        for node, nr, grad in self.roots:
            if node in relevant:
                _add(buffers, node, nr, grad)
        ready = [_ready(node) for node, count in pending.items() if count == 0 and node in buffers]
        heapq.heapify(ready)
        captured: dict[Any, list] = {}
        done = set()
        while ready:
            node = heapq.heappop(ready)[2]
            if node in done:
                continue
            done.add(node)
            grads = buffers.pop(node, None) or [None] * len(node._input_metadata)
            if node in target_nodes:
                captured[node] = grads
            if node not in self.runs:
                continue
            for (child, nr), grad in zip(self.children[node], self._call(node, grads)):
                if child not in pending:
                    continue
                if grad is not None:
                    _add(buffers, child, nr, grad)
                pending[child] -= 1
                if pending[child] == 0:
                    heapq.heappush(ready, _ready(child))
        if self.accumulate:
            self._accumulate_non_leaf_targets(captured)
            return ()
        result = []
        for i, (node, nr) in enumerate(self.targets):
            grad = captured.get(node, [None] * (nr + 1))[nr]
            if grad is None and not allow_unused:
                raise RuntimeError(
                    "One of the differentiated Tensors appears to not have been used in the graph. "
                    "Set allow_unused=True if this is the desired behavior."
                )
            result.append(grad)
        return tuple(result)

    def _call(self, node, grads: list) -> list:
        """Run one node on its input gradients: its gradients per edge."""
        if isinstance(node, _AccumulateGrad):
            self._accumulate(node.variable, grads[0])
            return []
        if isinstance(node, BackwardCFunction):
            return _apply_function(node, grads)
        out = node(*grads)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _accumulate(self, leaf: torch.Tensor, grad: torch.Tensor | None) -> None:
        """The AccumulateGrad node: the leaf's hooks, then ``.grad``, then its post-accumulate hooks."""
        if grad is None:
            return
        for hook in (leaf._backward_hooks or {}).values():
            changed = hook(grad)
            grad = changed if changed is not None else grad
        if leaf.grad is None:
            leaf.grad = grad if self.create_graph else torch.empty_like(leaf).copy_(grad)
        elif self.create_graph:
            leaf.grad = leaf.grad + grad
        else:
            leaf.grad.add_(grad)
        for hook in (getattr(leaf, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(leaf)

    def _accumulate_non_leaf_targets(self, captured: dict) -> None:
        """``backward(inputs=[non-leaf])`` accumulates into that tensor's ``.grad``."""
        for t, (node, nr) in zip(self.inputs, self.targets):
            grads = captured.get(node)
            if isinstance(t, torch.Tensor) and not isinstance(node, _AccumulateGrad) and grads and grads[nr] is not None:
                t.grad = grads[nr] if t.grad is None else t.grad + grads[nr]


def _ready(node) -> tuple:
    """A heap entry: the latest-created node first (as the engine's ready queue); id breaks ties."""
    return (-node._sequence_nr(), id(node), node)


def _add(buffers: dict, node, nr: int, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``node``'s input ``nr``, fitted to that input as the
    engine does (``validate_outputs``): summed to its shape, cast to its dtype."""
    meta = node._input_metadata[nr]
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    if grad.dtype != meta.dtype:
        grad = grad.to(meta.dtype)
    slots = buffers.setdefault(node, [None] * len(node._input_metadata))
    slots[nr] = grad if slots[nr] is None else slots[nr] + grad


def _apply_function(node, grads: list) -> list:
    """A custom ``autograd.Function``'s backward, through its node: missing
    gradients become zeros (``materialize_grads``), and its results (one per
    forward argument) map to the node's edges, one per tensor argument: the
    k-th argument that needs a gradient owns the k-th edge that has a node."""
    grads = [
        g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
        for g, m in zip(grads, node._input_metadata)
    ]
    results = node.apply(*grads)
    results = results if isinstance(results, tuple) else (results,)
    wanted = [r for r, needed in zip(results, node.needs_input_grad) if needed]
    out, wanted_iter = [], iter(wanted)
    for child, _ in node.next_functions:
        out.append(next(wanted_iter, None) if child is not None else None)
    return out
