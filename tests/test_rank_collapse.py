"""Q/K/V gradient norms and ``neutreno study rank-collapse`` (Noci et al., math.md §3)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from neutreno.cli.main import main
from neutreno.diagnostics import qkv_gradient_norms
from neutreno.models.language_model import TransformerLM
from neutreno.studies import rank_collapse as rc


def explicit_lm_loss(model, idx, targets, w_q, w_k, w_v, norm, alpha, lam):
    """The LM's mean next-token loss written out, with each layer's W_Q, W_K, W_V as separate tensors:
    per-head attention as an explicit masked softmax, NeuTRENO's λ(V⁰ − V) added before W_O."""
    B, T = idx.shape
    D = model.embed_dim
    heads = model.blocks[0].attn.num_heads
    d = D // heads
    half = torch.arange(D // 2, dtype=torch.float64)
    angle = torch.arange(T, dtype=torch.float64)[:, None] / 10000 ** (2 * half / D)
    x = model.embed.weight[idx] * D**0.5 + torch.cat([angle.sin(), angle.cos()], dim=1)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    v0 = None
    for layer, block in enumerate(model.blocks):
        b_q, b_k, b_v = block.attn.qkv.bias.chunk(3)

        def layer_norm(t, ln):
            centred = t - t.mean(-1, keepdim=True)
            return centred / (centred.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt() * ln.weight + ln.bias

        def mlp(t, block=block):
            return (
                F.relu(t @ block.mlp.fc1.weight.T + block.mlp.fc1.bias) @ block.mlp.fc2.weight.T
                + block.mlp.fc2.bias
            )

        h = layer_norm(x, block.norm1) if norm == "pre" else x
        q, k, v = ((h @ w[layer].T + b).view(B, T, heads, d) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v)))
        scores = torch.einsum("bihc,bjhc->bhij", q, k) / math.sqrt(d)
        weights = scores.masked_fill(future, float("-inf")).softmax(-1)
        u = torch.einsum("bhij,bjhc->bihc", weights, v)
        if v0 is None:
            v0 = v
        else:
            u = u + lam * (v0 - v)
        y = u.reshape(B, T, D) @ block.attn.proj.weight.T + block.attn.proj.bias
        if norm == "pre":
            x = x + alpha * y
            x = x + alpha * mlp(layer_norm(x, block.norm2))
        else:
            x = layer_norm(x + alpha * y, block.norm1)
            x = layer_norm(x + alpha * mlp(x), block.norm2)
    if norm == "pre":
        x = layer_norm(x, model.norm)
    logits = x @ model.embed.weight.T
    return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1))


@pytest.mark.parametrize("attention", ["softmax", "neutreno"])
@pytest.mark.parametrize(("norm", "alpha"), [("pre", 1.0), ("post", 0.5)])
def test_gradient_norms_match_explicit_autograd_on_a_two_layer_model(attention, norm, alpha):
    torch.manual_seed(0)
    lam = 0.5 if attention == "neutreno" else None
    model = TransformerLM(
        vocab_size=40,
        context_length=12,
        embed_dim=16,
        depth=2,
        num_heads=2,
        mlp_ratio=1.5,
        drop_rate=0.0,
        block_norm=norm,
        residual_scale=alpha,
        adaptive_softmax=False,
        attention=attention,
        lam=lam,
    ).double()
    for p in model.parameters():  # not the zero-bias, unit-gain init: every term shows
        p.data.normal_(0, 0.3)
    idx = torch.randint(0, 40, (3, 11))
    targets = torch.randint(0, 40, (3, 11))

    norms = qkv_gradient_norms(model.blocks, model(idx, targets).mean())

    split = [block.attn.qkv.weight.detach().chunk(3) for block in model.blocks]
    w_q, w_k, w_v = ([s[i].clone().requires_grad_() for s in split] for i in range(3))
    loss = explicit_lm_loss(model, idx, targets, w_q, w_k, w_v, norm, alpha, lam or 0.0)
    grads = torch.autograd.grad(loss, [*w_q, *w_k, *w_v])
    expected = torch.tensor([[grads[i + 2 * j].norm().item() for j in range(3)] for i in range(2)])
    assert norms.shape == (2, 3)
    # to 1e-6: the model's sinusoidal positions are float32
    torch.testing.assert_close(norms, expected.double(), rtol=1e-6, atol=0)
    assert all(p.grad is None for p in model.parameters())  # autograd.grad, not backward


def test_gradient_norms_need_separate_query_key_value_weights():
    model = TransformerLM(
        vocab_size=20,
        context_length=8,
        embed_dim=8,
        depth=2,
        num_heads=2,
        mlp_ratio=1.0,
        adaptive_softmax=False,
        attention="symmetric",
    )
    loss = model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).mean()
    with pytest.raises(ValueError, match=r"blocks \[0, 1\] have no fused attn.qkv"):
        qkv_gradient_norms(model.blocks, loss)


def test_fan_in_init_draws_variance_one_over_fan_in():
    torch.manual_seed(0)
    model = TransformerLM(
        vocab_size=20,
        context_length=8,
        embed_dim=64,
        depth=1,
        num_heads=4,
        mlp_ratio=4.0,
        adaptive_softmax=False,
    )
    rc.fan_in_init_(model.blocks)
    for linear, fan_in in [(model.blocks[0].attn.qkv, 64), (model.blocks[0].mlp.fc2, 256)]:
        assert linear.weight.std().item() == pytest.approx(fan_in**-0.5, rel=0.05)
        assert linear.bias.abs().max().item() == 0


def _record(depth, attention, seed, cosine, q, v, loss=9.0):
    setting = {"depth": depth, "norm": "post", "residual_scale": "1", "attention": attention, "seed": seed}
    return {"setting": setting, "loss": loss, "cosine": [0.5, cosine], "grad_q": q, "grad_k": q, "grad_v": v}


def test_summary_means_cosine_and_geometric_means_stack_ratios():
    records = [
        _record(2, "softmax", 0, 0.8, [3.0, 4.0], [50.0, 0.0]),  # ratio 5/50 = 0.1
        _record(2, "softmax", 1, 0.6, [1.0, 0.0], [0.0, 1000.0]),  # ratio 0.001
        _record(2, "neutreno", 0, 0.4, [1.0, 1.0], [1.0, 1.0], loss=math.inf),  # diverged
    ]
    rows = {r["attention"]: r for r in rc.summarize(records)}
    assert rows["softmax"]["last_cosine"] == pytest.approx(0.7)
    assert rows["softmax"]["q_over_v"] == pytest.approx(0.01)  # sqrt(0.1 × 0.001)
    assert rows["softmax"]["seeds"] == 2 and rows["softmax"]["diverged"] == 0
    assert rows["neutreno"]["diverged"] == 1 and rows["neutreno"]["last_cosine"] is None
    table = rc.markdown_table(list(rows.values()))
    assert "| post | 1 | softmax | 0.700 / 0.01 |" in table and "| post | 1 | neutreno | diverged |" in table


@pytest.fixture
def wikitext(shared_data):
    return str(shared_data / "wikitext103-mini")


def test_post_ln_collapses_without_depth_scaling_on_wikitext(wikitext):
    """Noci et al.'s prediction on real sentences: 16 post-LN layers with α = 1 map all tokens to nearly
    one direction and the query gradients vanish next to the value ones; α = 1/√L prevents both."""
    data = rc.load_windows(wikitext, samples=4, length=64)
    measured = {}
    for scale in ("1", "1/sqrt(L)"):
        model = rc.build_model(rc.Setting(16, "post", scale, "softmax", 0), data.vocab_size, "fan_in")
        record = rc.measure(model, data.windows)
        measured[scale] = (record["cosine"][-1], rc.stack_ratio(record["grad_q"], record["grad_v"]))
    assert measured["1"][0] > 0.98 and measured["1/sqrt(L)"][0] < 0.85
    assert measured["1/sqrt(L)"][1] > 5 * measured["1"][1]


def test_study_cli_writes_the_report_and_resumes(wikitext, tmp_path, monkeypatch, capsys):
    out = tmp_path / "study"
    args = [
        "study",
        "rank-collapse",
        "--data",
        wikitext,
        "--depths",
        "1,2",
        "--norms",
        "pre,none",
        "--residual-scales",
        "1,1/sqrt(L)",
        "--seeds",
        "0",
        "--samples",
        "2",
        "--length",
        "16",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    report = json.loads((out / "results.json").read_text())
    assert len(report["runs"]) == 2 * 2 * 2 * 2 and len(report["summary"]) == 16
    run = report["runs"][0]
    assert run["setting"] == {
        "depth": 1,
        "norm": "pre",
        "residual_scale": "1",
        "attention": "softmax",
        "seed": 0,
        "lam": None,
    }
    assert len(run["cosine"]) == 2 and len(run["grad_v"]) == 1
    assert (out / "rank_collapse.png").stat().st_size > 0
    csv_rows = (out / "rank_collapse.csv").read_text().splitlines()
    assert csv_rows[0].startswith("norm,residual_scale,attention,depth") and len(csv_rows) == 17
    table = (out / "table.md").read_text()
    assert "| none | 1/sqrt(L) | neutreno |" in table and report["lam"] == 0.4
    # the file says what its cells are (only the command's output did), the ratio's mean as computed
    assert table.startswith("last-layer token cosine (mean over seeds) / ‖∇W_Q‖/‖∇W_V‖ of the whole stack")
    assert "(geometric mean over seeds)" in table.splitlines()[0]

    # A rerun reuses every finished run (a torn last line is ignored); another λ is a different study.
    with (out / "runs.jsonl").open("a") as f:
        f.write('{"study": {"mod')
    built = []
    original = rc.build_model
    monkeypatch.setattr(rc, "build_model", lambda *a, **k: built.append(a) or original(*a, **k))
    assert main(args) == 0
    assert built == []
    assert json.loads((out / "results.json").read_text())["summary"] == report["summary"]
    # Damaged lines are left out and their settings measured again: one not an object, one without its
    # record, and a run whose cosines lost the last block's (it was trusted: its "last" cosine was the
    # second-to-last block's, with no error; a non-object line was an AttributeError traceback)
    first = json.loads((out / "runs.jsonl").read_text().splitlines()[0])
    first["record"]["cosine"] = first["record"]["cosine"][:-1]
    with (out / "runs.jsonl").open("a") as f:
        f.write("\n[1, 2]\n" + json.dumps({"study": first["study"]}) + "\n" + json.dumps(first) + "\n")
    assert main(args) == 0
    assert built == [] and json.loads((out / "results.json").read_text())["summary"] == report["summary"]
    with (out / "runs.jsonl").open("w") as f:  # the damaged run alone: measured again
        f.write(json.dumps(first) + "\n")
    assert main(args) == 0
    assert len(built) == 2 * 2 * 2 * 2
    assert json.loads((out / "results.json").read_text())["summary"] == report["summary"]
    built.clear()
    with (out / "runs.jsonl").open("a") as f:  # torn, without its newline: the next record joined it
        f.write('{"study": {"mod')
    assert main([*args, "--lam", "0.2"]) == 0
    assert len(built) == 2 * 2 * 2  # the NeuTRENO runs only: the softmax ones do not depend on λ
    built.clear()
    assert main([*args, "--lam", "0.2"]) == 0
    assert built == []  # every run measured is in runs.jsonl, the first after the torn line too
    capsys.readouterr()
    # Found in review: residual scale 1.0 for the 1 measured before measured every model again, after
    # "resuming: 0 of 16 runs already in"; they are the same models, and the table says 1.0 as asked.
    respelled = [
        *args[: args.index("--residual-scales") + 1],
        "1.0,1/sqrt(L)",
        *args[args.index("--seeds") :],
    ]
    assert main(respelled) == 0
    assert built == [] and "resuming: 0 of" not in capsys.readouterr().out
    again = json.loads((out / "results.json").read_text())
    assert {run["setting"]["residual_scale"] for run in again["runs"]} == {"1.0", "1/sqrt(L)"}
    assert [r["last_cosine"] for r in again["summary"]] == [r["last_cosine"] for r in report["summary"]]
    # a study of softmax alone recorded the default λ 0.4 as its λ, where no model had one
    softmax_only = [*args[:-1], str(tmp_path / "softmax"), "--attentions", "softmax", "--depths", "1"]
    assert main(softmax_only) == 0
    assert json.loads((tmp_path / "softmax" / "results.json").read_text())["lam"] is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--norms", "pre,sandwich"], "unknown block norm 'sandwich'"),
        (["--residual-scales", "1,half"], "residual scale must be a number or '1/sqrt(L)', got 'half'"),
        (["--residual-scales", "0"], "residual_scale must be a finite number > 0"),
        # NaN passed "<= 0": every model ran, the report was written, then the plot failed
        (["--residual-scales", "nan"], "residual_scale must be a finite number > 0"),
        (["--residual-scales", "inf"], "residual_scale must be a finite number > 0"),
        (["--attentions", "symmetric"], "attention 'symmetric' has no separate W_Q, W_K, W_V"),
        (["--attentions", "Neutreno"], "unknown attention 'Neutreno' (did you mean 'neutreno'?); valid"),
        (["--depths", "0,2"], "depths must be integers >= 1"),
        (["--depths", "2,,4"], "argument --depths: expected a comma list of int, got '2,,4' (an empty item)"),
        # built layers until the machine ran out of memory (9 GB in 20 s, growing)
        (["--depths", "1000000"], "--depths 1000000: the float64 weights and their gradients alone need"),
        (["--length", "129"], "--length 2..128"),
        (["--length", "1"], "--length 2..128 (a token cosine needs two)"),  # failed inside, runs.jsonl left
        # an empty list studied nothing and wrote empty tables before matplotlib failed
        (["--seeds", ","], "argument --seeds: expected a comma list of seed, got ','"),
        (["--attentions", ","], "argument --attentions: expected a comma list of str, got ','"),
        # one model measured twice counted as two seeds
        (["--seeds", "0,0"], "argument --seeds: 0 given twice in '0,0'"),
        (["--seeds", "99999999999999999999"], "argument --seeds: expected a comma list of seed"),  # overflow
        (["--depths", "2,4,2"], "argument --depths: 2 given twice"),
        (["--residual-scales", "1,1.0"], "residual scales 1, 1.0 are one value"),  # was run twice
        # recorded as the study's λ in results.json, where no model had one
        (["--attentions", "softmax", "--lam", "0.3"], "--lam 0.3 is for the NeuTRENO variants"),
    ],
)
def test_study_cli_refuses_bad_grids_before_reading_data(tmp_path, capsys, extra, message):
    args = [
        "study",
        "rank-collapse",
        "--data",
        str(tmp_path / "missing"),
        "--out",
        str(tmp_path / "o"),
        *extra,
    ]
    try:
        code, usage = main(args), False
    except SystemExit as parsed:  # argparse's own refusal of an argument, after its usage line
        code, usage = parsed.code, True
    assert code == 2
    err = capsys.readouterr().err.strip()
    err = err.splitlines()[-1] if usage else err
    assert err.startswith("neutreno study rank-collapse: error:") and message in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_a_collapsed_stacks_gradient_ratio_is_measured_beyond_float32(wikitext, tmp_path):
    """At depth 128 post-LN ‖∇W_Q‖/‖∇W_V‖ is ~1e-15; measured in float32 it plateaued near 7e-8, the
    rounding of the gradients. And a study whose every cell diverged failed in its plot (no lines)."""
    data = rc.load_windows(wikitext, samples=2, length=16)
    # more samples than the split has windows repeated windows: fewer distinct inputs than reported
    stream_tokens = len(rc.load_corpus(wikitext)[1]["valid"])
    assert len(rc.load_windows(wikitext, samples=stream_tokens - 16, length=16).windows) == stream_tokens - 16
    with pytest.raises(ValueError, match=f"has {stream_tokens - 16} windows of 17 tokens"):
        rc.load_windows(wikitext, samples=stream_tokens - 15, length=16)
    model = rc.build_model(rc.Setting(128, "post", "1", "softmax", 0), data.vocab_size, "fan_in")
    record = rc.measure(model, data.windows)
    assert rc.stack_ratio(record["grad_q"], record["grad_v"]) < 1e-12
    diverged = [_record(depth, "softmax", 0, 0.5, [math.nan], [1.0], loss=math.nan) for depth in (32, 64)]
    rows = rc.summarize(diverged)
    assert all(row["diverged"] == 1 and row["last_cosine"] is None for row in rows)
    assert rc.plot(rows, tmp_path / "p.png", "fan_in").stat().st_size > 0


def test_a_layer_whose_attention_is_one_hot_gets_no_query_or_key_gradient(wikitext):
    """64 layers without LayerNorm, α = 1: the hidden states reach ~1e15 and from layer 21 on every
    attention row is exactly one-hot in float64 (recomputed here from each block's input, written out),
    where softmax's Jacobian diag(p) − p pᵀ is 0, so those layers' ∇W_Q and ∇W_K are exactly 0. The
    fused kernel's backward made rounding noise of that, compounded through the layers: ‖∇W_V‖ up to
    8e207 (3e15 here) and a Q/V ratio of 0.12 where it is 0.004, printed in the study's table."""
    from neutreno.diagnostics import capture_hidden_states

    data = rc.load_windows(wikitext, samples=8, length=128)
    model = rc.build_model(rc.Setting(64, "none", "1", "softmax", 0), data.vocab_size, "fan_in")
    record = rc.measure(model, data.windows)  # converts the model to float64
    with torch.no_grad(), capture_hidden_states(model.blocks) as hidden:
        model(data.windows[:, :-1], data.windows[:, 1:])
    tokens = data.windows.shape[1] - 1
    future = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    one_hot = []
    for block, x in zip(model.blocks, hidden[:-1], strict=True):  # each block's input
        heads = block.attn.num_heads
        q, k, _ = (x @ block.attn.qkv.weight.T + block.attn.qkv.bias).chunk(3, -1)
        q, k = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k))
        weights = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(future, -math.inf).softmax(-1)
        one_hot.append(bool((weights.topk(2).values[..., 1:, 1] == 0).all()))  # row 0 sees one token
    assert sum(one_hot) >= 30
    for layer in (i for i, is_one_hot in enumerate(one_hot) if is_one_hot):
        assert record["grad_q"][layer] == 0 and record["grad_k"][layer] == 0, layer
    assert max(record["grad_v"]) < 1e18 and rc.stack_ratio(record["grad_q"], record["grad_v"]) < 0.01


def test_finite_gradients_past_1e154_have_finite_norms_and_ratios():
    """A deep unnormalised stack's float64 gradients pass 1e154, where a sum of squares overflows:
    vector_norm gave inf for finite gradients and the study called the run diverged."""

    class Attn(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.qkv = torch.nn.Linear(2, 6, bias=False, dtype=torch.float64)
            with torch.no_grad():
                self.qkv.weight.copy_(weight)

    weight = torch.arange(1.0, 13.0, dtype=torch.float64).view(6, 2)
    blocks = [torch.nn.Module(), torch.nn.Module()]
    blocks[0].attn, blocks[1].attn = Attn(weight), Attn(-weight)
    loss = sum((1e200 * b.attn.qkv.weight.square()).sum() / 2 for b in blocks)  # ∂/∂w = 1e200 · w
    norms = qkv_gradient_norms(blocks, loss)
    for row, block in zip(norms, blocks, strict=True):
        for part, expected in zip(row.tolist(), block.attn.qkv.weight.detach().view(3, -1), strict=True):
            assert part == pytest.approx(1e200 * math.hypot(*expected.tolist()), rel=1e-12)
    record = {"loss": 1.0, "cosine": [1.0], "grad_q": norms[:, 0].tolist(), "grad_k": norms[:, 1].tolist(),
              "grad_v": norms[:, 2].tolist()}  # fmt: skip
    assert rc.finite(record)
    q, v = [math.hypot(1, 2, 3, 4)] * 2, [math.hypot(9, 10, 11, 12)] * 2  # W_Q's entries 1…4, W_V's 9…12
    assert rc.stack_ratio(norms[:, 0].tolist(), norms[:, 2].tolist()) == pytest.approx(
        math.hypot(*q) / math.hypot(*v), rel=1e-12
    )


def test_a_measurement_past_the_machines_memory_is_refused_before_it_runs(monkeypatch):
    """--samples 100000 --length 8 measured all windows in one float64 batch (the logits over WikiText's
    34,147 words alone: 100000 × 8 × 34147 × 8 B ≈ 204 GiB) and was killed by the kernel, no message."""
    import os

    from neutreno.studies.rank_collapse import StudyData, check_memory

    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 24 * 2**30 // 4096}  # a 24 GiB machine
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    windows = torch.zeros(100_000, 9, dtype=torch.long)
    with pytest.raises(
        # 611 GiB of logits, softmax and its gradient; 24 GiB more of one layer's kept activations
        ValueError,
        match=r"--samples 100000 × --length 8 at depth 1: .* need about 635 GiB, more than half of",
    ):
        check_memory(StudyData(windows, 34147, "wikitext"))
    check_memory(StudyData(windows[:1000], 34147, "wikitext"))  # 6 GiB: under half of 24
    # the depth's share: weights, gradients and kept activations of every layer
    with pytest.raises(ValueError, match=r"at depth 4000: .* lower --samples or --depths"):
        check_memory(StudyData(windows[:1000], 34147, "wikitext"), depth=4000)


@pytest.mark.parametrize("lines, cutoffs", [(40, []), (300, [2000])])
def test_a_corpus_smaller_than_the_models_cutoffs_is_studied(shared_data, tmp_path, capsys, lines, cutoffs):
    """A real WikiText corpus of fewer than 10,000 words was refused by lm_wt103_mini's adaptive softmax
    (cutoffs 2000, 10000: a vocab_size the user never set), after the study had made its folder. The
    head keeps the cutoffs below the vocabulary, or is a plain softmax where none is."""
    corpus = tmp_path / "small"
    corpus.mkdir()
    for split in ("train", "valid", "test"):
        text = (shared_data / "wikitext103-mini" / f"wiki.{split}.tokens").read_text().splitlines()[:lines]
        (corpus / f"wiki.{split}.tokens").write_text("\n".join(text) + "\n")
    out = tmp_path / "study"
    args = ["study", "rank-collapse", "--data", str(corpus), "--depths", "2", "--norms", "pre",
            "--residual-scales", "1", "--attentions", "softmax", "--seeds", "0", "--samples", "2",
            "--length", "8", "--out", str(out)]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    data = rc.load_windows(corpus, samples=2, length=8)
    model = rc.build_model(rc.Setting(2, "pre", "1", "softmax", 0, None), data.vocab_size, "fan_in")
    head = model.head
    assert (head.cutoffs[:-1] if isinstance(head, torch.nn.AdaptiveLogSoftmaxWithLoss) else []) == cutoffs
    assert len(json.loads((out / "results.json").read_text())["runs"]) == 1
