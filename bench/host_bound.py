"""NeuTRENO's eager overhead where each operation's fixed cost sets the pace, measured on a CPU.

A GPU running a small model eagerly waits on the host: Python, the dispatcher and kernel launches,
not arithmetic (the H100 DeiT-tiny steps of ``make bench-gpu`` reach an MFU of 3–13%). Tiny models on
one CPU thread are in the same regime, so this bench tells, without a GPU, what NeuTRENO's extra
operations cost there. A stand-in for the GPU's eager ratios, not a GPU figure:

1. a training step (AdamW) of a tiny ViT (D 48, 12 layers, 3 heads, 65 tokens; batch 2): NeuTRENO /
   softmax time, with W_O as it runs (``neutreno_projection``: keeps U, V, V⁰ and rebuilds their sum in
   a backward of its own) and as a plain ``proj(U + λ(V⁰ − V))`` (keeps the sum);
2. cached greedy generation of a tiny GPT-2 (D 64, 12 layers, 4 heads; batch 1, 64 new tokens after 16):
   ``apply_neutreno`` patched / unpatched time;
3. the host's cost of one compiled decoding call of that GPT-2 (``torch.compile``, one graph, on a
   static KV cache), its graph replaced by a constant: what dynamo does around the graph on every call
   (checking its guards, rebuilding the outputs), patched / unpatched. Under CUDA graphs this is most of
   what the host adds to a compiled decoding step (bench/gpu.py's ``compiled_generate``).

Writes bench/results/host_bound.json.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import neutreno.hf
from neutreno import create_model
from neutreno.studies.efficiency import time_ratio, training_step

from timing import interleaved_times, machine, positive_int, span, with_plain_projection, write_result

LAM = 0.6


def vit_step(rounds: int, per_round: int) -> dict:
    torch.manual_seed(0)
    softmax = create_model("vit_tiny_patch4_32", attention="softmax", embed_dim=48, num_heads=3)
    neutreno = create_model("vit_tiny_patch4_32", attention="neutreno", lam=LAM, embed_dim=48, num_heads=3)
    neutreno.load_state_dict(softmax.state_dict())
    plain = copy.deepcopy(neutreno)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([1, 2])

    def loss(model, x):
        return F.cross_entropy(model(x), labels)

    steps = {
        "softmax": training_step(softmax.train(), images, loss, None),
        "neutreno": training_step(neutreno.train(), images, loss, None),
        "neutreno_plain_wo": with_plain_projection(training_step(plain.train(), images, loss, None)),
    }
    times = interleaved_times(steps, rounds, per_round)
    return {
        "model": "vit_tiny_patch4_32 at D 48, 3 heads (12 layers, 65 tokens), batch 2, AdamW",
        "step_ms": {name: t["median_s"] * 1e3 for name, t in times.items()},
        "neutreno_over_softmax": time_ratio(times, "neutreno", "softmax"),
        "plain_wo_over_softmax": time_ratio(times, "neutreno_plain_wo", "softmax"),
        "neutreno_over_plain_wo": time_ratio(times, "neutreno", "neutreno_plain_wo"),
        "round_seconds": {name: t["seconds"] for name, t in times.items()},  # the intervals' raw rounds
    }


def gpt2_generation(rounds: int, new_tokens: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=64, n_layer=12, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    plain = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa").eval()
    patched = neutreno.hf.apply_neutreno(copy.deepcopy(plain), LAM)
    prompt = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))

    greedy = {"do_sample": False, "pad_token_id": 0}

    def generate(model):
        def run() -> None:
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **greedy)

        return run

    times = interleaved_times({"unpatched": generate(plain), "patched": generate(patched)}, rounds, 1)
    return {
        "model": f"GPT-2 at D 64, 12 layers, 4 heads; batch 1, {new_tokens} new tokens after 16",
        "seconds": {name: t["median_s"] for name, t in times.items()},
        "patched_over_unpatched": time_ratio(times, "patched", "unpatched"),
        "round_seconds": {name: t["seconds"] for name, t in times.items()},  # the intervals' raw rounds
    }


def compiled_call_overhead(rounds: int, per_round: int, layers: int = 12) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, StaticCache

    config = GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    plain = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa").eval()
    models = {"unpatched": plain, "patched": neutreno.hf.apply_neutreno(copy.deepcopy(plain), LAM)}

    def constant_graph(graph, example_inputs):  # a backend whose compiled graph costs nothing to run
        outputs = graph(*example_inputs)
        return lambda *inputs: outputs

    calls = {}
    for name, model in models.items():
        forward = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=constant_graph)
        cache = StaticCache(config=config, max_cache_len=32)
        step = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "past_key_values": cache, "use_cache": True}
        with torch.no_grad():  # the prompt's call, then the decoding call compiled once
            forward(input_ids=torch.zeros(1, 4, dtype=torch.long), past_key_values=cache, use_cache=True)
            forward(**step)

        def call(forward=forward, step=step) -> None:
            with torch.no_grad():
                forward(**step)

        calls[name] = call
    times = interleaved_times(calls, rounds, per_round)
    return {
        "model": f"GPT-2 at D 64, {layers} layers, 4 heads; a decoding call, static cache, compiled as "
        "one graph",
        "call_us": {name: t["median_s"] * 1e6 for name, t in times.items()},
        "patched_over_unpatched": time_ratio(times, "patched", "unpatched"),
        "round_seconds": {name: t["seconds"] for name, t in times.items()},  # the intervals' raw rounds
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=80)
    parser.add_argument("--quick", action="store_true", help="a few rounds, for a test")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    torch.set_num_threads(1)  # one thread: each operation's fixed cost, not its arithmetic, sets the pace
    result = {"machine": machine(), "lam": LAM, "rounds": rounds}  # (machine() records the one thread)
    print("[vit] training steps: softmax, NeuTRENO, NeuTRENO with a plain W_O...", flush=True)
    result["vit_training"] = vit_step(rounds, 2 if args.quick else 3)
    print("[gpt2] cached generation: unpatched, patched...", flush=True)
    result["gpt2_generation"] = gpt2_generation(rounds, 4 if args.quick else 64)
    print("[compiled] a compiled decoding call's host cost: unpatched, patched...", flush=True)
    quick_layers = 2 if args.quick else 12  # --quick: a sixth of the compile time
    result["compiled_call"] = compiled_call_overhead(rounds, 5 if args.quick else 100, quick_layers)
    vit, gen = result["vit_training"], result["gpt2_generation"]
    print(f"tiny ViT training step, NeuTRENO / softmax: {span(vit['neutreno_over_softmax'])} (plain W_O "
          f"{span(vit['plain_wo_over_softmax'])}); tiny GPT-2 cached generation, patched / unpatched: "
          f"{span(gen['patched_over_unpatched'])}; compiled decoding call's host cost, patched / unpatched: "
          f"{span(result['compiled_call']['patched_over_unpatched'])}")  # fmt: skip
    if not args.quick:
        print(f"wrote {write_result('host_bound', result)}")


if __name__ == "__main__":
    main()
