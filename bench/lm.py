"""Language-model throughput (issue 5), measured side by side in one run:

1. training tokens/s of ``lm_wt103`` (the paper's model: 16 post-norm layers, D 128, 8 heads, FFN 2048,
   tied adaptive softmax over 267,735 words) against Hugging Face ``GPT2LMHeadModel`` of the same
   depth/width/heads/FFN with a full softmax (its fastest attention implementation); also ours with a
   full softmax, so the architecture alone is compared; NeuTRENO / softmax time;
2. the full-softmax head alone (batch × 256 tokens, D 128, 267,735 words): forward and backward of
   ``F.cross_entropy`` on the whole logits against ``linear_cross_entropy``, which the model's
   full-softmax head uses, a vocabulary block at a time; time and the bytes kept for backward;
3. sliding-window evaluation throughput (tokens scored per second) at stride 1 vs 256, on real
   WikiText-103 validation text when ``../shared/data`` is there.

Writes bench/results/lm.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from neutreno import create_model
from neutreno.allocator import keep_freed_memory
from neutreno.evaluation.language_model import sliding_window_nll
from neutreno.io import write_json
from neutreno.layers import linear_cross_entropy
from neutreno.models.language_model import WT103_VOCAB_SIZE
from neutreno.studies.efficiency import ZIPF_EXPONENT, time_ratio, training_step, zipf_token_ids

from timing import RESULTS, interleaved_times, machine, positive_int, provenance, write_result

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext103-mini"


class _GPT2Loss(torch.nn.Module):
    """GPT-2 with our ``forward(idx, targets) -> per-token NLL`` interface (full softmax)."""

    def __init__(self, attn_implementation: str) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=WT103_VOCAB_SIZE, n_positions=256, n_embd=128, n_layer=16, n_head=8, n_inner=2048,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel._from_config(config, attn_implementation=attn_implementation)

    def forward(self, idx, targets):
        logits = self.model(input_ids=idx).logits.float()  # (B, T, V), rows contiguous as ours
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return nll.view(targets.shape)


def _head(targets: torch.Tensor, dtype: torch.dtype | None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The full-softmax head's two training steps (plain and blockwise) on batch × 256 tokens, and their
    hidden states and weight."""
    torch.manual_seed(0)
    hidden = torch.randn(targets.numel(), 128, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(WT103_VOCAB_SIZE, 128) * 128**-0.5)
    targets = targets.flatten()
    losses = {
        "plain": lambda: F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none"),
        "blockwise": lambda: linear_cross_entropy(hidden, weight, targets),
    }

    def step(loss_fn):
        def run() -> None:
            hidden.grad = weight.grad = None
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = loss_fn().mean()
            loss.backward()

        return run

    return {name: step(loss_fn) for name, loss_fn in losses.items()}, hidden, weight


def head_saved_bytes(targets: torch.Tensor, dtype: torch.dtype | None) -> dict[str, int]:
    """Bytes each head path keeps for backward: each storage once (log_softmax and nll_loss save the same
    output), the hidden states and the weight left out (they exist anyway; what autocast casts from them
    counts). A property of the autograd graph, the same on every CPU."""
    steps, hidden, weight = _head(targets, dtype)
    own = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}
    saved = {}
    for name, step in steps.items():
        storages = {}

        def pack(t: torch.Tensor, storages=storages) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in own:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
        saved[name] = sum(storages.values())
    return saved


def full_softmax_head(targets: torch.Tensor, dtype: torch.dtype | None, rounds: int) -> dict:
    """The full-softmax loss and its backward alone, plain against blockwise, interleaved."""
    steps, _, _ = _head(targets, dtype)
    times = interleaved_times(steps, rounds=rounds, per_round=1)
    saved = head_saved_bytes(targets, dtype)
    return {
        "tokens": targets.numel(),
        "seconds": times,
        "plain_over_blockwise_time": times["plain"]["median_s"] / times["blockwise"]["median_s"],
        "plain_over_blockwise_interval": time_ratio(times, "plain", "blockwise"),
        "saved_bytes": saved,
        "plain_over_blockwise_saved_bytes": saved["plain"] / saved["blockwise"],
    }


def text_stream(tokens: int, vocab_size: int = WT103_VOCAB_SIZE) -> torch.Tensor:
    """Real WikiText-103 validation ids (vocabulary of the mini training set, 34,147 words) or, without
    ../shared, random ids below ``vocab_size`` of a Zipf law (``zipf_token_ids``: 5.4% past lm_wt103's
    20,000-word head, against 2.4% of the real text's, so the tail clusters cost somewhat more);
    :func:`text_source` says which."""
    if SHARED.is_dir():
        from neutreno.data.corpus import load_wikitext

        ids = load_wikitext(SHARED)[1]["valid"][:tokens]
        if int(ids.max()) >= vocab_size:
            raise ValueError(f"WikiText's ids reach {int(ids.max())}, beyond a vocabulary of {vocab_size}")
        return ids
    return zipf_token_ids(vocab_size, tokens, torch.Generator().manual_seed(0))


def text_source() -> str:
    """Where :func:`text_stream`'s ids come from, for a result file."""
    if SHARED.is_dir():
        return "WikiText-103 text (bench/lm.py's text_stream)"
    where = "bench/lm.py's text_stream; ../shared is absent"
    return f"Zipf-distributed random ids, exponent {ZIPF_EXPONENT} ({where})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument(
        "--eval-tokens", type=positive_int, default=1024, help="tokens scored per stride setting"
    )
    parser.add_argument(
        "--recount-head-memory",
        action="store_true",
        help="only count the head's bytes kept for backward again, into the existing lm.json",
    )
    args = parser.parse_args()
    if args.recount_head_memory:
        return recount_head_memory()
    allocator = keep_freed_memory()  # as the `neutreno` program runs (bench/allocator.py measures it)
    torch.manual_seed(0)
    stream = text_stream(args.batch * 257 + args.eval_tokens * 2)
    batch = stream[: args.batch * 257].view(args.batch, 257)
    idx, targets = batch[:, :-1], batch[:, 1:]
    tokens = idx.numel()

    results = {"machine": machine(), "allocator_keeps_freed_memory": allocator, "batch": args.batch}
    results.update({"context": 256, "real_text": SHARED.is_dir()})
    for precision, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        models = {
            "lm_wt103 softmax": create_model("lm_wt103"),
            "lm_wt103 neutreno": create_model("lm_wt103", attention="neutreno"),
            "lm_wt103 full-softmax head": create_model("lm_wt103", adaptive_softmax=False),
            "hf GPT2LMHeadModel (sdpa)": _GPT2Loss("sdpa"),
        }

        def loss(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
            return model(idx, targets).mean()

        steps = {name: training_step(model.train(), idx, loss, dtype) for name, model in models.items()}
        times = interleaved_times(steps, rounds=args.rounds, per_round=1)
        for t in times.values():
            t["tokens_per_s"] = tokens / t["median_s"]
        ours, hf = times["lm_wt103 softmax"]["median_s"], times["hf GPT2LMHeadModel (sdpa)"]["median_s"]
        results[precision] = {
            "times": times,
            "speedup_vs_hf_gpt2": hf / ours,
            "speedup_vs_hf_gpt2_interval": time_ratio(times, "hf GPT2LMHeadModel (sdpa)", "lm_wt103 softmax"),
            "speedup_vs_hf_gpt2_same_full_softmax": hf / times["lm_wt103 full-softmax head"]["median_s"],
            "neutreno_over_softmax_time": times["lm_wt103 neutreno"]["median_s"] / ours,
            "neutreno_over_softmax_interval": time_ratio(times, "lm_wt103 neutreno", "lm_wt103 softmax"),
            "speedup_vs_hf_gpt2_same_full_softmax_interval": time_ratio(
                times, "hf GPT2LMHeadModel (sdpa)", "lm_wt103 full-softmax head"
            ),
        }
        print(precision, {k: v for k, v in results[precision].items() if k != "times"}, flush=True)
        print({n: round(t["tokens_per_s"]) for n, t in times.items()}, flush=True)
        del models, steps
        head = full_softmax_head(targets, dtype, args.rounds)
        results[precision]["full_softmax_head"] = head
        kept = " / ".join(f"{b / 2**30:.2f}" for b in head["saved_bytes"].values())
        print(
            f"{precision} full-softmax head alone: plain / blockwise time "
            f"{head['plain_over_blockwise_time']:.2f}, GiB kept for backward {kept}",
            flush=True,
        )

    model = create_model("lm_wt103").eval()
    evaluation = {}
    for stride in (1, 256):
        window_stream = (
            stream[-(args.eval_tokens + 257) :] if stride == 1 else stream[-args.eval_tokens * 2 :]
        )
        sliding_window_nll(
            model, window_stream[:300], stride=stride, batch_size=32, progress=False
        )  # warm-up
        start = time.perf_counter()
        _, scored = sliding_window_nll(model, window_stream, stride=stride, batch_size=32, progress=False)
        seconds = time.perf_counter() - start
        evaluation[f"stride_{stride}"] = {
            "tokens_scored": scored,
            "seconds": seconds,
            "tokens_per_s": scored / seconds,
        }
    evaluation["stride_256_over_stride_1"] = (
        evaluation["stride_256"]["tokens_per_s"] / evaluation["stride_1"]["tokens_per_s"]
    )
    results["sliding_window_eval"] = evaluation
    print(
        {k: (round(v["tokens_per_s"]) if isinstance(v, dict) else round(v, 1)) for k, v in evaluation.items()}
    )
    print(write_result("lm", results))


def recount_head_memory() -> None:
    """The head's bytes kept for backward counted again into bench/results/lm.json, its timings left as
    they were: the count is the autograd graph's, the same on every CPU (it once counted the
    log-probabilities twice, and the weight). The file records when and where."""
    path = RESULTS / "lm.json"
    results = json.loads(path.read_text())
    targets = text_stream(results["batch"] * 257)[: results["batch"] * 257].view(results["batch"], 257)[:, 1:]
    for precision, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        head = results[precision]["full_softmax_head"]
        head["saved_bytes"] = head_saved_bytes(targets, dtype)
        head["plain_over_blockwise_saved_bytes"] = (
            head["saved_bytes"]["plain"] / head["saved_bytes"]["blockwise"]
        )
        print(
            precision,
            "GiB kept for backward",
            {k: round(v / 2**30, 3) for k, v in head["saved_bytes"].items()},
        )
    # the timings keep the command and commit that measured them; the recount's own are recorded here
    recount = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), **provenance()}
    results["head_memory_recounted"] = recount
    write_json(path, results)
    print(path)


if __name__ == "__main__":
    main()
