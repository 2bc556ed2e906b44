"""Analysing models layer by layer: the models to compare (ours from the registry or a checkpoint,
Hugging Face encoders and decoders with or without NeuTRENO), real inputs shaped for them, and the
per-layer math.md §3 metrics, spectra, sentence rankings (encoders) and next-token log-likelihoods
(decoders) computed on those inputs. ``neutreno analyze`` and ``neutreno reproduce`` both build on this
module."""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from neutreno.diagnostics.collect import BlockProbe, HFProbe, hf_is_causal, hf_is_decoder, hf_layers
from neutreno.diagnostics.layerwise import ATTENTION_METRICS, analyze_layers
from neutreno.diagnostics.metrics import spearman_correlation
from neutreno.diagnostics.spectral import layer_spectra, terms_beyond_the_rule, value_output_maps
from neutreno.evaluation.language_model import perplexity
from neutreno.layers import has_learned_lam, lam_by_layer
from neutreno.models import create_model, list_models, load_model
from neutreno.models.checkpoint import checkpoint_kind, read_metadata


@dataclass
class ModelVariant:
    """One model to analyse, built from a ``--model``/``--compare`` spec."""

    label: str
    kind: str  # "neutreno" (our registry or checkpoint) or "hf"
    model: nn.Module
    lam: float | None = None  # for "hf": NeuTRENO put in by hooks when > 0
    info: dict = field(default_factory=dict)
    causal: bool = False  # a decoder-only language model: causal attention, next-token logits
    tokenizer: object | None = None  # our language model's (its checkpoint's): it reads token windows
    weights: Path | None = None  # a checkpoint's weights file, resolved (run1 and ./run1: one model)


def build_variants(
    spec: str, attentions: list[str], lams: list[float | None], seed: int, hf_attention: str | None = None
) -> list[ModelVariant]:
    """Expand one model spec into variants (registry models over ``attentions`` × ``lams``).
    ``hf_attention``: the kernel an ``hf:`` model is loaded with (``"eager"`` where attention maps will
    be read: transformers cannot switch some model types after loading), else the model's default."""
    if spec.startswith("hf:"):
        from neutreno.integrations.hf import apply_neutreno, load_hf, neutreno_lambda, restore_neutreno

        causal, loader = hf_text_loader(spec)
        variants = []
        for lam in lams:
            kernel = {"attn_implementation": hf_attention} if hf_attention else {}
            # float32 whatever dtype its config records (transformers' default loads a bf16 save in bf16)
            model, loading = load_hf(
                loader, spec[3:], output_loading_info=True, dtype=torch.float32, **kernel
            )
            model.eval()
            causal = causal or hf_is_causal(model)  # a text tower whose config names no causal LM
            if lam:
                apply_neutreno(model, lam)  # λ = 0: the model's own attention
            elif lam is None:  # no λ asked: a model saved after apply_neutreno runs as it was saved
                lam = neutreno_lambda(restore_neutreno(model, spec[3:]))
            label = f"{Path(spec[3:]).name} λ={lam or 0:g}"
            info = {"spec": spec, "lam": lam or 0.0}
            if has_learned_lam(model):  # saved with a learned λ: it runs at the λ it learned, not its start
                label = f"{Path(spec[3:]).name} λ learned from {lam:g}"
                info["learned_lam"] = lam_by_layer(model)
            if causal:
                info["causal"] = True
                if model.get_output_embeddings() is None:
                    info["lm_head"] = "none: the model has no language-model head"
                elif _head_names(model) & set(loading["missing_keys"]):  # a base model saved without its head
                    info["lm_head"] = "random: not in the checkpoint"
            variants.append(ModelVariant(label, "hf", model, lam or 0.0, info, causal))
        return variants
    if spec in list_models() and Path(spec).is_dir():  # the folder took the name's place, silently
        raise ValueError(f"{spec!r} is a registry model and a folder here: write ./{spec} for the folder")
    if spec.endswith(".safetensors") or Path(spec).is_dir():
        from neutreno.training.checkpoint import lam_warmup_note, resolve_weights

        weights = resolve_weights(spec)  # a run or checkpoint folder: its weights
        tokenizer = None
        if checkpoint_kind(read_metadata(weights)) == "language model":
            from neutreno.training.language_model import load_language_model

            model, tokenizer, meta = load_language_model(weights)  # with the tokenizer its text needs
            # the record, not its words (WikiText-103's 267,735 filled the report)
            meta = {**meta, "tokenizer": describe_tokenizer(meta["tokenizer"], len(tokenizer))}
        else:
            model, meta = load_model(weights)
        name = Path(spec).name if Path(spec).is_dir() else Path(spec).stem  # a run folder "model.lam=0.2"
        label = f"{name} ({meta['model']}, {meta['attention']})"
        info = {"spec": spec, **meta}
        if has_learned_lam(model):
            info["learned_lam"] = lam_by_layer(model)  # where a learned λ settled, per layer (or head)
        causal = tokenizer is not None  # our language model
        if causal:
            info["causal"] = True
        resolved = Path(weights).resolve()
        info["weights"] = str(resolved)  # a run folder's latest: which one was measured (it moves on)
        warmup = lam_warmup_note(weights)
        if warmup:
            print(warmup, file=sys.stderr)
        return [
            ModelVariant(
                label, "neutreno", model, info=info, causal=causal, tokenizer=tokenizer, weights=resolved
            )
        ]
    if spec not in list_models():
        raise ValueError(f"unknown model {spec!r}: give a registry name ({', '.join(list_models())}), "
                         "a .safetensors checkpoint or hf:<path>")  # fmt: skip
    variants = []
    for attention in attentions:
        for lam in lams if attention.endswith("neutreno") else [None]:
            torch.manual_seed(seed)  # every variant starts from the same weights
            model = create_model(spec, attention=attention, lam=lam).eval()
            require_image_transformer(model, spec)
            lam_used = model.blocks[0].attn.lam
            label = f"{spec} {attention}" + (f" λ={lam_used:g}" if lam_used else "")
            info = {"spec": spec, "attention": attention, "lam": lam_used, "init": f"random, seed {seed}"}
            variants.append(ModelVariant(label, "neutreno", model, info=info))
    return variants


def hf_text_loader(spec: str) -> tuple[bool, type]:
    """Whether the ``hf:`` model of ``spec`` is a decoder, and the Auto class it is analysed with: a
    decoder with its language-model head (the cost of NeuTRENO is measured on its next-token
    predictions, next_token_log_likelihood), an encoder as ``AutoModel``.

    Raises:
        ValueError: an encoder-decoder model, or a model that reads no text (a vision or audio encoder:
            analyze feeds Hugging Face models tokenised sentences).
    """
    from neutreno.integrations.hf import hf_model_path, load_hf, require_transformers

    hf_model_path(spec[3:])  # hf:minilm without its package: the extra that installs both, named first
    require_transformers()
    import transformers

    config = load_hf(transformers.AutoConfig, spec[3:])
    causal = hf_is_decoder(config)
    loader = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    model_class = loader._model_mapping.get(type(config), None)  # (a private mapping; no class: no check)
    reads = getattr(model_class, "main_input_name", "input_ids")
    if reads != "input_ids":
        raise ValueError(
            f"{spec} is a {config.model_type} model, which reads {reads}, not text: analyze feeds Hugging "
            "Face models sentences (BERT family, decoder-only LMs); images go into our ViTs (a registry "
            "name or a neutreno checkpoint)"
        )
    return causal, loader


def unique_labels(variants: list[ModelVariant]) -> list[ModelVariant]:
    """The variants, each label naming one model: results are keyed by label, so two runs' checkpoints
    both called ``model.safetensors`` kept one model's results under a name fitting both. Colliding
    labels take their spec as given (the path); the same model given twice is an error."""
    files = Counter(v.weights for v in variants if v.weights is not None)
    twice = [str(w) for w, n in files.items() if n > 1]
    if twice:  # run1 and ./run1, or a run folder and its checkpoint's file: other labels, one model
        raise ValueError(f"the same model is given twice: {', '.join(twice)}")
    count = Counter(v.label for v in variants)
    for v in variants:
        if count[v.label] > 1:
            v.label = f"{v.info.get('spec', v.label)}: {v.label}"
    repeated = sorted(label for label, n in Counter(v.label for v in variants).items() if n > 1)
    if repeated:
        raise ValueError(f"the same model is given twice: {', '.join(repeated)}")
    return variants


def require_image_transformer(model: nn.Module, spec: str) -> None:
    """``neutreno analyze`` reads images into our models through ``patch_embed`` and ``blocks``: a language
    model or a Segmenter would fail deep inside with an AttributeError. (A Segmenter checkpoint is
    measured by ``neutreno reproduce``'s segmenter-similarity claim, on its own encoder.)"""
    if not (hasattr(model, "patch_embed") and hasattr(model, "blocks")):
        raise ValueError(
            f"{spec} is a {type(model).__name__}: analyze reads images into our ViTs (vit_*, deit_*), and "
            "text into our language models (a checkpoint of neutreno train: it records the tokenizer) and "
            "Hugging Face models (hf:<path>)"
        )


def _head_names(model: nn.Module) -> set[str]:
    """The parameter names of a language model's output layer (``lm_head.weight`` mostly)."""
    head = model.get_output_embeddings()
    prefix = next((name for name, module in model.named_modules() if module is head), None)
    return set() if prefix is None else {f"{prefix}.{name}" for name, _ in head.named_parameters()}


def image_batches(
    variant: ModelVariant, data: str, samples: int, batch_size: int, seed: int
) -> list[torch.Tensor]:
    """Images shaped and normalised for one of our ViTs (with the mean/std a trained checkpoint records)."""
    from neutreno.data.images import load_images, normalize_imagenet

    embed = variant.model.patch_embed
    size, channels = embed.img_size, embed.proj.in_channels
    preprocess = variant.info.get("preprocess")

    def normalize(images: torch.Tensor) -> torch.Tensor:
        if preprocess is not None:  # a trained checkpoint records the mean/std it was trained with
            mean, std = (torch.tensor(preprocess[k]).view(1, -1, 1, 1) for k in ("mean", "std"))
            return (images - mean) / std
        return normalize_imagenet(images) if channels == 3 else images

    if data == "random":
        images = torch.randn(samples, channels, size, size, generator=torch.Generator().manual_seed(seed))
    elif data == "digits" and preprocess is not None:
        # a checkpoint `neutreno train` wrote from the digits: its test split as evaluation reads it
        # (uint8 pixels, the recorded crop, PIL bicubic), not the float path below
        from neutreno.data.datasets import open_image_dataset

        crop_pct = preprocess.get("crop_pct", 1.0)
        test = open_image_dataset(
            "digits", "test", size=size, train=False, crop_pct=crop_pct, channels=channels
        )
        images = torch.stack([test[i][0] for i in range(min(samples, len(test)))]).float() / 255
        images = normalize(images)
    elif data == "digits":
        from neutreno.data import load_digits_split

        _, _, images, _ = load_digits_split(seed=0)
        images = torch.nn.functional.interpolate(images[:samples], size=(size, size), mode="bilinear")
        images = images.expand(-1, channels, -1, -1)
        images = normalize(images)
    else:
        # a trained checkpoint's evaluation crop; otherwise the shorter side to size, nothing cut
        crop_pct = (preprocess or {}).get("crop_pct", 1.0)
        images, _ = load_images(data, size=size, channels=channels, limit=samples, crop_pct=crop_pct)
        images = normalize(images)
    if len(images) < samples:  # the report's "samples" is what was read: said, not only recorded
        print(
            f"note: {data} holds {len(images)} images; analysed {len(images)}, not --samples {samples}",
            file=sys.stderr,
        )
    return list(images.split(batch_size))


def describe_tokenizer(record: dict, size: int) -> str:
    """A checkpoint's tokenizer record in a line: its kind, size and a digest that tells two apart."""
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]
    kind = "words" if record.get("kind") == "words" else "subwords"
    return f"{size} {kind}, sha256 {digest}"


def token_windows(variant: ModelVariant, data: str, samples: int, batch_size: int) -> list[torch.Tensor]:
    """Token-id batches (b, L) for one of our language models: ``data`` (a text file, or a corpus
    folder's valid split) encoded with the checkpoint's own tokenizer, as ``neutreno eval`` encodes it,
    cut into up to ``samples`` consecutive windows of the model's context length L (the text's length
    where it is shorter), from the start; text the tokenizer does not know is warned of on stderr."""
    from neutreno.data.corpus import encode_file, split_file, unread_text

    path = Path(data)
    if data in ("digits", "random"):
        raise ValueError(
            f"{variant.info['spec']} is a language model: --data must be a text file or a corpus folder, "
            f"got {data!r}"
        )
    if not path.exists():
        raise FileNotFoundError(f"no such text file or corpus folder: {data}")
    if path.is_dir():
        path = split_file(path, "valid")
    ids = encode_file(path, variant.tokenizer)
    unknown, dropped = unread_text(path, variant.tokenizer, ids)
    if unknown:  # all <unk>: tokens alike by construction, and a similarity that says so
        print(
            f"warning: {path}: {unknown} of {len(ids)} tokens ({unknown / len(ids):.1%}) are text the "
            "model's tokenizer does not know, read as <unk>",
            file=sys.stderr,
        )
    if dropped:  # the model reads what is left: another text than the file's
        print(
            f"warning: {path}: the model's tokenizer drops {dropped} characters (no token stands for "
            "them, and it has no unknown token): they are not in what is analysed",
            file=sys.stderr,
        )
    if len(ids) < 2:  # one token has no other to be alike with
        raise ValueError(f"{path}: {len(ids)} token(s); analysing a language model needs at least 2")
    length = min(variant.model.context_length, len(ids))
    count = min(samples, len(ids) // length)
    if count < samples:  # said, as for images (19 windows of 100 were only recorded)
        print(
            f"note: {path} holds {count} windows of {length} tokens; analysed {count}, not --samples "
            f"{samples}",
            file=sys.stderr,
        )
    windows = ids[: count * length].view(-1, length)
    return list(windows.split(batch_size))


def check_text_file(data: str) -> None:
    """Refuse ``--data`` that is not a text file of sentences (what a Hugging Face model reads)."""
    if data in ("digits", "random") or Path(data).is_dir():
        raise ValueError(f"hf models need a text file as --data, got {data!r}")
    if not Path(data).is_file():
        raise FileNotFoundError(f"no such text file: {data} (hf models read one sentence per line)")


def text_batches(variant: ModelVariant, data: str, samples: int, batch_size: int) -> list[dict]:
    """Tokenised sentence batches for a Hugging Face encoder or decoder, padded on the right (at most
    128 tokens, or the model's position limit); a decoder's hold ``input_ids`` and ``attention_mask``
    only, what it generates from. ``attention_mask`` marks the real tokens; a tokenizer
    without a pad token (GPT-2's) pads with its end-of-text token, which the mask leaves out. Right
    padding keeps a decoder's real tokens at the positions they have alone, and under causal attention
    they never see the padding after them."""
    import transformers

    from neutreno.data.text import load_sentences
    from neutreno.integrations.hf import usable_positions

    check_text_file(data)
    config = variant.model.config
    tokenizer = transformers.AutoTokenizer.from_pretrained(config._name_or_path, trust_remote_code=False)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {config._name_or_path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    check_tokenizer_fits(tokenizer, variant.model, config._name_or_path)
    positions = usable_positions(variant.model)  # RoBERTa's: 2 fewer than max_position_embeddings
    length = min(128, positions[0] if positions else 128)
    sentences = load_sentences(data, limit=samples)
    lengths = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
    cut = sum(n > length for n in lengths)
    if cut:  # two models compared may read other tokens of one text (another position limit)
        print(
            f"note: {data}: {cut} of {len(sentences)} texts are longer than {length} tokens "
            f"({config._name_or_path}'s analysis length) and are cut to their first {length}",
            file=sys.stderr,
        )
    batches = [
        tokenizer(batch, padding=True, truncation=True, max_length=length, return_tensors="pt")
        for batch in (sentences[i : i + batch_size] for i in range(0, len(sentences), batch_size))
    ]
    if variant.causal:  # as it generates: a BERT tokenizer's token_type_ids (all 0) made GPT-2 add the
        # embedding of token 0 to every position, a model run no other way
        batches = [{key: batch[key] for key in ("input_ids", "attention_mask")} for batch in batches]
    largest = max(int(b["input_ids"].max()) for b in batches)
    if largest >= getattr(config, "vocab_size", largest + 1):
        raise ValueError(
            f"the tokenizer of {config._name_or_path} gives token id {largest}, beyond the model's "
            f"vocabulary (vocab_size {config.vocab_size})"
        )
    unk = tokenizer.unk_token_id
    if unk is not None:  # all unknown: tokens alike by construction, and a similarity that says so
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        unknown = sum(int(((b["input_ids"] == unk) & b["attention_mask"].bool()).sum()) for b in batches)
        if unknown:
            print(
                f"warning: {data}: {unknown} of {real} tokens ({unknown / real:.1%}) are text the tokenizer "
                f"of {config._name_or_path} does not know, read as {tokenizer.unk_token}",
                file=sys.stderr,
            )
    return batches


def check_tokenizer_fits(tokenizer, model: torch.nn.Module, name: str) -> None:
    """Refuse a tokenizer with more tokens than the model has embedding rows (whether a text is refused
    then depends on its words: those whose ids fit ran with another model's ids), and warn of one with
    far fewer (ids of another vocabulary that happen to fit: BERT's 30,522 tokens with GPT-2's 50,257)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if not isinstance(rows, int):
        return
    tokens = len(tokenizer)
    if tokens > rows:
        raise ValueError(
            f"the tokenizer of {name} has {tokens:,} tokens, the model's embedding {rows:,} rows: it is not "
            "this model's tokenizer (or its added tokens were never given embeddings)"
        )
    if tokens < 0.9 * rows:  # vocabularies padded to a multiple of 64 or 128 differ by far less
        print(
            f"warning: the tokenizer of {name} has {tokens:,} tokens, the model's embedding {rows:,} rows: "
            "is it this model's tokenizer?",
            file=sys.stderr,
        )


def probe_for(variant: ModelVariant, attention: bool):
    """The probe that collects a variant's per-layer tensors."""
    if variant.kind == "hf":
        return HFProbe(variant.model, attention=attention)
    # a language model's hidden states without its head's log-probabilities over the whole vocabulary
    forward = variant.model.forward_features if variant.tokenizer is not None else None
    return BlockProbe(variant.model, attention=attention, forward=forward)


def num_layers(variant: ModelVariant) -> int:
    if variant.kind == "hf":
        return len(hf_layers(variant.model))
    return len(variant.model.blocks)


def run_analysis(variant: ModelVariant, batches: list, metrics: list[str]) -> dict[str, dict[int, float]]:
    probe = probe_for(variant, attention=any(m in ATTENTION_METRICS for m in metrics))
    return analyze_layers(probe, batches, metrics, desc=variant.label)


def attention_maps(variant: ModelVariant, batch, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Head-averaged attention of block ``layer`` (1-based) for one batch, (B, N, N), and which tokens
    are real, (B, N) bool (None where all are): a padded query's row is not the model's attention."""
    collected = probe_for(variant, attention=True)(batch)
    return collected.attn[layer - 1].mean(1), collected.mask


def spectrum_analysis(variant: ModelVariant, batch) -> list[dict]:
    """Per layer: H_eff's eigenvalues, the predicted regime (none for a layer with NeuTRENO's term:
    :func:`terms_beyond_the_rule`) and the measured high-frequency ratios on one batch (math.md §3
    "Spectral regime")."""
    layers = probe_for(variant, attention=True)(batch)
    maps, beyond = value_output_maps(variant.model), terms_beyond_the_rule(variant.model)
    return [s.as_dict() for s in layer_spectra(maps, layers, beyond)]


@torch.no_grad()
def sentence_embeddings(model: nn.Module, batches: list[dict]) -> torch.Tensor:
    """Sentence embeddings (S, D): the last hidden states averaged over real tokens, the pooling of
    sentence-transformers' all-MiniLM-L6-v2."""
    pooled = []
    for batch in batches:
        hidden = model(**batch).last_hidden_state.float()  # a bf16 mean and cosines: 30 distinct of 2,016
        mask = batch["attention_mask"][..., None].to(hidden.dtype)
        pooled.append((hidden * mask).sum(1) / mask.sum(1))
    return torch.cat(pooled)


def _lambda_sweep(variants: list[ModelVariant], causal: bool) -> tuple[ModelVariant, list] | None:
    """The first hf model of the kind asked for (encoder or decoder) at λ = 0, and the same model's
    other variants (other λ); None when there are none."""
    hf = [v for v in variants if v.kind == "hf" and v.causal == causal]
    reference = next((v for v in hf if v.lam == 0), None)
    if reference is None:
        return None
    others = [v for v in hf if v is not reference and v.info["spec"] == reference.info["spec"]]
    return (reference, others) if others else None


def sentence_ranking(variants: list[ModelVariant], batches: dict) -> dict | None:
    """How NeuTRENO without fine-tuning changes what a sentence encoder finds similar: Spearman
    correlation between the cosine similarities of all sentence pairs under each λ and under λ = 0
    (1 = the same ranking). None unless an hf encoder is analysed at λ = 0 and another λ."""
    sweep = _lambda_sweep(variants, causal=False)
    if sweep is None:
        return None
    reference, others = sweep
    batches = batches[("text", reference.model.config._name_or_path)]

    def pair_scores(model: nn.Module) -> torch.Tensor:
        embeddings = torch.nn.functional.normalize(sentence_embeddings(model, batches), dim=-1)
        i, j = torch.triu_indices(len(embeddings), len(embeddings), offset=1)
        return (embeddings[i] * embeddings[j]).sum(-1)

    base = pair_scores(reference.model)
    spearman = {v.label: spearman_correlation(base, pair_scores(v.model)) for v in others}
    return {"reference": reference.label, "pairs": len(base), "spearman": spearman}


@torch.no_grad()
def next_token_log_likelihood(model: nn.Module, batches: list[dict]) -> tuple[float, int]:
    """A causal language model's mean log p(x_{t+1} | x_≤t) in nats over every real predicted token of
    ``batches`` (tokens pooled across sentences), and the number of those tokens. Position t predicts
    token t + 1 when both are real (``attention_mask``); the first token of a sentence is not predicted."""
    total, count = 0.0, 0
    for batch in batches:
        logits = model(**batch, use_cache=False).logits[:, :-1].float()  # (B, N − 1, vocab)
        targets = batch["input_ids"][:, 1:]
        real = batch["attention_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()
        # log softmax at the target only: the (B, N, vocab) log-probabilities are never stored
        log_p = logits.gather(-1, targets[..., None])[..., 0] - logits.logsumexp(-1)
        total += log_p[real].double().sum().item()
        count += int(real.sum())
    if not count:
        raise ValueError("no token to predict: every sentence has a single token")
    return total / count, count


def check_log_likelihood(variants: list[ModelVariant]) -> tuple[ModelVariant, list] | None:
    """The decoder λ sweep :func:`log_likelihood_change` measures (None when there is none), or a
    ValueError when its model has no trained language-model head: raised before any work."""
    sweep = _lambda_sweep(variants, causal=True)
    if sweep is not None and "lm_head" in sweep[0].info:
        raise ValueError(
            f"{sweep[0].info['spec']} has no trained language-model head ({sweep[0].info['lm_head']}), "
            "so its next-token log-likelihood means nothing: save the …ForCausalLM model"
        )
    return sweep


def log_likelihood_change(variants: list[ModelVariant], batches: dict) -> dict | None:
    """What NeuTRENO without fine-tuning costs a decoder's predictions: per λ, the mean next-token
    log-likelihood on the analysed text (nats per real predicted token), its change from λ = 0 (< 0:
    the text got less likely) and the perplexity ratio exp(−change) (> 1: worse). None unless an hf
    decoder is analysed at λ = 0 and another λ."""
    sweep = check_log_likelihood(variants)
    if sweep is None:
        return None
    reference, others = sweep
    batches = batches[("text", reference.model.config._name_or_path)]
    base, tokens = next_token_log_likelihood(reference.model, batches)
    nats = {reference.label: base}
    nats.update({v.label: next_token_log_likelihood(v.model, batches)[0] for v in others})
    return {
        "reference": reference.label,
        "tokens": tokens,
        "lam": {v.label: v.lam for v in (reference, *others)},  # a learned λ's start (its info has the rest)
        "nats_per_token": nats,
        "perplexity": {label: perplexity(-value) for label, value in nats.items()},
        "change": {label: value - base for label, value in nats.items()},
        "perplexity_ratio": {label: perplexity(base - value) for label, value in nats.items()},
    }


@torch.no_grad()
def per_sample_layers(
    variant: ModelVariant, batches: list, metric: str = "cosine"
) -> dict[int, torch.Tensor]:
    """Per layer (0 = embeddings), a hidden-state metric of every sample (S,): the values a per-item
    paired comparison needs, where :func:`run_analysis` gives only their means."""
    from neutreno.diagnostics.layerwise import HIDDEN_METRICS, hidden_metric_by_layer

    if metric not in HIDDEN_METRICS:
        raise ValueError(f"per-sample values need a hidden-state metric ({', '.join(HIDDEN_METRICS)})")
    probe = probe_for(variant, attention=False)
    values: dict[int, list[torch.Tensor]] = {}
    for batch in batches:
        layers = probe(batch)
        for index, value in enumerate(hidden_metric_by_layer(metric, layers.hidden, layers.mask)):
            values.setdefault(index, []).append(value.float())
    return {index: torch.cat(chunks) for index, chunks in values.items()}


def initial_variant(variant: ModelVariant, seed: int) -> ModelVariant:
    """The untrained twin of a trained model of ours: rebuilt from its recorded architecture after
    ``torch.manual_seed(seed)``, which is how ``neutreno train`` seeds the model it starts from."""
    meta = variant.info
    if variant.kind != "neutreno" or "model" not in meta:
        raise ValueError(f"{variant.label} is not one of our trained models")
    attention = meta.get("attention", "softmax")
    lam = meta.get("lam") if attention.endswith("neutreno") else None
    torch.manual_seed(seed)
    model = create_model(meta["model"], attention=attention, lam=lam, **meta.get("args", {})).eval()
    return ModelVariant(
        f"{variant.label}, untrained", "neutreno", model, info={**meta, "init": f"random, seed {seed}"}
    )
