"""The model ``benchmarks.kernels`` times on a GPU: a dense decoder's shape (one GPU's share of
it under tensor parallelism), random BF16 weights, and one forward of a step that mixes a
prefill chunk with a decode batch, as chunked prefill schedules them. Attention is PyTorch's
``scaled_dot_product_attention`` over contiguous KV; projections and MLP are cuBLAS GEMMs with
unfused elementwise ops between. PyTorch is imported when used (``load_torch``): this module
loads where it is not installed."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Shape:
    """One GPU's share of a dense decoder (a tensor-parallel shard when ``tp`` > 1)."""

    name: str
    profile: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tp: int = 1


LLAMA3_8B = Shape("llama-3-8b", "llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA3_70B_TP4 = Shape("llama-3-70b, one TP4 shard", "llama-3-70b", 80, 8192, 16, 2, 128,
                       7168, 128256 // 4, tp=4)


def load_torch() -> Any:
    return importlib.import_module("torch")


class Model:
    """Random BF16 weights of ``shape`` on the GPU and one forward of a mixed step."""

    def __init__(self, shape: Shape, dev: str = "cuda") -> None:
        torch = load_torch()
        self.t = torch
        self.F = importlib.import_module("torch.nn.functional")
        self.shape = shape
        self.dev = dev
        s = shape
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim

        def w(*dims: int) -> Any:
            return torch.empty(*dims, device=dev, dtype=torch.bfloat16).normal_(0, 0.02)

        self.layers = [
            {"n1": torch.ones(s.hidden, device=dev, dtype=torch.bfloat16),
             "n2": torch.ones(s.hidden, device=dev, dtype=torch.bfloat16),
             "wqkv": w(s.hidden, qkv), "wo": w(s.heads * s.head_dim, s.hidden),
             "wgu": w(s.hidden, 2 * s.ffn), "wd": w(s.ffn, s.hidden)}
            for _ in range(s.layers)
        ]
        self.norm = torch.ones(s.hidden, device=dev, dtype=torch.bfloat16)
        self.lm_head = w(s.hidden, s.vocab)
        self.embed = w(s.vocab, s.hidden)
        self.gqa_path = "enable_gqa"

    def _attend(self, q: Any, k: Any, v: Any, causal_from: int | None) -> Any:
        """SDPA of q [b, H, n, d] over k, v [b, K, m, d]; ``causal_from`` = cached tokens
        before the n new ones (None: no mask, a decode query sees every key)."""
        F = self.F
        s = self.shape
        mask: Any = None
        causal = False
        if causal_from == 0:
            causal = True
        elif causal_from is not None:
            bias = importlib.import_module("torch.nn.attention.bias")
            mask = bias.causal_lower_right(q.shape[2], k.shape[2])
        if mask is None and self.gqa_path == "enable_gqa":
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            except (RuntimeError, TypeError):
                self.gqa_path = "repeat"
        rep = s.heads // s.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def step(self, ids: Any, pre: tuple[int, int] | None, dec: tuple[int, int] | None,
             caches: dict[str, list[Any]], sample_prefill: bool) -> Any:
        """One forward: ``pre`` = (n new tokens, c cached) of one prompt, ``dec`` = (batch,
        context) decoding one token each; token rows are the prefill's first, then decode's."""
        t = self.t
        F = self.F
        s = self.shape
        d = s.head_dim
        n, c = pre or (0, 0)
        b, ctx = dec or (0, 0)
        x = self.embed[ids]
        cos = caches["cos"][0]
        sin = caches["sin"][0]
        for i, L in enumerate(self.layers):
            h = F.rms_norm(x, (s.hidden,), L["n1"])
            qkv = h @ L["wqkv"]
            q = qkv[:, : s.heads * d]
            k = qkv[:, s.heads * d: (s.heads + s.kv_heads) * d]
            v = qkv[:, (s.heads + s.kv_heads) * d:]
            q = q * cos[:, : s.heads * d] + q.roll(d // 2, -1) * sin[:, : s.heads * d]
            k = k * cos[:, : s.kv_heads * d] + k.roll(d // 2, -1) * sin[:, : s.kv_heads * d]
            outs = []
            if n:
                kc, vc = caches["pk"][i], caches["pv"][i]
                kc[0, :, c: c + n] = k[:n].view(n, s.kv_heads, d).transpose(0, 1)
                vc[0, :, c: c + n] = v[:n].view(n, s.kv_heads, d).transpose(0, 1)
                qp = q[:n].view(1, n, s.heads, d).transpose(1, 2)
                o = self._attend(qp, kc[:, :, : c + n], vc[:, :, : c + n], c)
                outs.append(o.transpose(1, 2).reshape(n, s.heads * d))
            if b:
                kc, vc = caches["dk"][i], caches["dv"][i]
                kc[:, :, ctx] = k[n:].view(b, s.kv_heads, d)
                vc[:, :, ctx] = v[n:].view(b, s.kv_heads, d)
                qd = q[n:].view(b, 1, s.heads, d).transpose(1, 2)
                o = self._attend(qd, kc, vc, None)
                outs.append(o.transpose(1, 2).reshape(b, s.heads * d))
            a = outs[0] if len(outs) == 1 else t.cat(outs)
            x = x + a @ L["wo"]
            h = F.rms_norm(x, (s.hidden,), L["n2"])
            gu = h @ L["wgu"]
            x = x + (F.silu(gu[:, : s.ffn]) * gu[:, s.ffn:]) @ L["wd"]
        rows = []
        if n and sample_prefill:
            rows.append(x[n - 1: n])
        if b:
            rows.append(x[n:])
        if not rows:
            return x[:1]
        last = rows[0] if len(rows) == 1 else t.cat(rows)
        return F.rms_norm(last, (s.hidden,), self.norm) @ self.lm_head


def caches(m: Model, pre: tuple[int, int] | None, dec: tuple[int, int] | None) -> dict[str, Any]:
    t = m.t
    s = m.shape
    bf = t.bfloat16
    n, c = pre or (0, 0)
    b, ctx = dec or (0, 0)
    tokens = n + b
    out: dict[str, Any] = {"pk": [], "pv": [], "dk": [], "dv": []}
    for _ in range(s.layers):
        if n:
            out["pk"].append(t.randn(1, s.kv_heads, c + n, s.head_dim, device=m.dev, dtype=bf))
            out["pv"].append(t.randn(1, s.kv_heads, c + n, s.head_dim, device=m.dev, dtype=bf))
        if b:
            out["dk"].append(t.randn(b, s.kv_heads, ctx + 1, s.head_dim, device=m.dev, dtype=bf))
            out["dv"].append(t.randn(b, s.kv_heads, ctx + 1, s.head_dim, device=m.dev, dtype=bf))
    width = s.heads * s.head_dim
    out["cos"] = [t.rand(tokens, width, device=m.dev, dtype=bf)]
    out["sin"] = [t.rand(tokens, width, device=m.dev, dtype=bf)]
    return out
