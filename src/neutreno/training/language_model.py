"""Language modelling (math.md §4 WikiText-103 LM): its config, and the task the training engine runs.

Training windows are the corpus cut into non-overlapping pieces of ``context_length + 1`` tokens
(inputs and shifted targets), shuffled each epoch by the engine; with no memory between windows
this sees every token once per epoch, as Transformer-XL's ordered iterator does for ``mem_len 0``.
Validation during training scores the validation windows the same way (a fast, pessimistic
perplexity); ``neutreno eval`` gives the paper's sliding-window perplexity.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from neutreno.config import (
    check,
    check_attention,
    check_model_args,
    check_model_builds,
    check_named,
    check_num_workers,
)
from neutreno.data.corpus import (
    SubwordTokenizer,
    Vocabulary,
    load_corpus,
    split_file,
    tokenizer_from_metadata,
)
from neutreno.evaluation.language_model import perplexity
from neutreno.models import TransformerLM, create_model, list_models, load_model
from neutreno.models.language_model import CutoffsError
from neutreno.progress import note
from neutreno.training.checkpoint import resolve_weights
from neutreno.training.engine import OptimConfig, TrainConfig


@dataclasses.dataclass
class LanguageModelConfig:
    name: str = "lm_wt103_mini"  # a registry name: lm_wt103 or lm_wt103_mini
    attention: str = "softmax"  # math.md §2
    lam: float | None = None  # λ of the NeuTRENO variants (language models default to 0.4)
    args: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. block_norm, tie_embeddings, depth

    def __post_init__(self) -> None:
        check(
            self.name in list_models("lm_*"),
            "name",
            f"unknown language model {self.name!r}; one of {', '.join(list_models('lm_*'))}",
        )
        check_attention(self.attention, self.lam)
        check("vocab_size" not in self.args, "args", "vocab_size comes from the corpus's tokenizer")
        check_model_args(self.args, ("attention", "lam"), ())


@dataclasses.dataclass
class TextDataConfig:
    corpus: str = "${NEUTRENO_DATA}/wikitext103-mini"  # a WikiText folder, or train.txt/valid.txt[/test.txt]
    tokenizer: str | None = None  # raw text only: a tokenizers JSON file or a folder holding tokenizer.json
    num_workers: int = 0  # windows are slices of an in-memory tensor; workers would only add overhead

    def __post_init__(self) -> None:
        check_named(self, ("corpus", "tokenizer"))  # "" is the current folder
        check_num_workers(self.num_workers)


def _lm_optim() -> OptimConfig:
    # lmtool-fwp / Transformer-XL: Adam lr 2.5e-4, 2000 warm-up steps, cosine to 0, gradient clip 0.25.
    return OptimConfig(
        lr=2.5e-4,
        lr_base_batch=None,
        weight_decay=0.0,
        warmup_steps=2000,
        warmup_lr=0.0,
        min_lr=0.0,
        clip_grad=0.25,
    )


@dataclasses.dataclass
class LanguageModellingConfig:
    task: str = "language_model"
    model: LanguageModelConfig = dataclasses.field(default_factory=LanguageModelConfig)
    data: TextDataConfig = dataclasses.field(default_factory=TextDataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=_lm_optim)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        check(self.task == "language_model", "task", f"expected 'language_model', got {self.task!r}")
        # a vocabulary above any cutoff stands in for the corpus's
        check_model_builds(lambda: build_language_model(self.model, 10**6), self.model.args)


def build_language_model(m: LanguageModelConfig, vocab_size: int) -> nn.Module:
    """The language model a config names, for a tokenizer of ``vocab_size`` tokens."""
    return create_model(m.name, attention=m.attention, lam=m.lam, vocab_size=vocab_size, **m.args)


def load_language_model(checkpoint: str | Path) -> tuple[nn.Module, Vocabulary | SubwordTokenizer, dict]:
    """A language model trained by ``neutreno train`` (file, checkpoint or run folder), in eval mode,
    with the tokenizer its metadata records: (model, tokenizer, metadata). ValueError when they do not
    have one vocabulary size."""
    weights = resolve_weights(checkpoint)
    model, meta = load_model(weights)
    if "tokenizer" not in meta:
        raise ValueError(f"{weights} is not a language model trained by neutreno (no tokenizer recorded)")
    if not isinstance(model, TransformerLM):  # a tokenizer recorded beside another model (a hand-made file)
        raise ValueError(f"{weights} is not a language model: it holds a {type(model).__name__}")
    try:
        tokenizer = tokenizer_from_metadata(meta["tokenizer"])
    except ValueError as error:
        raise ValueError(f"{weights}: {error}") from None
    if len(tokenizer) != model.vocab_size:  # ids would mean other words: a wrong perplexity, or an IndexError
        raise ValueError(
            f"{weights}: its tokenizer has {len(tokenizer)} tokens, its model's vocabulary {model.vocab_size}"
        )
    return model, tokenizer, meta


class TokenWindows(Dataset):
    """Non-overlapping windows of a token stream (T,): item ``i`` is ``stream[i·L : i·L + L + 1]`` (L + 1,),
    the inputs and the shifted targets of ``L = context_length`` positions."""

    def __init__(self, stream: Tensor, context_length: int) -> None:
        self.stream, self.context_length = stream, context_length
        if len(self) < 1:
            raise ValueError(
                f"a stream of {stream.numel()} tokens is shorter than one window of {context_length}"
            )

    def __len__(self) -> int:
        return (self.stream.numel() - 1) // self.context_length

    def __getitem__(self, index: int) -> Tensor:
        start = index * self.context_length
        return self.stream[start : start + self.context_length + 1]


def summarize_language_model(sums: dict[str, float]) -> dict[str, float]:
    """Mean loss (nats per token) and perplexity from summed negative log-likelihoods. ValueError for no
    tokens (it gave perplexity 1, a perfect score)."""
    if sums["count"] <= 0:
        raise ValueError("no tokens were scored: perplexity is undefined")
    loss = sums["nll"] / sums["count"]
    return {"ppl": perplexity(loss), "loss": loss, "count": int(sums["count"])}  # (capped at e^700 before)


class LanguageModelTask:
    """Builds the corpus windows and the model from a :class:`LanguageModellingConfig`."""

    main_metric = "ppl"

    def __init__(self, cfg: LanguageModellingConfig) -> None:
        self.cfg = cfg
        self.tokenizer, streams = load_corpus(cfg.data.corpus, cfg.data.tokenizer)
        try:
            self.model = build_language_model(cfg.model, len(self.tokenizer))
        except CutoffsError as error:
            raise ValueError(  # a vocab_size the user never set (the config forbids it) named no setting
                f"the corpus's tokenizer has {len(self.tokenizer)} tokens: the adaptive softmax's "
                f"model.args.cutoffs must lie below it ({error})"
            ) from None
        # an untied adaptive softmax runs a tail cluster only for the batches with a target in it
        untied = self.model.embed is not None
        self.may_leave_parameters_unused = (
            isinstance(self.model.head, nn.AdaptiveLogSoftmaxWithLoss) and untied
        )
        context = self.model.context_length
        windows = {}
        for split in ("train", "valid"):
            try:
                windows[split] = TokenWindows(streams[split], context)
            except ValueError as error:  # which split, which file
                file = split_file(cfg.data.corpus, split)
                raise ValueError(f"{file}: {error} (model.args.context_length)") from None
        self.train_set, self.val_set = windows["train"], windows["valid"]
        self.num_workers = cfg.data.num_workers
        self.counters: dict[str, int] = {}

    collate = staticmethod(torch.stack)

    def training_loss(self, model: nn.Module, batch: Tensor) -> tuple[Tensor, int]:
        batch = batch.to(next(model.parameters()).device, non_blocking=True)
        nll = model(batch[:, :-1], batch[:, 1:])
        return nll.sum(), nll.numel()

    def eval_sums(self, model: nn.Module, batch: Tensor) -> dict[str, Tensor]:
        batch = batch.to(next(model.parameters()).device)
        nll = model(batch[:, :-1], batch[:, 1:])
        return {"nll": nll.sum(), "count": torch.tensor(nll.numel())}

    summarize = staticmethod(summarize_language_model)

    def weights_metadata(self) -> dict:
        """The tokenizer and the corpus, so ``neutreno eval`` and ``neutreno generate`` need nothing else."""
        return {"tokenizer": self.tokenizer.metadata(), "corpus": str(Path(self.cfg.data.corpus).resolve())}

    def load_pretrained(self, path: str) -> None:
        """Start from other weights of this model.

        Raises:
            ValueError: the weights record another tokenizer than this run's corpus gives. Row k of the
                embedding is token k's: a vocabulary of the same size that maps k to another word (a
                word-level one built from another corpus, another subword tokenizer) would load and
                train on scrambled words without a word. Weights that record none are not checked.
        """
        from neutreno.models.checkpoint import (
            load_safetensors,
            load_state_dict_checked,
            metadata_differs,
            refuse_another_model,
        )

        weights = resolve_weights(path)
        if metadata_differs(weights, {"tokenizer": self.tokenizer.metadata()}, ("tokenizer",)):
            raise ValueError(
                f"{weights} was trained with another tokenizer than this run's corpus gives, so its token "
                "ids mean other text here: fine-tune with the tokenizer it was trained with (a word-level "
                "vocabulary is built from the corpus's training file; another corpus needs a subword "
                "tokenizer, data.tokenizer, shared by both runs)"
            )
        refuse_another_model(self.model, weights)  # same shapes, another attention or head count
        fresh = load_state_dict_checked(self.model, load_safetensors(weights), weights, start_additions=True)
        if fresh:
            note(f"fine-tuning from {path}: {', '.join(fresh)} start at λ or the identity (not in it)")
