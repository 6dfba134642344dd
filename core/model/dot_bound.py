"""How far an fp32 dot product may lie from the exact one, whatever its summation order.

Every kernel kvshelf puts beside MLX's matmul (sgemv, BLIS, the skinny product) sums in
another order than OpenBLAS's sgemm, so none is checked bit for bit against it: each is
checked to lie within this bound of the exact product, and a greedy token is provably the
same where the top logit wins by more than the bounds (``greedy_is_certain``).
"""

from __future__ import annotations

import numpy as np

UNIT_ROUNDOFF = 2.0**-24  # fp32


def _error_factor(k: int) -> float:
    """Higham's gamma_k: any fp32 summation order of a k-term dot product is this close."""
    # (k + 1) rather than k: one rounding more than a k-term sum can make, as a margin.
    ku = (k + 1) * UNIT_ROUNDOFF
    return ku / (1.0 - ku)


def dot_error_bound(weight: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Per-logit bound on |fp32 ``weight @ h`` − exact|, for any summation order.

    ``gamma_k * sum_j |w_ij h_j|``; two fp32 evaluations (sgemv and sgemm) therefore
    differ by at most twice this. The sum of absolute values is itself taken in fp32 (4x
    faster than fp64 over the embedded model's head, which the load-time check pays): a
    sum of non-negative terms is at most gamma_k below its exact value, so one more
    factor of (1 + gamma_k) keeps the result an upper bound. Computed in chunks so it
    never copies ``weight``.
    """
    gamma = _error_factor(weight.shape[1])
    ah = np.abs(h.astype(np.float32))
    out = np.empty(weight.shape[0], dtype=np.float32)
    step = 1 << 14
    for i in range(0, weight.shape[0], step):
        out[i : i + step] = np.abs(weight[i : i + step]) @ ah
    return gamma * (1.0 + gamma) * out.astype(np.float64)


def greedy_is_certain(logits: np.ndarray, bound: np.ndarray) -> bool:
    """True when the argmax of ``logits`` is the argmax of any other fp32 evaluation of
    the same products: the winner beats every other logit by more than both error bounds
    (``bound`` = ``dot_error_bound``, each evaluation within it of the exact value)."""
    a = int(np.argmax(logits))
    margin = logits[a].astype(np.float64) - logits.astype(np.float64) - 2 * (bound[a] + bound)
    margin[a] = np.inf
    return bool(np.all(margin > 0))
