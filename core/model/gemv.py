"""The layers' projections through sgemv (shape-invariant: every row) or, asked, a decode batch's through BLIS.

A decode step multiplies one row per agent by every weight matrix of every layer
(q/k/v/o, gate/up/down). MLX's CPU backend runs each as ``cblas_sgemm``, which OpenBLAS
0.3.21 runs as a full matrix-matrix product that packs the weight before using it once.
``benchmarks/decode_profile.py`` measured the 126 one-row projections of the embedded
Gemma 3 at 38.5 ms through MLX and 19.2 ms through ``cblas_sgemv`` (load 1.1-1.3), and
``kvshelf.model.few_rows`` says what BLIS does for 2..16 rows.

``gemv_body`` builds a second module tree over the same arrays (nothing is copied but
the small module objects), in which every plain fp32 ``nn.Linear`` without a bias is a
``GemvLinear``: with ``all_rows`` (the shape-invariant kernels) every call through
``kvshelf.model.skinny.invariant_blocked_product`` (register blocks whose rows sum in one
order), or, without numba, through MLX's own matmul as ``kvshelf.model.row_plan`` lays it
out (each row with its one-row product's bits), or, for a weight shape without a plan,
every row to its own ``sgemv`` (``kvshelf.model.sgemv.each_row``); otherwise 2..16 rows go to BLIS (where
installed, and only with ``batches``: off by default, see ``kvshelf.model.few_rows``), one
row to ``sgemv`` only with ``one_row`` (off by default: see ``ONE_ROW_SGEMV``), and anything
else is the wrapped layer's own call, bit for bit. The model itself is not changed, so the plain model (what
mlx-lm, the spec probe and every long prompt see) stays what it was. Each wrapped layer
is checked once at build time: its rows on a probe lie within the fp32 dot-product error
bound of MLX's, else it keeps its own call.

Exactness, and where it ends: every call of a given shape takes the same path, so an
agent restored from disk continues bit-identically to one kept in RAM (same calls on the
same state). A batch of several agents runs MLX's (or, asked, BLIS's) rows, which round
differently from a lone agent's in the last bits (OpenBLAS picks its sgemm kernel by
shape); batched decoding stays equal to one-by-one decoding token for token where no two
logits are within that rounding. With ``all_rows`` a row's bits are its own, in any batch.
"""

from __future__ import annotations

import os
from functools import cache, partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvshelf.model import half_weights
from kvshelf.model.attention import invariant_attention_body
from kvshelf.model.dot_bound import dot_error_bound
from kvshelf.model.few_rows import MAX_FEW_ROWS, Gemm, batches_through_blis, gemm_uncut, system_gemm
from kvshelf.model.grouped_attention import grouped_attention_body
from kvshelf.model.head import ProjectedModel, buffer_view, with_fast_head
from kvshelf.model.module_tree import with_children
from kvshelf.model.native_decode import native_decoder
from kvshelf.model.row_plan import RowPlan, measure
from kvshelf.model.sgemv import Sgemv, each_row, system_sgemv
from kvshelf.model.skinny import (
    MAX_LAYER_ROWS,
    MIN_LAYER_BYTES,
    blocked_product,
    invariant_blocked_product,
    takes_codes,
)
from kvshelf.switches import ON, env_on

# Whether a batch-1 call's layer projections go to sgemv too. Off: measured alone they
# take half of MLX's time (19.2 against 38.5 ms on the embedded Gemma 3), but each call
# makes MLX evaluate the step's graph up to it, and in a whole step those 126-210 syncs
# cost what sgemv saves (benchmarks/decode_profile.py, load 1.1-1.3: 104.6 against 104.5
# ms a step on Gemma 3; the llama's body 128.4 against 107.1 ms). A decode batch's BLIS
# products save more per call than a sync costs.
ONE_ROW_SGEMV = False

# Whether every projection (the layers' and the head's), of any number of rows (a decode step
# of 1..16 agents, a prefill chunk), runs so that a row's bits are those of that row alone,
# where OpenBLAS's sgemm picks another kernel by shape (a row of a 16-, 32- or 48-row product
# differs from the 1-row one in the last bits, and MLX's matmuls are OpenBLAS's): the layers'
# through ``kvshelf.model.skinny.invariant_blocked_product`` (since 2026-12-05: a 1K prefill of
# the embedded Gemma 3 about 35% faster than through the row plan; figures in the README),
# without numba through MLX's matmul laid out by ``kvshelf.model.row_plan`` (since
# 2026-12-03; prefill 25-27% faster than before, ``benchmarks/invariant_profile.py``), the head through
# ``kvshelf.model.skinny`` (row-invariant by construction; without numba, one sgemv per row),
# any layer shape without a plan as one sgemv per row (``kvshelf.model.sgemv.each_row``; checked at load: a row
# of a product of up to 600 rows equals that row alone, bit for bit). Until 2026-12-02 these
# rows went through BLIS's small-matrix product, which is row-invariant too but computes a
# decode step's 1-6 rows as slowly as six (``each_row`` has the figures).
# So a token's K/V and logits no longer depend on how many rows were computed with it;
# what still does is attention (MLX's kernels, ~2e-7): ``kvshelf.model.attention``. Off by
# default for sampling (see benchmarks/invariance.py for what it changes and costs);
# ``KVSHELF_SHAPE_INVARIANT=1``
# turns it on for the models loaded afterwards.
_SWITCH = os.environ.get("KVSHELF_SHAPE_INVARIANT", "").lower()
SHAPE_INVARIANT = _SWITCH in ON
# Requests at temperature 0 (and prefill-only ones, whose cache a greedy turn may extend)
# run the shape-invariant kernels unless ``KVSHELF_SHAPE_INVARIANT=0``: the engine's
# ``LoadedModel.greedy_forward``. Unset, the switch means exactly that: invariant at
# temperature 0, the faster default kernels when sampling.
GREEDY_INVARIANT = _SWITCH not in ("0", "false", "no")

# Whether the default kernels' decode steps run each KV head's query heads as one product
# (``kvshelf.model.grouped_attention``) rather than MLX's CPU attention, one product per query
# head (those the native step takes, ``kvshelf.model.native_decode``, run neither).
# ``KVSHELF_MLX_SDPA=1`` keeps MLX's (what ``benchmarks/decode.py --paths mlx-sdpa`` compares).
GROUPED_DECODE = not env_on("KVSHELF_MLX_SDPA")


class GemvLinear(nn.Module):
    """An ``nn.Linear`` (no bias, fp32) whose one-row calls run as ``cblas_sgemv`` and,
    given a product ``gemm``, calls of 2..``MAX_FEW_ROWS`` rows (a decode batch) through it
    (BLIS's skinny-matrix product, ``kvshelf.model.few_rows``), or, ``all_rows``, calls of
    any number of rows (the shape-invariant kernels: ``gemm`` is then ``each_row``'s).

    With ``all_rows`` and a ``plan`` for its weight's shape (``kvshelf.model.row_plan``, built
    only where ``gemm`` is ``each_row``'s), every call runs in MLX's graph instead, each row
    with the bits of MLX's one-row product.

    The wrapped layer is a child, so its weight is this module's parameter too (shared,
    not copied): weights loaded into the model later are the ones used."""

    def __init__(
        self,
        linear: nn.Linear,
        sgemv: Sgemv,
        gemm: Gemm | None = None,
        one_row: bool = True,
        all_rows: bool = False,
        plan: RowPlan | None = None,
        skinny: bool = False,
    ) -> None:
        super().__init__()
        self.linear = linear
        self._sgemv = sgemv
        self._gemm = gemm
        self._one_row = one_row  # send a single row to sgemv (else MLX's own call)
        # ``gemm`` is the blocked skinny product: 1..MAX_LAYER_ROWS rows go to it, more to MLX's own call
        self._skinny = skinny and gemm is not None
        self._all_rows = all_rows and gemm is not None  # every row count through gemm (SHAPE_INVARIANT)
        self._plan = plan if self._all_rows else None
        # A decode step's rows read the weight's fp16 or bf16 codes where they hold it and
        # ``gemm`` reads them with the fp32 bits (``kvshelf.model.half_weights``); a prefill
        # chunk, bound by its arithmetic, reads fp32 (a conversion per use costs it there).
        self._halves = gemm is not None and takes_codes(gemm)

    def gemv(self, x: mx.array) -> mx.array:
        """``x @ W.T`` for one row ``x`` (any leading shape of size 1) through sgemv."""
        weight = buffer_view(self.linear["weight"])
        y = self._sgemv(weight, buffer_view(x.astype(mx.float32)).reshape(-1))
        return mx.array(y).reshape(*x.shape[:-1], weight.shape[0])

    def few_rows(self, x: mx.array) -> mx.array:
        """``x @ W.T`` for several rows through the plan, else ``gemm``."""
        if self._plan is not None:
            rows = self._plan.matmul(x.reshape(-1, x.shape[-1]), self.linear["weight"])
            return rows.reshape(*x.shape[:-1], -1)
        assert self._gemm is not None
        weight = buffer_view(self.linear["weight"])
        if self._halves and x.size // x.shape[-1] <= MAX_LAYER_ROWS:
            half = half_weights.half_of(self.linear["weight"])
            weight = weight if half is None else half
        y = self._gemm(buffer_view(x.astype(mx.float32)).reshape(-1, x.shape[-1]), weight)
        return mx.array(y).reshape(*x.shape[:-1], weight.shape[0])

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if self._all_rows and x.dtype == mx.float32:
            return self.few_rows(x)
        if self._skinny and x.dtype == mx.float32:
            return self.few_rows(x) if rows <= MAX_LAYER_ROWS else self.linear(x)
        if x.dtype != mx.float32 or rows > MAX_FEW_ROWS or (rows > 1 and self._gemm is None):
            return self.linear(x)
        if rows > 1:
            return self.few_rows(x)
        return self.gemv(x) if self._one_row else self.linear(x)


def _eligible(layer: nn.Module) -> bool:
    if type(layer) is not nn.Linear or "bias" in layer:
        return False
    weight = layer["weight"]
    return weight.dtype == mx.float32 and weight.ndim == 2 and mx.default_device() == mx.cpu


def _agrees(layer: GemvLinear, checked: dict[tuple, bool] | None = None) -> bool:
    """Probe rows through sgemv (and BLIS) lie within the fp32 error bound of the layer's own.

    ``checked``: verdicts by weight shape, so that the layers of one shape (every layer's
    q_proj, say) are probed once per build: the kernels, and so whether they compute the
    layer's product, depend on the shape, not on the weights' values."""
    weight = buffer_view(layer.linear["weight"])
    if not weight.flags.c_contiguous:  # sgemv would need a copy per call
        return False
    key = (weight.shape, layer._gemm is not None)
    if checked is not None and key in checked:
        return checked[key]
    agrees = _probe_agrees(layer, weight)
    if checked is not None:
        checked[key] = agrees
    return agrees


def _probe_agrees(layer: GemvLinear, weight: np.ndarray) -> bool:
    cols = weight.shape[1]
    probe = mx.sin(mx.arange(2 * cols, dtype=mx.float32) * 0.37).reshape(2, 1, cols)
    own = np.asarray(layer.linear(probe)).reshape(2, -1)
    fast = [np.asarray(layer.gemv(probe[:1])).reshape(1, -1)]
    if layer._gemm is not None:
        fast.append(np.asarray(layer.few_rows(probe)).reshape(2, -1))
    for got in fast:
        for i, row in enumerate(got):
            bound = dot_error_bound(weight, np.asarray(probe[i]).reshape(-1))
            if not np.all(np.abs(row.astype(np.float64) - own[i]) <= 2 * bound):
                return False
    return True


def gemv_body(
    module: nn.Module,
    sgemv: Sgemv,
    gemm: Gemm | None = None,
    wrapped: list[GemvLinear] | None = None,
    one_row: bool = True,
    all_rows: bool = False,
    checked: dict[tuple, bool] | None = None,
    plans: bool = True,
    skinny: bool = False,
) -> nn.Module:
    """A copy of ``module``'s module tree over the same arrays, with every eligible
    ``nn.Linear`` a ``GemvLinear`` (those that pass the probe, once per weight shape;
    ``wrapped`` collects them). With ``all_rows`` and ``plans``, each layer whose weight's
    shape has a ``kvshelf.model.row_plan`` runs through it rather than through ``gemm``;
    ``skinny``: ``gemm`` is ``kvshelf.model.skinny``'s blocked product, for 1..MAX_LAYER_ROWS rows
    of a weight of at least MIN_LAYER_BYTES (a smaller one keeps MLX's own call)."""
    checked = {} if checked is None else checked
    if _eligible(module):
        plan = measure(module["weight"]) if all_rows and plans else None
        small = skinny and module["weight"].nbytes < MIN_LAYER_BYTES  # MLX's own product is cheaper
        linear: nn.Linear = module  # type: ignore[assignment]  # _eligible: exactly an nn.Linear
        layer = GemvLinear(linear, sgemv, None if small else gemm, one_row, all_rows, plan, skinny and not small)
        if _agrees(layer, checked):
            if wrapped is not None:
                wrapped.append(layer)
            return layer
        return module
    if not module.children():  # a leaf that stays as it is (a norm, an embedding, a biased linear)
        return module
    return with_children(
        module, lambda m: gemv_body(m, sgemv, gemm, wrapped, one_row, all_rows, checked, plans, skinny)
    )


def with_fast_linears(
    model: nn.Module,
    one_row: bool = ONE_ROW_SGEMV,
    all_rows: bool | None = None,
    batches: bool | None = None,
    attention: bool | None = None,
    head: nn.Module | ProjectedModel | None = None,
    grouped: bool = GROUPED_DECODE,
    plans: bool = True,
    skinny: bool = True,
    native: bool = True,
) -> nn.Module | ProjectedModel:
    """``with_fast_head(model)`` whose body also runs its batch-1 projections through sgemv
    (``one_row``) and a decode batch's through BLIS (``batches``; None: ``few_rows``'s default),
    or (``all_rows``, None: ``SHAPE_INVARIANT``) every row of every projection with bits
    independent of the others: through ``kvshelf.model.skinny.invariant_blocked_product``
    (with ``skinny`` and numba), else through ``kvshelf.model.row_plan`` where its weight's
    shape has a plan (and ``plans``), else as its own sgemv (``kvshelf.model.sgemv.each_row``).
    ``attention`` (None: ``SHAPE_INVARIANT``): every attention module of a known shape runs
    ``kvshelf.model.attention.invariant_attention`` (rows independent of the call's shape,
    each KV head read once for its query heads); otherwise, ``grouped``, decode steps' attention
    runs ``kvshelf.model.grouped_attention`` (each KV head's query heads as one product).

    Only where the head itself could be wrapped (fp32 on the CPU with the system OpenBLAS
    and an architecture that is body then projection), and only if the copied body is
    the same function: bit-identical to the model's own body on a multi-token probe
    (every row there goes through MLX's matmul in both). ``head``: ``with_fast_head(model)``
    already built (a ``LoadedModel``'s ``forward``), so its probe is not run twice.

    ``native``: the default kernels' decode steps (up to MAX_LAYER_ROWS agents, the skinny
    products) run their layers on numpy rows (``kvshelf.model.native_decode``) where the
    architecture is one it knows and its probe agrees with the body; never ``all_rows``'s."""
    fast = _head_of(model, head, skinny)
    sgemv = system_sgemv()
    if not isinstance(fast, ProjectedModel) or sgemv is None:
        return fast
    invariant = SHAPE_INVARIANT if attention is None else attention
    gemm: Gemm | None = None
    all_rows = (SHAPE_INVARIANT if all_rows is None else all_rows) and _rows_invariant()
    skinny_rows = None if all_rows or batches or not skinny else blocked_product()
    invariant_rows = invariant_blocked_product() if all_rows and skinny else None
    if all_rows:
        # row-invariant register blocks where numba is there (no plan needed), else a plan or sgemv rows
        gemm = invariant_rows if invariant_rows is not None else partial(each_row, sgemv)
        plans = plans and invariant_rows is None
    elif skinny_rows is not None:  # a decode step's 1..MAX_LAYER_ROWS rows, each weight read once
        gemm = skinny_rows
    elif batches_through_blis() if batches is None else batches:
        # a decode batch's rows through BLIS only when asked (kvshelf.model.few_rows says why)
        gemm = system_gemm()
        if gemm is not None and not _split_invariant(gemm):  # column parts not the one call's bits: one call
            gemm = gemm_uncut
    wrapped: list[GemvLinear] = []
    body = gemv_body(model.model, sgemv, gemm, wrapped, one_row, all_rows, plans=plans, skinny=skinny_rows is not None)
    if not wrapped:
        return _with_attention(fast, invariant, grouped)
    probe = mx.array([[(5 * i + 3) % 97 for i in range(MAX_FEW_ROWS + 1)]])
    try:
        got, own = body(probe), model.model(probe)
        # every row through MLX in both, else (all rows through sgemv) the same up to rounding
        same = (mx.allclose(got, own, rtol=1e-3, atol=1e-3) if all_rows else mx.array_equal(got, own)).item()
    except Exception:  # a body whose copy cannot be called: keep the model's own
        return fast
    if not same:
        return _with_attention(fast, invariant, grouped)
    body = _attention_body(body, invariant, grouped)
    decoder = None
    if native and skinny_rows is not None:
        decoder = native_decoder(model, skinny_rows, body)
    elif native and invariant_rows is not None and invariant:  # temperature 0's, with the body's bits
        decoder = native_decoder(model, invariant_rows, body, exact=True)
    return ProjectedModel(
        model, fast._project, fast._head, sgemv, body=body, all_rows=all_rows, skinny=skinny, native=decoder
    )


def _head_of(model: nn.Module, built: nn.Module | ProjectedModel | None, skinny: bool) -> nn.Module | ProjectedModel:
    """``with_fast_head(model)``, taken from ``built`` (a forward over the same model) when
    that has it: the same head, projection and sgemv, already verified."""
    if isinstance(built, ProjectedModel) and built.inner is model:
        return ProjectedModel(model, built._project, built._head, built._sgemv, skinny=skinny)
    if built is model:  # the head was found not to be the model's own function: nothing to wrap
        return model
    return with_fast_head(model, skinny=skinny)


def _with_attention(fast: ProjectedModel, invariant: bool, grouped: bool) -> ProjectedModel:
    """``fast`` with its body's attention modules made invariant or grouped, if asked."""
    body = _attention_body(fast.body, invariant, grouped)
    if body is fast.body:
        return fast
    return ProjectedModel(fast.inner, fast._project, fast._head, fast._sgemv, body=body, skinny=fast.skinny)


def _attention_body(body: nn.Module, invariant: bool, grouped: bool) -> nn.Module:
    """``body`` with its attention modules invariant (``kvshelf.model.attention``), else, asked,
    grouped for decode (``kvshelf.model.grouped_attention``), else as they are."""
    if invariant:
        return invariant_attention_body(body)
    return grouped_attention_body(body) if grouped else body


@cache
def _rows_invariant() -> bool:
    """A row of ``each_row``'s product does not depend on how many rows come with it (checked
    up to 600 rows, on a weight of more rows than the size thresholds at which BLAS libraries
    change kernels). True by construction, one sgemv per row; checked once a process because
    what it rests on is the BLAS: an sgemv whose threads split a product otherwise from one
    call to the next would fail it."""
    sgemv = system_sgemv()
    if sgemv is None:
        return False
    gemm = partial(each_row, sgemv)
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((512, 640)).astype(np.float32)
    x = rng.standard_normal((600, 640)).astype(np.float32)
    full = gemm(x, weight)
    one = np.concatenate([gemm(x[i : i + 1], weight) for i in range(0, 600, 37)])
    return np.array_equal(one, full[::37]) and all(
        np.array_equal(gemm(x[:m], weight), full[:m]) for m in (2, 7, 16, 17, 48, 64, 201, 257, 300)
    )


@cache
def _split_invariant(gemm: Gemm) -> bool:
    """A product cut into column parts (``few_rows.SPLIT_WORK``) has the bits of one uncut
    call, on shapes that are cut and ones that are not (a decode row, a prefill slice, a
    column count that is not a multiple of the cut)."""
    rng = np.random.default_rng(1)
    for m, n, k in ((1, 1000, 640), (3, 4160, 576), (256, 2048, 640), (300, 200, 2048)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        weight = rng.standard_normal((n, k)).astype(np.float32)
        if not np.array_equal(gemm(x, weight), gemm_uncut(x, weight)):
            return False
    return True
