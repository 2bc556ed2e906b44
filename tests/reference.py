"""Slow, explicit reference computations for the tests, written independently of the library:
float64, per-head loops, softmax by hand (exp / sum), masks as explicit allow-lists."""

from __future__ import annotations

import torch


def split_qkv(attn, x):
    """Per-head q, k, v lists (each (B, N, d), float64) using the module's weights by slicing."""
    x = x.double()
    D = x.shape[-1]
    H, d = attn.num_heads, D // attn.num_heads
    if hasattr(attn, "qkv"):
        w, b = attn.qkv.weight.double(), attn.qkv.bias.double()
        q_all = x @ w[:D].T + b[:D]
        k_all = x @ w[D : 2 * D].T + b[D : 2 * D]
        v_all = x @ w[2 * D :].T + b[2 * D :]
    else:  # symmetric: kv = [W_K; W_V], and the keys stand in for the queries
        w, b = attn.kv.weight.double(), attn.kv.bias.double()
        k_all = x @ w[:D].T + b[:D]
        v_all = x @ w[D:].T + b[D:]
        q_all = k_all
    heads = [slice(h * d, (h + 1) * d) for h in range(H)]
    return [q_all[..., s] for s in heads], [k_all[..., s] for s in heads], [v_all[..., s] for s in heads]


def allowed(n, key_padding_mask=None, causal=False, batch=1):
    """(B, N, N) float64 0/1 allow-list built with loops."""
    a = torch.ones(batch, n, n, dtype=torch.float64)
    for b in range(batch):
        for i in range(n):
            for j in range(n):
                if causal and j > i:
                    a[b, i, j] = 0
                if key_padding_mask is not None and not key_padding_mask[b, j]:
                    a[b, i, j] = 0
    return a


def softmax_weights(q, k, allow):
    """exp(q·k/√d) restricted to allowed keys, normalised by its row sum."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    scores = scores - scores.max(dim=-1, keepdim=True).values
    e = torch.exp(scores) * allow
    return e / e.sum(-1, keepdim=True)


def kernel_weights(q, k, allow):
    """κ(q,k) = φ(q)·φ(k), φ(t) = t + 1 for t > 0 else exp(t), normalised over allowed keys."""

    def phi(t):
        return torch.where(t > 0, t + 1, torch.exp(t))

    kappa = (phi(q) @ phi(k).transpose(-2, -1)) * allow
    return kappa / kappa.sum(-1, keepdim=True)


def reference_attention(attn, x, v0_heads=None, key_padding_mask=None, causal=False, attnscale_omega=None):
    """Output (B, N, D) of ``attn`` computed the slow way, plus the per-head values.

    NeuTRENO: U_h = A_h V_h + λ (V⁰_h − V_h); AttnScale: A' = Unif + (1 + ω_h)(A − Unif) with
    Unif uniform over the allowed keys; FeatScale left to the caller.
    """
    qs, ks, vs = split_qkv(attn, x)
    B, N, _ = x.shape
    allow = allowed(N, key_padding_mask, causal, B)
    outs = []
    for h, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        a = kernel_weights(q, k, allow) if attn.scores == "kernel" else softmax_weights(q, k, allow)
        if attnscale_omega is not None:
            uniform = allow / allow.sum(-1, keepdim=True)
            a = uniform + (1 + float(attnscale_omega[h])) * (a - uniform)
        u = a @ v
        if v0_heads is not None and attn.lam:
            u = u + attn.lam * (v0_heads[h] - v)
        outs.append(u)
    u = torch.cat(outs, dim=-1)
    y = u @ attn.proj.weight.double().T + attn.proj.bias.double()
    return y, vs


def heads_to_tensor(vs):
    """List of H tensors (B, N, d) → (B, H, N, d)."""
    return torch.stack(vs, dim=1)


def cosine_loop(x, mask=None):
    """Off-diagonal mean of pairwise cosines, one pair at a time (float64)."""
    values = []
    for b in range(x.shape[0]):
        idx = [i for i in range(x.shape[1]) if mask is None or mask[b, i]]
        total, pairs = 0.0, 0
        for i in idx:
            for j in idx:
                if i != j:
                    a, c = x[b, i].double(), x[b, j].double()
                    denom = a.norm() * c.norm()
                    total += float(a @ c / denom) if denom > 0 else 0.0
                    pairs += 1
        values.append(total / pairs)
    return torch.tensor(values, dtype=torch.float64)
