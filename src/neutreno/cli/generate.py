"""``neutreno generate CHECKPOINT --prompt …``: continue a prompt with a trained language model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from neutreno.cli.types import finite_at_least, int_at_least, probability, seed

MAX_NEW_TOKENS = 100_000  # printed at the end: a longer text is a typo or a job for the Python API


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", type=Path, help="a language model: .safetensors file, checkpoint folder or run folder"
    )
    parser.add_argument(
        "--prompt", required=True, type=prompt_text, help="text to continue (a line break is an <eos>)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int_at_least(0), default=50,
        help=f"tokens to generate (default 50, at most {MAX_NEW_TOKENS:,})",
    )  # fmt: skip
    parser.add_argument(
        "--temperature", type=finite_at_least(0.0), default=None, help="0: greedy (default: 1.0)"
    )
    parser.add_argument(
        "--top-k", type=int_at_least(1), default=None, help="sample from the k most likely tokens"
    )
    parser.add_argument(
        "--top-p",
        type=probability,
        default=None,
        help="sample from the most likely tokens whose probability reaches p (nucleus sampling)",
    )
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--device", default="auto")


def prompt_text(text: str) -> str:
    """--prompt as given: a line break alone is a prompt (an ``<eos>``, a new line), not a blank value;
    one that encodes to no token is refused once the tokenizer is known."""
    return text


def unread_prompt(prompt: str, tokenizer) -> str | None:
    """What of ``prompt`` the model reads as unknown (or not at all), said in one line; None if nothing."""
    from neutreno.data.corpus import Vocabulary

    if isinstance(tokenizer, Vocabulary):
        unknown = [word for word in prompt.split() if word not in tokenizer.ids]
        if not unknown:
            return None
        shown = ", ".join(repr(word) for word in unknown[:5]) + (", …" if len(unknown) > 5 else "")
        return (
            f"{len(unknown)} word(s) of --prompt are not in the model's vocabulary and are read as <unk>: "
            f"{shown} (a WikiText vocabulary has punctuation as words of its own: 'world .', 'film 's')"
        )
    unk = tokenizer.unknown_token()
    unknown = 0 if unk is None else tokenizer.encode_text(prompt).count(unk[1])
    dropped = tokenizer.dropped_characters(prompt)
    said = []
    if unknown:
        said.append(f"{unknown} token(s) stand for text the tokenizer does not know ({unk[0]})")
    if dropped:
        said.append(f"{dropped} character(s) have no token and are dropped")
    return f"in --prompt, {' and '.join(said)}" if said else None


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from neutreno.training.distributed import resolve_device
    from neutreno.training.language_model import load_language_model

    if not 0 <= args.max_new_tokens <= MAX_NEW_TOKENS:  # 10¹² ran silently until killed, all text lost
        raise ValueError(f"--max-new-tokens must be 0 to {MAX_NEW_TOKENS:,}, got {args.max_new_tokens}")
    sampling = [f"--{k.replace('_', '-')}" for k in ("top_k", "top_p") if getattr(args, k) is not None]
    if args.greedy and (args.temperature is not None or sampling):
        ignored = " and ".join(["--temperature"] * (args.temperature is not None) + sampling)
        raise ValueError(f"--greedy takes the most likely token: {ignored} would be ignored")
    if args.temperature == 0 and sampling:
        raise ValueError(
            f"--temperature 0 takes the most likely token: {' and '.join(sampling)} would be ignored"
        )
    model, tokenizer, _ = load_language_model(args.checkpoint)
    prompt = tokenizer.encode_text(args.prompt)
    if not prompt:
        raise ValueError(f"--prompt {args.prompt!r} has no tokens (an unset shell variable?)")
    unread = unread_prompt(args.prompt, tokenizer)
    if unread:  # the echoed prompt shows <unk>, easily read past
        print(f"warning: {unread}", file=sys.stderr)
    device = resolve_device(args.device)
    model.to(device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    ids = model.generate(
        torch.tensor([prompt], device=device),
        args.max_new_tokens,
        temperature=0.0 if args.greedy else 1.0 if args.temperature is None else args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=generator,
    )
    # The prompt as the model read it (unknown words as <unk>), then its continuation.
    print(tokenizer.decode_text(ids[0]))
    return 0
