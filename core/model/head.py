"""The output projection at memory speed: a decode step's rows read the head once.

MLX's CPU backend runs every matmul as ``cblas_sgemm``. For the output projection of a
decode step (``h @ W.T`` with ``h`` one row per agent and ``W`` the vocab×hidden head,
262144×640 fp32 = 671 MB for the embedded Gemma 3) that sgemm costs 1.7-2.4× what
reading the head once costs (measured 64 vs 29 ms for one row), because OpenBLAS packs
the matrix for a product whose other side is a few vectors
(``benchmarks/mlx_gemv_repro.py`` shows it in a few lines, for upstream).

``ProjectedModel`` composes an mlx-lm model without changing it: it runs the model's
body (``model.model``; for a decode step of the default kernels, its numpy equivalent,
``kvshelf.model.native_decode``), then the projection itself. At batch 1 the last
position (the only one a decoder samples from), and each agent's row of a decode step of
up to ``MAX_FEW_ROWS`` agents, go through ``kvshelf.model.skinny`` over a zero-copy numpy
view of MLX's weight buffer: the row-invariant loop for the temperature-0 kernels (a
row's bits its own in any batch), register blocks of 2, 4 or 8 rows for the default ones
(``benchmarks/head_rows.py``: 8 rows in 50 ms where MLX's sgemm takes 136). Without numba,
one ``cblas_sgemv`` per row (``kvshelf.model.sgemv.each_row``). All other rows (the
positions before the last of a long call) go through MLX's own matmul, bit-identical to
the model's own call.

The sgemv is the one of the OpenBLAS that MLX's own matmuls use (``kvshelf.model.blas``
preloads it), called through ctypes (``kvshelf.model.sgemv``), not numpy's ``W @ h``: numpy bundles a second
OpenBLAS with its own thread pool, and the two pools' spinning threads fight over the
cores between the body's sgemms and the projection (measured: a whole decode step got
slower than MLX's own, though numpy's gemv alone was 2x faster). With one pool the step
gains what the projection gains. Without that OpenBLAS (macOS, ``KVSHELF_NO_OPENBLAS``)
the model keeps its own call.

Exactness, and where it ends: ``sgemv`` sums each dot product in another order than
``sgemm``, so the last position of a batch-1 call differs from MLX's own logits in the
last bits (up to 6e-5 on real hidden rows of the embedded model, whose logits reach
tens; always within ``dot_error_bound``). Every batch-1 call projects its last position
the same way, so prefill's last token (a short prompt in one call or a long one ending
with a 1-token call) and decode at batch 1 are bit-identical to one another, and a
restored agent continues exactly as one in RAM. The price: a batch-1 call of several
positions (a prefill chunk) pays that sgemv on top of MLX's rows, about 30 ms on the
embedded model, also for chunks whose logits are never read. In a decode step of several
agents each agent's hidden row gets, through its own sgemv, the logits it would get alone;
but the hidden rows themselves come from the body's projections, MLX's sgemm by default,
which were never bit-identical to one agent's row alone: OpenBLAS picks its sgemm kernel
by shape, and a row of a 3-row product differs from that row in an 8- or 1-row one (up
to 1e-6 on the tiny test models; the shape-invariant kernels, ``kvshelf.model.gemv``, take
every row through sgemv and so remove that). So, by default, batched decode equals
one-by-one decode token for token, not logit for logit: all rows
of one agent lie within ``dot_error_bound`` of each other, and the greedy token is
provably the same whenever the top logit wins by more than the bounds, which
``greedy_is_certain`` checks.

The gemv path is taken only where it is known to be the same function: unquantized
fp32 weights on the CPU device, an architecture whose ``__call__`` is exactly body then
projection (verified at load on a probe input: bit-identical to the model's own call
through MLX's matmul, and within the bound through gemv). Anything else (quantized
heads, logit soft-capping, GPU) runs the model's own ``__call__``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvshelf.model import half_weights
from kvshelf.model.arrays import buffer_view
from kvshelf.model.dot_bound import dot_error_bound
from kvshelf.model.few_rows import MAX_FEW_ROWS, Gemm
from kvshelf.model.native_decode import NativeDecoder
from kvshelf.model.sgemv import Sgemv, each_row, system_sgemv
from kvshelf.model.skinny import blocked_product, skinny_product, takes_codes


def _projection(model: nn.Module) -> tuple[Callable[[mx.array], mx.array], nn.Module] | None:
    """The model's own output projection and the layer holding its weight, if it has one of
    the two shapes mlx-lm uses (an ``lm_head`` or tied ``embed_tokens.as_linear``)."""
    if "lm_head" in model:
        head = model["lm_head"]
        return head, head
    body = model.get("model")
    if isinstance(body, nn.Module) and "embed_tokens" in body:
        emb = body["embed_tokens"]
        if hasattr(emb, "as_linear"):
            return emb.as_linear, emb
    return None


def _gemv_weight(layer: nn.Module) -> mx.array | None:
    """The weight if ``layer`` is a plain fp32 matrix that ``sgemv`` computes the same
    function with: an ``nn.Linear`` without bias or an ``nn.Embedding``, on the CPU."""
    if type(layer) not in (nn.Linear, nn.Embedding) or "bias" in layer:
        return None
    weight = layer["weight"]
    if weight.dtype != mx.float32 or weight.ndim != 2 or mx.default_device() != mx.cpu:
        return None
    return weight


class ProjectedModel:
    """An mlx-lm model whose batch-1 output projection runs as a matrix-vector product.

    Called like the model (``inputs``, ``cache``); every other attribute is the model's.
    """

    def __init__(
        self,
        model: nn.Module,
        project: Callable[[mx.array], mx.array],
        head: nn.Module,
        sgemv: Sgemv,
        body: nn.Module | None = None,
        all_rows: bool = False,
        skinny: bool = True,
        native: NativeDecoder | None = None,
    ) -> None:
        self.inner = model
        # What runs before the projection: the model's own body, or the same function
        # over the same weights with batch-1 projections through sgemv (kvshelf.model.gemv).
        self.body: nn.Module = body if body is not None else model.model
        # Every row through its own sgemv, one as many (kvshelf.model.gemv.SHAPE_INVARIANT): a
        # row's logits then do not depend on the batch or the call it was computed in.
        self._all_rows = all_rows
        self._project = project
        self._head = head
        self._sgemv = sgemv
        # A decode step's rows through a product that reads the head once for all of them
        # (kvshelf.model.skinny): with ``all_rows`` the row-invariant one (each row's bits its
        # own), else the fastest (a row's bits depend on its block, as in MLX's matmul);
        # without numba, one sgemv per row.
        self.skinny = skinny
        few = skinny_product() if all_rows else blocked_product()
        self._rows_apart: Gemm = (skinny and few) or partial(each_row, sgemv)
        # That product reads the head as fp16 or bf16 codes where they hold it (the same
        # bits from half the bytes: ``kvshelf.model.half_weights``); sgemv reads fp32.
        self._halves = bool(skinny and few) and takes_codes(self._rows_apart)
        # Decode steps the body's layers on numpy rows instead (kvshelf.model.native_decode),
        # where given and the call is one it takes; every other call goes through ``body``.
        self.native = native

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def weight_view(self) -> np.ndarray:
        """The head's weight as a read-only numpy array over MLX's own buffer (no copy).

        Looked up on every call, so weights replaced after loading are the ones used.
        """
        view = buffer_view(self._head["weight"])
        view.flags.writeable = False
        return view

    def rows_weight(self) -> np.ndarray:
        """The head as ``project_rows_apart``'s product reads it: its fp16 or bf16 codes where
        they hold it and the product reads them (made once a weight), else ``weight_view``."""
        half = half_weights.half_of(self._head["weight"]) if self._halves else None
        return half if half is not None else self.weight_view()

    def project_row(self, h: mx.array) -> mx.array:
        """Logits for one hidden row ``h`` (shape ``(hidden,)``), as ``project_rows_apart``."""
        return self.project_rows_apart(h[None])[0]

    def project_rows_apart(self, hidden: mx.array) -> mx.array:
        """Logits for every row of ``hidden`` (any leading shape), the head read once for all
        of them. With ``all_rows`` each row's bits are its own (the row-invariant skinny
        product, else one sgemv per row): they cannot depend on the rows computed with it.
        Otherwise a row alone has the same bits as ``all_rows`` gives it, and rows together
        those of the blocked product (``kvshelf.model.skinny.blocked_product``)."""
        rows = buffer_view(hidden.astype(mx.float32)).reshape(-1, hidden.shape[-1])
        return mx.array(self._rows_apart(rows, self.rows_weight())).reshape(*hidden.shape[:-1], -1)

    def project(self, hidden: mx.array) -> mx.array:
        """Logits for ``hidden`` of shape (batch, length, dim). Each row apart
        (``project_rows_apart``): every row, shape-invariant; else a decode step's (one
        position each of up to ``MAX_FEW_ROWS`` agents) and a batch-1 call's last position.
        Every other row (all positions of a long call: a perplexity pass) is MLX's matmul."""
        if self._all_rows or (hidden.shape[1] == 1 and hidden.shape[0] <= MAX_FEW_ROWS):
            return self.project_rows_apart(hidden)
        if hidden.shape[0] != 1:
            return self._project(hidden)
        last = self.project_row(hidden[0, -1])[None, None]
        return mx.concatenate([self._project(hidden[:, :-1]), last], axis=1)

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if self.native is not None and not kwargs and self.native.takes(inputs, cache):
            return self.project(self.native(inputs, cache))
        return self.project(self.body(inputs, cache, **kwargs))


def prefill_logits(model: nn.Module | ProjectedModel, inputs: mx.array, cache: Any, want: bool) -> mx.array | None:
    """One prefill call for one agent: the cache takes ``inputs``; the last position's
    logits come back only if ``want`` (a chunk before the last needs none).

    MLX is lazy, so through the model's own call an unread projection is never computed;
    the gemv path is eager, so it is asked only for the last position when wanted. That
    row is the very one ``ProjectedModel.__call__`` would give, so the result does not
    depend on how the prompt was cut into calls.
    """
    if isinstance(model, ProjectedModel):
        hidden = model.body(inputs, cache)
        return model.project(hidden[:, -1:])[0, -1] if want else None
    out = model(inputs, cache=cache)
    return out[0, -1] if want else None


def with_fast_head(model: nn.Module, probe_len: int = 4, skinny: bool = True) -> nn.Module | ProjectedModel:
    """``model`` wrapped as a ``ProjectedModel`` if that is provably the same function,
    else ``model`` itself.

    The probe runs the model's own ``__call__`` on a few tokens and requires (1) the body
    followed by MLX's projection to give bit-identical logits (no soft-capping or scaling
    the wrapper would miss) and (2) the gemv logits of the last position to lie within
    the dot-product error bound of the model's own.
    """
    found = _projection(model)
    sgemv = system_sgemv()
    if found is None or sgemv is None or _gemv_weight(found[1]) is None:
        return model
    wrapped = ProjectedModel(model, *found, sgemv, skinny=skinny)
    if not wrapped.weight_view().flags.c_contiguous:  # sgemv would need a copy per call
        return model
    vocab = found[1]["weight"].shape[0]
    probe = mx.array([[(7 * i + 1) % vocab for i in range(probe_len)]])
    try:
        reference = model(probe)
        hidden = model.model(probe)
        mx.eval(reference, hidden)
        if not mx.array_equal(found[0](hidden), reference).item():
            return model
        fast = np.asarray(wrapped(probe)[0, -1])
        ref_row = np.asarray(reference[0, -1])
        bound = dot_error_bound(wrapped.weight_view(), np.asarray(hidden[0, -1]))
    except Exception:  # an architecture whose body cannot be called on its own
        return model
    if fast.shape != ref_row.shape or not np.all(np.abs(fast.astype(np.float64) - ref_row) <= 2 * bound):
        return model
    return wrapped
