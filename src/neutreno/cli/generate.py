"""``neutreno generate CHECKPOINT --prompt …``: continue a prompt with a trained language model."""

from __future__ import annotations

import argparse
from pathlib import Path

from neutreno.cli.types import finite_at_least, int_at_least, probability, seed


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", type=Path, help="a language model: .safetensors file, checkpoint folder or run folder"
    )
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int_at_least(0), default=50)
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


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from neutreno.training.distributed import resolve_device
    from neutreno.training.language_model import load_language_model

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
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
        raise ValueError("--prompt has no tokens")
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
