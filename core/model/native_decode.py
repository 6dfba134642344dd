"""A decode step's layers outside MLX's graph: numpy rows and the skinny products.

Why: a decode step multiplies a few rows by every weight, and between those products sit
norms, RoPE, residuals, activations and attention over a few hundred floats per agent.
Through MLX's CPU backend each of them is an operation to schedule, and each layer
projection run outside its graph (``kvshelf.model.skinny``, twice MLX's speed) makes MLX
evaluate the step up to it. On the embedded Gemma 3 at 1K context and batch 1 the
default kernels' body took 92 ms of a 120 ms step whose layers' weights take 19.6 ms to
read (``benchmarks/decode_profile.py``, ``results/decode-profile-20261203-164817.json``).
Here every layer runs on numpy rows (``kvshelf.model.native_ops``) and the blocked skinny
product. Over a decode working set (``kvshelf.kv.working_set.DecodeLayer``) attention reads
the buffer's stored columns and the step's own rows as the cache will code them (numpy,
MLX's bits: ``kvshelf.kv.row_coding``), and the working set's MLX update of every layer
(writing those codes and rows, no coding left to MLX) waits until the last layer is done:
one MLX evaluation a step instead of one a layer (``defer_updates``).
Other caches keep one update and evaluation per layer. The head is the caller's
(``kvshelf.model.head.ProjectedModel``).

Which models: mlx-lm's Gemma 3 text model, its llama family (Llama, SmolLM2, ...) and
DeepSeek-V2 with dense layers (latent attention), fp32 on the CPU, plain bias-free
projections, ``nn.RoPE``, ``Llama3RoPE`` or DeepSeek-V2's YaRN; anything else is None here
and keeps the module path. Which calls: decode steps of 1..``MAX_LAYER_ROWS`` agents over
caches that hand over dense K/V (``dense_decode``: the KV schemes' working
sets, plain Q4's too on the CPU; on a GPU its packed rows go to ``quantized_matmul`` in
the module path).

Exactness: the default kernels' step (``FAST`` operations) is the same function as the
model to fp32 rounding, not bit for bit (numpy's sums and MLX's differ in order); checked
when built, against the model's own call on a probe, and in ``tests/test_native_decode.py``.
Temperature 0's step (``exact``: ``EXACT`` operations from ``kvshelf.model.exact_ops``, the
row-invariant products, ordered attention) has the bits of the shape-invariant kernels'
module path, whose K/V must have the bits a prefill gives them; its probe allows no
difference at all (``tests/test_exact_decode.py``). Given the same state, a step gives the
same bits every time, so an agent restored from disk continues bit-identically to one
kept in RAM. ``KVSHELF_NO_NATIVE_DECODE=1`` keeps the module path for both,
``KVSHELF_NO_EXACT_DECODE=1`` for temperature 0's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvshelf.model import exact_ops, half_weights, native_ops
from kvshelf.model.arrays import buffer_view
from kvshelf.model.attention import ordered_step
from kvshelf.model.coded_attention import attend_coded
from kvshelf.model.few_rows import Gemm
from kvshelf.model.native_ops import F32, Rope, attend, mask_bias
from kvshelf.model.ordered_attention import ordered_attention_available
from kvshelf.model.skinny import MAX_LAYER_ROWS, takes_codes
from kvshelf.switches import env_on

OFF = env_on("KVSHELF_NO_NATIVE_DECODE")
# Set: temperature 0's steps keep the module path (MLX's graph around the row-invariant products).
OFF_EXACT = env_on("KVSHELF_NO_EXACT_DECODE")

# How far the native step's hidden state may lie from the model's own on the build probe,
# relative to its largest element: fp32 rounding through every layer, far below any
# difference a wrong formula makes (a wrong RoPE, norm or mask is off by 10% or more).
PROBE_TOLERANCE = 1e-4


def _plain_weight(layer: Any, halves: bool) -> np.ndarray | None:
    """A bias-free fp32 ``nn.Linear``'s weight as a numpy view, else None; with ``halves``
    its fp16 or bf16 codes where they hold it (``kvshelf.model.half_weights``)."""
    if type(layer) is not nn.Linear or "bias" in layer or layer["weight"].dtype != mx.float32:
        return None
    w = buffer_view(layer["weight"])
    if not w.flags.c_contiguous:
        return None
    half = half_weights.half_of(layer["weight"]) if halves else None
    return w if half is None else half


def _plain_weights(layers: Sequence[Any], halves: bool) -> list[np.ndarray] | None:
    """Every layer's ``_plain_weight``, or None where any is not one."""
    weights = [_plain_weight(m, halves) for m in layers]
    return None if any(w is None for w in weights) else [w for w in weights if w is not None]


@dataclass(frozen=True)
class RowOps:
    """The small operations a step runs on numpy rows: fp32-exact and fast
    (``kvshelf.model.native_ops``, the default kernels') or with MLX's own bits
    (``kvshelf.model.exact_ops``, temperature 0's)."""

    rms_norm: Callable[[np.ndarray, np.ndarray, float], np.ndarray]
    gelu_gate: Callable[[np.ndarray, np.ndarray], np.ndarray]  # act(gate) * up
    silu_gate: Callable[[np.ndarray, np.ndarray], np.ndarray]
    tables: Callable[[Rope, np.ndarray], tuple[np.ndarray, np.ndarray]]


FAST = RowOps(native_ops.rms_norm, native_ops.gelu_gate, native_ops.silu_gate, Rope.tables)
EXACT = RowOps(exact_ops.rms_norm, exact_ops.gelu_gate, exact_ops.silu_gate, exact_ops.tables)


@dataclass
class NativeLayer:
    """One transformer layer's weights (numpy views over MLX's buffers, or their 16-bit codes:
    ``kvshelf.model.half_weights``) and settings."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    norms: dict[str, np.ndarray]  # the norm weights as the norm multiplies (Gemma's 1 + w)
    rope: Rope
    heads: int
    kv_heads: int
    scale: float
    sliding: bool


def _norm_weight(norm: Any, offset: float) -> np.ndarray:
    return buffer_view(norm["weight"]).astype(F32) + F32(offset)


def _layer(block: Any, norms: dict[str, Any], offset: float, sliding: bool, halves: bool) -> NativeLayer | None:
    attn, mlp = block.self_attn, block.mlp
    parts = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    weights, rope = _plain_weights(parts, halves), Rope.of(attn.rope)
    if rope is None or weights is None:
        return None
    q, k, v, o, gate, up, down = weights
    return NativeLayer(
        q, k, v, o, gate, up, down,
        norms={name: _norm_weight(n, offset) for name, n in norms.items()},
        rope=rope, heads=attn.n_heads, kv_heads=attn.n_kv_heads, scale=float(attn.scale), sliding=sliding,
    )  # fmt: skip


class NativeDecoder:
    """A model's body (embedding, layers, final norm) for decode steps, on numpy rows.

    Called like the body on (B, 1) tokens and the caches; returns the (B, 1, hidden)
    hidden states as an MLX array. ``takes`` says whether a call is one it runs."""

    kind = "base"
    norm_offset = 0.0  # what the norms add to their stored weights (Gemma's 1 + w)
    # Whether a decode working set's update waits until every layer is done (``_attention``);
    # False updates it inside each layer as before (``benchmarks/decode.py --paths no-defer``).
    defer_updates = not env_on("KVSHELF_NO_DEFERRED_UPDATE")

    def __init__(
        self, body: Any, layers: list[NativeLayer], product: Gemm, eps: float, embed_scale: float | None, exact: bool
    ):
        self.layers = layers
        self._product = product
        # Temperature 0's step: MLX's bits in every operation (``EXACT``), the row-invariant
        # product, and ``InvariantAttention``'s attention (``ordered_step``), so that a token
        # gets the bits the module path (and a prefill) gives it. Else the default kernels'.
        self.exact = exact
        self._ops = EXACT if exact else FAST
        self._eps = eps
        self._embed_scale = embed_scale
        self._embed = buffer_view(body.embed_tokens["weight"])
        self._final = _norm_weight(body.norm, self.norm_offset)
        self._deferred: list[tuple[Any, np.ndarray, np.ndarray, Any]] = []
        # one step's RoPE tables, by rotation and positions
        self._tables: dict[tuple[tuple[float, bytes], int | bytes], tuple[np.ndarray, np.ndarray]] = {}
        self.window: int | None = None

    def takes(self, inputs: mx.array, cache: Any) -> bool:
        """A decode step (one token per agent, at most ``MAX_LAYER_ROWS`` agents) over caches
        that hand over dense K/V."""
        return (
            isinstance(cache, Sequence)
            and len(cache) == len(self.layers)
            and inputs.ndim == 2
            and inputs.shape[1] == 1
            and 1 <= inputs.shape[0] <= MAX_LAYER_ROWS
            and all(getattr(c, "dense_decode", False) for c in cache)
            and (not self.exact or all(hasattr(c, "columns_with") for c in cache))
        )

    def _masks(self, inputs: mx.array, cache: Sequence[Any]) -> tuple[Any, Any]:
        """The full-attention and sliding-window masks, from the caches the model takes them from."""
        raise NotImplementedError

    def _block(self, layer: NativeLayer, h: np.ndarray, mask: Any, cache: Any) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, inputs: mx.array, cache: Sequence[Any]) -> mx.array:
        tokens = np.asarray(inputs).reshape(-1)
        h = self._embed[tokens].astype(F32)
        if self._embed_scale is not None:
            h *= F32(self._embed_scale)
        full, sliding = self._masks(inputs, cache)
        if not self.exact:  # the default kernels' attention takes the masks as scores to add
            full, sliding = mask_bias(full), mask_bias(sliding)
        self._deferred, self._tables = [], {}
        for layer, c in zip(self.layers, cache):
            h = self._block(layer, h, sliding if layer.sliding else full, c)
        h = self._ops.rms_norm(h, self._final, self._eps)
        self._append_deferred()
        return mx.array(h[:, None, :])

    def _append_deferred(self) -> None:
        """The caches' own updates of the layers whose attention read the step's new rows
        from numpy (``_attention``), with the codes numpy made, once every layer is done:
        each agent's layer stages its token (written to its blocks later, many at once) and
        the working set's buffers take the rows, evaluated at once. Not in the background
        while the caller projects the head: MLX's thread then took a core from the head's
        two-thread product (Gemma 3, batch 4: slower than an update per layer)."""
        deferred, self._deferred = self._deferred, []
        for c, k, v, coded in deferred:
            c.advance(k, v, coded)
        if deferred:
            mx.eval([x for c, *_ in deferred for x in c.arrays()])

    def _attention(self, layer: NativeLayer, x: np.ndarray, mask: Any, cache: Any) -> np.ndarray:
        """Projections, RoPE at each agent's own position, attention and the output
        projection; attention reads a working set's stored columns and the new rows from
        numpy (their MLX update deferred), or whatever the cache's own update and fetch
        (MLX) hands over."""
        b = x.shape[0]
        d = layer.q.shape[0] // layer.heads
        q = self._product(x, layer.q).reshape(b, layer.heads, d)
        k = self._product(x, layer.k).reshape(b, layer.kv_heads, d)
        v = self._product(x, layer.v).reshape(b, layer.kv_heads, -1)
        if "q" in layer.norms:
            norm = self._ops.rms_norm
            q, k = norm(q, layer.norms["q"], self._eps), norm(k, layer.norms["k"], self._eps)
        cos, sin = self._rope_tables(layer.rope, cache, b)
        q, k = layer.rope(q, cos, sin), layer.rope(k, cos, sin)
        return self._attend(layer, q, k, v, mask, cache)

    def _rope_tables(self, rope: Rope, cache: Any, b: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin at each of the ``b`` agents' positions: every layer of a step rotates at
        the same positions, so each rotation's tables are made once a step."""
        offset = cache.offset
        key = (rope.angles_key, offset if isinstance(offset, int) else np.asarray(offset).tobytes())
        if key not in self._tables:
            positions = np.asarray(offset).reshape(-1)
            self._tables[key] = self._ops.tables(rope, np.repeat(positions, b // positions.size))
        return self._tables[key]

    def _attend(
        self, layer: NativeLayer, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Any, cache: Any
    ) -> np.ndarray:
        """The step's rotated queries (batch, heads, d) against the cache's keys and the new
        ``k``/``v`` (batch, kv_heads, d or value dim), then the output projection."""
        b = q.shape[0]
        if self.exact:
            out = ordered_step(q[:, :, None, :], k, v, layer.scale, mask, cache)
            return self._product(out.reshape(b, -1), layer.o)
        # A decode working set can take the step's rows after every layer is done: attention
        # reads its stored columns and the new rows as the cache will code them (numpy, MLX's
        # bits), so MLX is not evaluated in the middle of the step.
        coded = cache.read_back(k, v) if self.defer_updates and hasattr(cache, "advance") else None
        if coded is not None and hasattr(cache, "coded_columns"):  # a layer kept in codes (coded_working_set)
            codes, lo, end = cache.coded_columns(coded)
            out = attend_coded(q, codes, mask, layer.scale, (lo, end))
            self._deferred.append((cache, k, v, coded))
            return self._product(out, layer.o)
        if coded is not None:
            key_buf, value_buf, lo, end = cache.previous_columns(mx.float32)
            keys_np, values_np = buffer_view(key_buf[0]), buffer_view(value_buf[0])
            out = attend(q, keys_np, values_np, mask, layer.scale, None, coded.keys, coded.values, (lo, end))
            self._deferred.append((cache, k, v, coded))
            return self._product(out, layer.o)
        keys, values = cache.update_and_fetch(mx.array(k[:, :, None, :]), mx.array(v[:, :, None, :]))
        if isinstance(keys, tuple) or isinstance(values, tuple):
            raise TypeError("the native decode step takes dense K/V; this cache handed over packed rows")
        mx.eval(keys, values)
        out = attend(q, buffer_view(keys), buffer_view(values), mask, layer.scale)
        return self._product(out, layer.o)


class Gemma3Decoder(NativeDecoder):
    """mlx-lm's ``gemma3_text``: four norms a layer (weights stored as ``w - 1``), q/k norms,
    GELU (tanh), local and global layers, the embedding scaled by sqrt(hidden) in bf16."""

    kind = "gemma3_text"
    norm_offset = 1.0

    def __init__(
        self, body: Any, layers: list[NativeLayer], product: Gemm, eps: float, exact: bool, window: int, pattern: int
    ):
        # mlx-lm scales the embedding by sqrt(hidden) rounded to bf16
        scale = np.array(mx.array(body.args.hidden_size**0.5, mx.bfloat16).astype(mx.float32)).item()
        super().__init__(body, layers, product, eps, scale, exact)
        self.window, self._pattern = window, pattern

    def _masks(self, inputs: mx.array, cache: Sequence[Any]) -> tuple[Any, Any]:
        full = create_attention_mask(inputs, cache[self._pattern - 1])
        sliding = create_attention_mask(inputs, cache[0], window_size=self.window) if self._pattern > 1 else None
        return full, sliding

    def _block(self, layer: NativeLayer, h: np.ndarray, mask: Any, cache: Any) -> np.ndarray:
        n, eps, norm = layer.norms, self._eps, self._ops.rms_norm
        r = self._attention(layer, norm(h, n["input"], eps), mask, cache)
        h = h + norm(r, n["post_attention"], eps)
        x = norm(h, n["pre_feedforward"], eps)
        r = self._product(self._ops.gelu_gate(self._product(x, layer.gate), self._product(x, layer.up)), layer.down)
        return h + norm(r, n["post_feedforward"], eps)


class LlamaDecoder(NativeDecoder):
    """mlx-lm's ``llama``: two norms a layer, SwiGLU, optional sliding-window layers."""

    kind = "llama"

    def __init__(
        self,
        body: Any,
        layers: list[NativeLayer],
        product: Gemm,
        eps: float,
        exact: bool,
        window: int | None = None,
        full: int = 0,
        sliding: int | None = None,
    ):
        """``full`` and ``sliding``: a full-attention layer's index and a sliding one's (None:
        none), whose caches give the masks; ``window``: the sliding layers' window."""
        super().__init__(body, layers, product, eps, None, exact)
        self.window = window
        self._full, self._swa = full, sliding

    def _masks(self, inputs: mx.array, cache: Sequence[Any]) -> tuple[Any, Any]:
        full = create_attention_mask(inputs, cache[self._full])
        if self._swa is None:
            return full, None
        return full, create_attention_mask(inputs, cache[self._swa], window_size=self.window)

    def _block(self, layer: NativeLayer, h: np.ndarray, mask: Any, cache: Any) -> np.ndarray:
        n, eps, norm = layer.norms, self._eps, self._ops.rms_norm
        h = h + self._attention(layer, norm(h, n["input"], eps), mask, cache)
        x = norm(h, n["post_attention"], eps)
        gated = self._ops.silu_gate(self._product(x, layer.gate), self._product(x, layer.up))
        return h + self._product(gated, layer.down)


@dataclass
class LatentLayer(NativeLayer):
    """A DeepSeek-V2 layer (multi-head latent attention): ``k`` is the latent's down-projection
    (``kv_a_proj_with_mqa``: the ``latent`` floats, then the key's RoPE part that every head
    shares), ``v`` its up-projection (``kv_b_proj``: each head's key without RoPE, ``nope``
    floats, and its value); ``q_a``, where the model has a query latent, goes before ``q``."""

    q_a: np.ndarray | None = None
    latent: int = 0
    nope: int = 0
    latent_eps: float = 1e-6


class DeepseekV2Decoder(LlamaDecoder):
    """mlx-lm's ``deepseek_v2`` with dense MLPs: the llama's layer (two norms, SwiGLU) around
    latent attention. The cache gets plain per-head keys (the RoPE part repeated for every
    head) and values, as from the module, so attention is the same as every other model's,
    for the default kernels and for temperature 0's (``InvariantLatentAttention``'s bits)."""

    kind = "deepseek_v2"

    def _attention(self, layer: NativeLayer, x: np.ndarray, mask: Any, cache: Any) -> np.ndarray:
        assert isinstance(layer, LatentLayer)
        b, heads, nope, rope = x.shape[0], layer.heads, layer.nope, layer.rope.dims
        norm = self._ops.rms_norm
        xq = x if layer.q_a is None else norm(self._product(x, layer.q_a), layer.norms["q_a"], layer.latent_eps)
        q = self._product(xq, layer.q).reshape(b, heads, nope + rope)
        down = self._product(x, layer.k)
        latent = norm(np.ascontiguousarray(down[:, : layer.latent]), layer.norms["kv_a"], layer.latent_eps)
        up = self._product(latent, layer.v).reshape(b, heads, -1)
        cos, sin = self._rope_tables(layer.rope, cache, b)
        keys = np.empty((b, heads, nope + rope), dtype=F32)
        keys[:, :, :nope] = up[:, :, :nope]
        keys[:, :, nope:] = layer.rope(down[:, None, layer.latent :], cos, sin)
        queries = np.empty_like(keys)
        queries[:, :, :nope] = q[:, :, :nope]
        queries[:, :, nope:] = layer.rope(q[:, :, nope:], cos, sin)
        return self._attend(layer, queries, keys, np.ascontiguousarray(up[:, :, nope:]), mask, cache)


def _gemma3(model: nn.Module, product: Gemm, exact: bool) -> NativeDecoder | None:
    body, args, halves = model.model, model.args, takes_codes(product)
    layers = []
    for i, block in enumerate(body.layers):
        attn = block.self_attn
        norms = {
            "input": block.input_layernorm, "post_attention": block.post_attention_layernorm,
            "pre_feedforward": block.pre_feedforward_layernorm, "post_feedforward": block.post_feedforward_layernorm,
            "q": attn.q_norm, "k": attn.k_norm,
        }  # fmt: skip
        sliding = i % args.sliding_window_pattern != args.sliding_window_pattern - 1
        layer = _layer(block, norms, 1.0, sliding, halves)
        if layer is None:
            return None
        layers.append(layer)
    window, pattern = args.sliding_window, args.sliding_window_pattern
    return Gemma3Decoder(body, layers, product, args.rms_norm_eps, exact, window, pattern)


def _llama(model: nn.Module, product: Gemm, exact: bool) -> NativeDecoder | None:
    body, args, halves = model.model, model.args, takes_codes(product)
    layers = []
    for block in body.layers:
        if not isinstance(block.input_layernorm, nn.RMSNorm):
            return None
        norms = {"input": block.input_layernorm, "post_attention": block.post_attention_layernorm}
        layer = _layer(block, norms, 0.0, bool(block.use_sliding), halves)
        if layer is None:
            return None
        layers.append(layer)
    return LlamaDecoder(body, layers, product, args.rms_norm_eps, exact, body.sliding_window, body.fa_idx, body.swa_idx)


def _deepseek_v2(model: nn.Module, product: Gemm, exact: bool) -> NativeDecoder | None:
    """Dense layers only (a routed-experts layer has no ``gate_proj``: the module path) and no
    attention biases."""
    body, halves = model.model, takes_codes(product)
    layers: list[NativeLayer] = []
    for block in body.layers:
        attn, mlp = block.self_attn, block.mlp
        with_latent = attn.q_lora_rank is not None
        parts = [attn.q_b_proj if with_latent else attn.q_proj, attn.kv_a_proj_with_mqa, attn.kv_b_proj, attn.o_proj]
        parts += [mlp.gate_proj, mlp.up_proj, mlp.down_proj, *([attn.q_a_proj] if with_latent else [])]
        weights, rope = _plain_weights(parts, halves), Rope.of(attn.rope)
        if rope is None or weights is None:
            return None
        q, k, v, o, gate, up, down, *query_latent = weights
        q_a = query_latent[0] if query_latent else None
        norms = {"input": block.input_layernorm, "post_attention": block.post_attention_layernorm}
        norms |= {"kv_a": attn.kv_a_layernorm} | ({"q_a": attn.q_a_layernorm} if with_latent else {})
        layers.append(
            LatentLayer(
                q, k, v, o, gate, up, down,
                norms={name: _norm_weight(n, 0.0) for name, n in norms.items()},
                rope=rope, heads=attn.num_heads, kv_heads=attn.num_heads, scale=float(attn.scale), sliding=False,
                q_a=q_a, latent=attn.kv_lora_rank, nope=attn.qk_nope_head_dim, latent_eps=attn.kv_a_layernorm.eps,
            )
        )  # fmt: skip
    return DeepseekV2Decoder(body, layers, product, model.args.rms_norm_eps, exact)  # every layer full


_ARCHITECTURES = {
    "mlx_lm.models.gemma3_text": _gemma3,
    "mlx_lm.models.llama": _llama,
    "mlx_lm.models.deepseek_v2": _deepseek_v2,
}


def native_decoder(
    model: nn.Module, product: Gemm | None, reference: Any = None, exact: bool = False
) -> NativeDecoder | None:
    """The native decode step for ``model`` if its architecture is one this runs and a probe
    agrees with ``reference`` (the body the step replaces; default the model's own), else None.

    ``product``: the layers' few-row product (``kvshelf.model.skinny.blocked_product``).
    ``exact``: temperature 0's step, with ``reference``'s bits (the body of the row-invariant
    kernels, its product ``invariant_blocked_product``); built only where every operation
    has MLX's bits here (``exact_ops.agree``) and the probe finds no difference at all."""
    build = _ARCHITECTURES.get(type(model).__module__)
    if OFF or product is None or build is None or mx.default_device() != mx.cpu:
        return None
    if exact and (OFF_EXACT or not exact_ops.agree() or not ordered_attention_available()):
        return None
    try:
        decoder = build(model, product, exact)
    except (AttributeError, KeyError, TypeError, ValueError):  # a variant without the parts read here
        return None
    if decoder is None:
        return None
    tolerance = 0.0 if exact else PROBE_TOLERANCE
    return decoder if _agrees(model, decoder, reference if reference is not None else model.model, tolerance) else None


def probe_gap(model: nn.Module, decoder: NativeDecoder, reference: Any, steps: int = 3) -> float:
    """The largest difference between the native step's hidden states and ``reference``'s,
    relative to the largest hidden element, over a few decode steps of a two-agent batch
    on mlx-lm's own caches after a short prompt. Temperature 0's step (``exact``) on plain
    ``KVCache``s only, the one mlx-lm cache whose layout its attention knows (a sliding
    layer's rotating cache would run the module's own attention in ``reference``), as the
    step only ever takes kvshelf's working sets."""
    vocab = model.model.embed_tokens["weight"].shape[0]
    prompt = mx.array([[(7 * i + 3) % vocab for i in range(9)], [(11 * i + 5) % vocab for i in range(9)]])
    caches = (lambda: [KVCache() for _ in decoder.layers]) if decoder.exact else (lambda: make_prompt_cache(model))
    mine, theirs = caches(), caches()
    mx.eval(reference(prompt, cache=mine), reference(prompt, cache=theirs))
    gap = 0.0
    for s in range(steps):
        token = mx.array([[(13 * s + 1) % vocab], [(17 * s + 2) % vocab]])
        got, own = np.asarray(decoder(token, mine)), np.asarray(reference(token, cache=theirs))
        gap = max(gap, float(np.max(np.abs(got - own)) / max(float(np.max(np.abs(own))), 1e-30)))
    return gap


def _agrees(model: nn.Module, decoder: NativeDecoder, reference: Any, tolerance: float) -> bool:
    try:
        return probe_gap(model, decoder, reference) <= tolerance
    except (ValueError, TypeError):  # a mask or cache shape this does not read
        return False
