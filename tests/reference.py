"""Slow, explicit reference computations for the tests, written independently of the library:
float64, per-head loops, softmax by hand (exp / sum), masks as explicit allow-lists."""

from __future__ import annotations

import torch


def saved_bytes(forward, model=None) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``forward()`` runs, other than
    ``model``'s parameters and buffers (which exist anyway)."""
    storages = {}
    own = [] if model is None else [*model.parameters(), *model.buffers()]

    def pack(t):
        if not any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in own):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values())


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
    elif hasattr(attn, "qk"):  # spectral (math.md §2): v = x Q_oᵀ, Q_o from QR(Θ), no bias
        w, b = attn.qk.weight.double(), attn.qk.bias.double()
        q_all = x @ w[:D].T + b[:D]
        k_all = x @ w[D:].T + b[D:]
        v_all = x @ spectral_q(attn).T
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
        weights = kernel_weights if attn.attention.startswith("kernel") else softmax_weights
        a = weights(q, k, allow)
        if attnscale_omega is not None:
            uniform = allow / allow.sum(-1, keepdim=True)
            a = uniform + (1 + float(attnscale_omega[h])) * (a - uniform)
        u = a @ v
        if v0_heads is not None and attn.lam:
            u = u + attn.lam * (v0_heads[h] - v)
        outs.append(u)
    u = torch.cat(outs, dim=-1)
    if attn.attention.startswith("eigen"):  # spectral: z ↦ z Q_o diag(sign · ψ²)
        gains = attn.value_output.sign * attn.value_output.psi.double() ** 2
        return (u @ spectral_q(attn)) * gains, vs
    y = u @ attn.proj.weight.double().T + attn.proj.bias.double()
    return y, vs


def spectral_q(attn):
    """Q_o, the orthogonal factor of QR(Θ) (float64; the sign convention is torch's, as in math.md §2)."""
    return torch.linalg.qr(attn.value_output.theta.double()).Q


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


# --- Hugging Face models written out by hand, with NeuTRENO (math.md §2, Eq. 26) in every layer after
# the first: u + λ(V⁰ − V) before the output projection. For tests/test_hf.py.


def _heads(x, n):
    """(B, N, n·d) → (B, n, N, d)."""
    return x.view(*x.shape[:2], n, -1).transpose(1, 2)


def _merge(x):
    """(B, H, N, d) → (B, N, H·d)."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


def attend_loop(q, k, v, allow):
    """softmax(q·k/√d) over the allowed keys, one query at a time. q, k, v (B, H, N, d); allow (B, N, N)."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            scores = (k[b] @ q[b, :, i, :, None])[..., 0] / q.shape[-1] ** 0.5  # (H, N)
            scores = scores.masked_fill(~allow[b, i], float("-inf"))
            out[b, :, i] = (scores.softmax(-1)[..., None] * v[b]).sum(1)
    return out


def _neutreno(u, v, v0, lam):
    return u if v0 is None else u + lam * (v0 - v)


@torch.no_grad()
def bert_forward(model, input_ids, attention_mask, lam):
    """``BertModel(...).hidden_states`` by hand (post-LN layers, exact GELU): L + 1 tensors (B, N, D),
    the embeddings, then each layer's output. ``lam``: one λ, or a list of one per layer (a number, or
    (H, 1, 1) for a λ per head)."""
    F = torch.nn.functional
    emb, heads = model.embeddings, model.config.num_attention_heads
    B, N = input_ids.shape
    x = _bert_embeddings(emb, input_ids)
    allow = attention_mask.bool()[:, None, :].expand(B, N, N)
    v0, hidden = None, [x]
    for index, layer in enumerate(model.encoder.layer):
        sa, out = layer.attention.self, layer.attention.output
        q, k, v = (_heads(F.linear(x, m.weight, m.bias), heads) for m in (sa.query, sa.key, sa.value))
        u = _neutreno(attend_loop(q, k, v, allow), v, v0, lam[index] if isinstance(lam, list) else lam)
        v0 = v if v0 is None else v0
        x = x + F.linear(_merge(u), out.dense.weight, out.dense.bias)
        x = F.layer_norm(x, x.shape[-1:], out.LayerNorm.weight, out.LayerNorm.bias, out.LayerNorm.eps)
        h = F.gelu(F.linear(x, layer.intermediate.dense.weight, layer.intermediate.dense.bias))
        ln = layer.output.LayerNorm
        x = F.layer_norm(x + F.linear(h, layer.output.dense.weight, layer.output.dense.bias), x.shape[-1:],
                         ln.weight, ln.bias, ln.eps)  # fmt: skip
        hidden.append(x)
    return hidden


def _bert_embeddings(emb, input_ids):
    """BERT-style embeddings by hand: word + position + token type 0, then LayerNorm."""
    N = input_ids.shape[1]
    x = (
        emb.word_embeddings.weight[input_ids]
        + emb.position_embeddings.weight[:N]
        + emb.token_type_embeddings.weight[0]
    )
    ln = emb.LayerNorm
    return torch.nn.functional.layer_norm(x, x.shape[-1:], ln.weight, ln.bias, ln.eps)


@torch.no_grad()
def albert_forward(model, input_ids, lam):
    """``AlbertModel(...).last_hidden_state`` by hand: L calls of the groups' shared layers, group
    ⌊i·G/L⌋ for call i (post-LN, exact GELU). V⁰ is the values of the first call; every later call,
    of the same shared weights or not, is a NeuTRENO layer, at ``lam`` or, a list, at its group's λ."""
    F = torch.nn.functional
    emb, cfg = model.embeddings, model.config
    B, N = input_ids.shape
    x = _bert_embeddings(emb, input_ids)
    x = F.linear(
        x, model.encoder.embedding_hidden_mapping_in.weight, model.encoder.embedding_hidden_mapping_in.bias
    )
    allow = torch.ones(B, N, N, dtype=torch.bool)
    v0 = None
    for i in range(cfg.num_hidden_layers):
        g = i * cfg.num_hidden_groups // cfg.num_hidden_layers
        (layer,) = model.encoder.albert_layer_groups[g].albert_layers
        a = layer.attention
        q, k, v = (
            _heads(F.linear(x, m.weight, m.bias), cfg.num_attention_heads) for m in (a.query, a.key, a.value)
        )
        u = _neutreno(attend_loop(q, k, v, allow), v, v0, lam[g] if isinstance(lam, list) else lam)
        v0 = v if v0 is None else v0
        x = F.layer_norm(x + F.linear(_merge(u), a.dense.weight, a.dense.bias), x.shape[-1:],
                         a.LayerNorm.weight, a.LayerNorm.bias, a.LayerNorm.eps)  # fmt: skip
        h = F.linear(
            F.gelu(F.linear(x, layer.ffn.weight, layer.ffn.bias)),
            layer.ffn_output.weight,
            layer.ffn_output.bias,
        )
        ln = layer.full_layer_layer_norm
        x = F.layer_norm(x + h, x.shape[-1:], ln.weight, ln.bias, ln.eps)
    return x


@torch.no_grad()
def gpt2_logits(model, input_ids, lam):
    """``GPT2LMHeadModel(...).logits`` (B, N, V), by hand (pre-LN blocks, Conv1D = x @ W + b, tanh GELU)."""
    F = torch.nn.functional
    t, heads = model.transformer, model.config.n_head
    B, N = input_ids.shape
    x = t.wte.weight[input_ids] + t.wpe.weight[:N]
    allow = torch.ones(N, N, dtype=torch.bool).tril().expand(B, N, N)
    v0 = None
    for block in t.h:
        h = F.layer_norm(x, x.shape[-1:], block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
        qkv = h @ block.attn.c_attn.weight + block.attn.c_attn.bias
        q, k, v = (_heads(part, heads) for part in qkv.chunk(3, dim=-1))
        u = _neutreno(attend_loop(q, k, v, allow), v, v0, lam)
        v0 = v if v0 is None else v0
        x = x + _merge(u) @ block.attn.c_proj.weight + block.attn.c_proj.bias
        h = F.layer_norm(x, x.shape[-1:], block.ln_2.weight, block.ln_2.bias, block.ln_2.eps)
        h = F.gelu(h @ block.mlp.c_fc.weight + block.mlp.c_fc.bias, approximate="tanh")
        x = x + h @ block.mlp.c_proj.weight + block.mlp.c_proj.bias
    x = F.layer_norm(x, x.shape[-1:], t.ln_f.weight, t.ln_f.bias, t.ln_f.eps)
    return x @ model.lm_head.weight.T


@torch.no_grad()
def llama_logits(model, input_ids, lam):
    """``LlamaForCausalLM(...).logits`` (B, N, V), by hand: RMSNorm, rotary positions (pair i with
    i + d/2), grouped-query attention (query head h reads key/value head h // groups; V⁰ likewise),
    SwiGLU MLP."""
    F = torch.nn.functional
    c, m = model.config, model.model
    heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    B, N = input_ids.shape

    def rms(x, norm):
        return norm.weight * (x / (x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt())

    inv_freq = c.rope_parameters["rope_theta"] ** (-torch.arange(0, d, 2).double() / d)
    angle = (torch.arange(N).double()[:, None] * inv_freq).float()  # (N, d/2)
    cos, sin = angle.cos(), angle.sin()

    def rotate(t):
        a, b = t[..., : d // 2], t[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    reads = torch.arange(heads) // (heads // kv_heads)
    allow = torch.ones(N, N, dtype=torch.bool).tril().expand(B, N, N)
    x = m.embed_tokens.weight[input_ids]
    v0 = None
    for layer in m.layers:
        a, h = layer.self_attn, rms(x, layer.input_layernorm)
        q = rotate(_heads(h @ a.q_proj.weight.T, heads))
        k = rotate(_heads(h @ a.k_proj.weight.T, kv_heads))[:, reads]
        v = _heads(h @ a.v_proj.weight.T, kv_heads)[:, reads]
        u = _neutreno(attend_loop(q, k, v, allow), v, v0, lam)
        v0 = v if v0 is None else v0
        x = x + _merge(u) @ a.o_proj.weight.T
        h = rms(x, layer.post_attention_layernorm)
        mlp = layer.mlp
        x = x + (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return rms(x, m.norm) @ model.lm_head.weight.T


def pil_bicubic(image, size):
    """(C, h, w) → (C, H, W) resampled as PIL (and timm's ``resample_abs_pos_embed``, antialias=True) do:
    each output pixel a normalised sum of input pixels under a cubic kernel (a = −0.5) stretched by the
    downscale factor, taps clipped at the border; one axis at a time, written out with loops."""

    def cubic(x):
        a, x = -0.5, abs(x)
        if x < 1:
            return (a + 2) * x**3 - (a + 3) * x**2 + 1
        if x < 2:
            return a * x**3 - 5 * a * x**2 + 8 * a * x - 4 * a
        return 0.0

    def weights(n_in, n_out):
        scale = n_in / n_out
        stretch = max(scale, 1.0)
        matrix = torch.zeros(n_out, n_in, dtype=torch.float64)
        for i in range(n_out):
            center = (i + 0.5) * scale
            lo, hi = max(0, int(center - 2 * stretch + 0.5)), min(n_in, int(center + 2 * stretch + 0.5))
            for j in range(lo, hi):
                matrix[i, j] = cubic((j + 0.5 - center) / stretch)
            matrix[i] /= matrix[i].sum()
        return matrix

    rows, cols = weights(image.shape[1], size[0]), weights(image.shape[2], size[1])
    out = torch.einsum("Hh,chw,Ww->cHW", rows, image.double(), cols)
    return out.to(image.dtype)


def kv_cache(out):
    """A Hugging Face output's KV cache: ``cache`` from transformers 5.24, ``past_key_values`` before."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


def with_cache(model, cache) -> dict:
    """The keyword that passes a KV cache to ``model``'s forward: ``cache`` from transformers 5.24
    (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    import inspect

    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return {name: cache}


def neutreno_through_eager_attention(model, lam: float, **inputs):
    """A Hugging Face model's outputs with NeuTRENO written at its attention interface, not by
    neutreno.hf: each call runs the model's own eager attention (its modeling file's
    ``eager_attention_forward``), then adds λ(V⁰ − V) head by head, V⁰ being the values of the forward's
    first attention call, query head h reading value head h·H_kv // H. For one-stack decoders."""
    import copy
    import sys

    import transformers

    model = copy.deepcopy(model)
    first = []

    def attention(module, query, key, value, *args, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        out, weights = eager(module, query, key, value, *args, **kwargs)  # (B, N, H, d)
        v = value[:, :, value.shape[-2] - query.shape[-2] :]  # this call's positions
        if not first:
            first.append(v)
            return out, weights
        heads, kv_heads = query.shape[1], v.shape[1]
        out = out.clone()
        for h in range(heads):
            g = h * kv_heads // heads
            out[:, :, h] += lam * (first[0][:, g] - v[:, g])
        return out, weights

    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    transformers.AttentionInterface.register("neutreno_reference", attention)
    AttentionMaskInterface.register("neutreno_reference", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation("neutreno_reference")
    with torch.no_grad():
        return model(**inputs)
