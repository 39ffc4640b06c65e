"""DDTree on the host, fast: build_ddtree_reference's best-first heap with cheaper keys, numbers and outputs.

The gateway builds every sequence's tree on the host each engine step, on the critical path. The reference
spends its time in torch's per-op overhead on tiny tensors and in rank tuples sliced, concatenated and compared
for every heap entry. This builder runs the very same heap over the very same scores, so it pops the same nodes
in the same order for any input (unsorted rows, ties, NaN, -inf):

- a rank tuple (r_1, .., r_d) is packed big-endian into one Python int, digit r_i + 1 at depth i and 0 past the
  end: integer order is the tuples' lexicographic order, a prefix before its extensions. Heap entries are
  (-score, packed ranks, parent node, cell, parent's -score, level), cell = the candidate's flat index in the
  [depth, k] tables, level = its depth's constants (`_levels`); the packed ranks are unique, so comparisons
  never look past them, as in the reference;
- scores are the reference's fixed point (`_quantize`: log-probs rounded to 2**-40, clamped to [-1024, 0],
  NaN -> -1024, summed exactly). A float32 log-prob in [-1024, -2**-17], or 0, is a multiple of 2**-40 already,
  and sums of such values up to 2**13 in magnitude are exact in float64, so a drafter's float32 log-probs are
  summed as they are, as Python floats: the same numbers without a quantizing pass. The first value read outside
  that range sends the build to Python ints, quantized with numpy exactly as `_quantize` does;
- the outputs are made from one numpy array per field rather than torch.tensor on Python lists.

`build_chain_host` does the same for a DFlash chain (`build_chain`'s row, in numpy). Where a C compiler is, the
heap runs in C on the fixed-point scores (ddtree_native.py: the same keys, so the same pops; the float sums above
are the fixed-point sums exactly, so either order is the reference's), and the Python heap only without one.
"""
from __future__ import annotations

import heapq
import math
import operator
from functools import lru_cache
from itertools import repeat

import numpy as np
import torch
from torch import Tensor

from ddtree_serve.decoding import ddtree_native
from ddtree_serve.decoding.ddtree import _LOGP_FLOOR, _SCALE_BITS, DraftTree, _check_topk, num_prefixes

__all__ = ["build_chain_host", "build_ddtree_host"]

_SCALE = float(2**_SCALE_BITS)
_FLOAT32_EXACT_MAX = -(2.0 ** (23 - _SCALE_BITS))  # a float32 this far from 0 is a multiple of 2**-40
_FLOAT64_EXACT_SUM = 2.0 ** (53 - _SCALE_BITS)  # sums of multiples of 2**-40 up to this are exact in float64
# per depth d: (end of the cells a node of depth d and its siblings take, +1 to its rank digit, +1 to its first
# child's rank digit, that child's cell, that child's level or None at the depth limit)
_Level = tuple
_Entry = tuple  # (-score, packed ranks, parent node, cell, parent's -score, level)
_Nodes = tuple[list, list[int], list[int]]  # per node, the root first: -score, parent node, cell (the root's -1)


def build_ddtree_host(
    logprobs: Tensor | np.ndarray, ids: Tensor | np.ndarray, budget: int, max_depth: int | None = None,
    root_token: int = 0, native: bool = True,
) -> DraftTree:
    """build_ddtree_reference's tree, bit for bit, several times faster on host tensors or numpy arrays (see the
    module doc); native=False: the Python heap even where the C one is built (for comparison)."""
    _check_topk(logprobs, ids, 2)
    lp, host_ids = _host_logprobs(logprobs), _host_array(ids)
    nodes, fixed_point = _pop_order(lp, budget, max_depth, native)
    tree = _tree(nodes, fixed_point, host_ids, root_token)
    return tree if isinstance(logprobs, np.ndarray) or logprobs.is_cpu else tree.to(logprobs.device)


def build_chain_host(logprobs: Tensor | np.ndarray, ids: Tensor | np.ndarray, max_depth: int | None = None,
                     root_token: int = 0) -> DraftTree:
    """build_chain's tree for one sequence, bit for bit: the top-1 token of each position, in numpy (host tensors
    or numpy arrays only)."""
    _check_topk(logprobs, ids, 2)
    n_pos, k = logprobs.shape
    cap = 0 if k == 0 else n_pos if max_depth is None else max(0, min(n_pos, max_depth))
    score = np.zeros(cap + 1, dtype=np.int64)
    np.cumsum(_quantize_np(_host_logprobs(logprobs)[:cap, :1].astype(np.float64).ravel()), out=score[1:])
    tokens = np.empty(cap + 1, dtype=np.int64)
    tokens[0] = root_token
    tokens[1:] = _host_array(ids)[:cap, :1].ravel()
    steps = np.arange(cap + 1, dtype=np.int64)
    # the reference's _dequantize: int64 -> float64, / 2**40 (exact), -> float32; the root's 0 as it sets it
    log_probs = (score.astype(np.float64) / _SCALE).astype(np.float32)
    return DraftTree(torch.from_numpy(tokens), torch.from_numpy(steps - 1), torch.from_numpy(steps),
                     torch.from_numpy(log_probs))


def _host_array(x: Tensor | np.ndarray) -> np.ndarray:
    """A numpy view of a host tensor (a copy of a device one); arrays as they are."""
    return x if isinstance(x, np.ndarray) else x.numpy(force=True)


def _host_logprobs(x: Tensor | np.ndarray) -> np.ndarray:
    """Log-probs as a numpy array, half precisions widened to float32 (exact)."""
    if isinstance(x, Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    lp = _host_array(x)
    return lp.astype(np.float32) if lp.dtype == np.float16 else lp


def _pop_order(lp: np.ndarray, budget: int, max_depth: int | None, native: bool = True) -> tuple[_Nodes, bool]:
    """The nodes in the reference heap's pop order, the root first, and whether their scores are fixed-point ints."""
    n_pos, k = lp.shape
    depth_limit = n_pos if max_depth is None else min(n_pos, max_depth)
    width = min(budget, k)  # only the top-min(B, K) tokens per position can be chosen
    if budget <= 0 or depth_limit <= 0 or width <= 0:
        return ([0], [-1], [-1]), False
    n_max = num_prefixes(width, depth_limit, budget)  # nodes the budget gets, root aside
    if native and ddtree_native.available(width, depth_limit):   # the same heap in C, on the fixed point
        values = lp[:depth_limit] if lp.dtype == np.float32 else _quantize_np(lp[:depth_limit])  # float32: in C
        return ddtree_native.best_first(values.ravel(), k, width, depth_limit, n_max, _LOGP_FLOOR), True
    if lp.dtype == np.float32:
        floor = -min(_LOGP_FLOOR, _FLOAT64_EXACT_SUM / depth_limit)
        nodes = _best_first(memoryview(lp.ravel()), floor, _FLOAT32_EXACT_MAX, _levels(k, width, depth_limit), n_max)
        if nodes is not None:
            return nodes, False
    q = memoryview(_quantize_np(lp[:depth_limit]).ravel())
    return _best_first(q, -math.inf, math.inf, _levels(k, width, depth_limit), n_max), True


def _best_first(values: memoryview, lo: float, hi: float, levels: list[_Level | None], n_nodes: int) -> _Nodes | None:
    """The root and the first n_nodes nodes the reference heap pops (values[cell]: the log-probs); None at the first
    value read outside [lo, hi] and not 0."""
    neg_scores, parents, cells = [0] * (n_nodes + 1), [-1] * (n_nodes + 1), [-1] * (n_nodes + 1)
    push, pushpop, pop = heapq.heappush, heapq.heappushpop, heapq.heappop
    heap: list[_Entry] = []
    x = values[0]
    if not lo <= x <= hi and x != 0:  # `not lo <= x` holds for NaN too
        return None
    level = levels[1]
    item = (-x, level[1], 0, 0, 0, level)
    for node in range(1, n_nodes):  # the last node's successors would never be popped: not made
        neg, packed, parent, cell, parent_neg, level = item
        neg_scores[node], parents[node], cells[node] = neg, parent, cell
        row_end, unit, child_unit, child_cell, child_level = level
        cell += 1
        if cell < row_end:  # next sibling: same parent, next rank
            x = values[cell]
            if not lo <= x <= hi and x != 0:
                return None
            push(heap, (parent_neg - x, packed + unit, parent, cell, parent_neg, level))
        if child_level is not None:  # first child: the best token of the next position
            x = values[child_cell]
            if not lo <= x <= hi and x != 0:
                return None
            item = pushpop(heap, (neg - x, packed + child_unit, node, child_cell, neg, child_level))
        else:  # not empty: the prefixes still to pop come from it
            item = pop(heap)
    neg_scores[n_nodes], _, parents[n_nodes], cells[n_nodes], _, _ = item
    return neg_scores, parents, cells


@lru_cache(maxsize=64)
def _levels(stride: int, width: int, depth_limit: int) -> list[_Level | None]:
    """levels[d], d = 1..depth_limit: the constants of depth d (see _Level); rank digits run 1..width, so a +1
    never carries into the digit above."""
    bits = width.bit_length()
    units = [0] + [1 << (bits * (depth_limit - d)) for d in range(1, depth_limit + 1)] + [0]
    levels: list[_Level | None] = [None] * (depth_limit + 2)
    for d in range(depth_limit, 0, -1):
        levels[d] = ((d - 1) * stride + width, units[d], units[d + 1], d * stride, levels[d + 1])
    return levels


def _tree(nodes: _Nodes, fixed_point: bool, ids: np.ndarray, root_token: int) -> DraftTree:
    """The DraftTree of the nodes, one numpy array per field."""
    neg_scores, parents, cells = nodes
    n = len(cells)
    if n > 1:
        cell = np.asarray(cells, dtype=np.int64)
        tokens = ids.ravel().take(cell).astype(np.int64, copy=False)
        depths = cell // ids.shape[1]
        depths += 1  # the root's cell is -1: depth 0
    else:
        tokens, depths = np.empty(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    tokens[0] = root_token  # the root's cell took the last id
    # 0 - x rather than -x: a zero score is +0.0, as the reference's int -> float conversion makes it
    if isinstance(neg_scores, np.ndarray):   # the C heap's int64 fixed point: the same _dequantize, in numpy
        scores = (np.negative(neg_scores).astype(np.float64) / _SCALE).astype(np.float32)
    elif fixed_point:  # the reference's _dequantize: int64 -> float64, / 2**40 (exact), -> float32
        scores = np.fromiter(map(operator.truediv, map(operator.neg, neg_scores), repeat(_SCALE)), np.float32, n)
    else:
        scores = np.fromiter(map(operator.sub, repeat(0.0), neg_scores), np.float32, n)
    return DraftTree(torch.from_numpy(tokens), torch.from_numpy(np.asarray(parents, dtype=np.int64)),
                     torch.from_numpy(depths), torch.from_numpy(scores))


def _quantize_np(logprobs: np.ndarray) -> np.ndarray:
    """`_quantize` in numpy: NaN -> floor (fmax drops NaN), clamp to [floor, 0], round to 2**-40, as int64."""
    x = np.fmax(logprobs, -_LOGP_FLOOR)
    np.minimum(x, 0.0, out=x)
    x *= _SCALE
    np.rint(x, out=x)
    return x.astype(np.int64)
