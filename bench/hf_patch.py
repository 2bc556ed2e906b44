"""What ``neutreno.hf.apply_neutreno`` costs a Hugging Face model, each pair measured side by side in
one interleaved run (random weights from a config: the cost does not depend on them):

1. a training step (AdamW), fp32 and bf16 autocast: a BERT-base-shaped encoder (D 768, 12 layers,
   12 heads; batch 4 × 128 tokens) and a Llama-style decoder with grouped-query attention (D 512,
   8 layers, 8 query / 2 key-value heads; batch 4 × 256, next-token loss); patched / unpatched time,
   and the bytes autograd keeps for backward, patched / unpatched;
2. cached greedy generation with a GPT-2-small-shaped model (D 768, 12 layers), batch 1 and 8,
   64 new tokens after 16: patched / unpatched time.

Writes bench/results/hf_patch.json.
"""

from __future__ import annotations

import argparse
import copy

import torch

import neutreno.hf
from neutreno.allocator import keep_freed_memory
from neutreno.studies.efficiency import time_ratio, training_memory, training_step

from timing import interleaved_times, machine, positive_int, write_result


def bert_base():
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    return BertModel._from_config(config, attn_implementation="sdpa", add_pooling_layer=False)


def llama_style():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel._from_config(GPT2Config(), attn_implementation="sdpa").eval()


def loss_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "lm_head"):  # next-token loss
        return model(input_ids=input_ids, labels=input_ids).loss
    hidden = model(input_ids=input_ids).last_hidden_state
    return hidden.float().square().mean()


def make_generate(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int):
    def generate() -> None:
        with torch.no_grad():
            model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        if prompt.device.type == "cuda":
            torch.cuda.synchronize(prompt.device)

    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=positive_int, default=6)
    parser.add_argument("--per-round", type=positive_int, default=2)
    args = parser.parse_args()
    allocator = keep_freed_memory()  # as the `neutreno` program runs: page faults are not the subject
    torch.manual_seed(0)
    result = {"machine": machine(), "allocator_keeps_freed_memory": allocator, "lam": 0.6, "train": {}}
    for name, build, shape in (("bert_base", bert_base, (4, 128)), ("llama_style", llama_style, (4, 256))):
        plain = build()
        patched = neutreno.hf.apply_neutreno(copy.deepcopy(plain), lam=0.6)
        vocab = plain.config.vocab_size
        input_ids = torch.randint(0, vocab, shape)
        result["train"][name] = {"batch_tokens": list(shape)}
        models = {"unpatched": plain, "patched": patched}
        for dtype_name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            print(f"[{name} {dtype_name}] timing unpatched, patched ({args.rounds} rounds)...", flush=True)
            steps = {n: training_step(m.train(), input_ids, loss_of, dtype) for n, m in models.items()}
            times = interleaved_times(steps, args.rounds, args.per_round)
            memory = {n: training_memory(m, input_ids, loss_of, dtype) for n, m in models.items()}
            entry = {
                "step_seconds": times,
                "patched_over_unpatched_time": times["patched"]["median_s"] / times["unpatched"]["median_s"],
                "patched_over_unpatched_interval": time_ratio(times, "patched", "unpatched"),
                "saved_bytes": memory,
                "patched_over_unpatched_saved_bytes": memory["patched"] / memory["unpatched"],
            }
            result["train"][name][dtype_name] = entry
            print(
                f"[{name} {dtype_name}] step {times['unpatched']['median_s']:.3f}s → "
                f"{times['patched']['median_s']:.3f}s = {entry['patched_over_unpatched_time']:.3f}; "
                f"saved bytes ×{entry['patched_over_unpatched_saved_bytes']:.3f}",
                flush=True,
            )
    plain = gpt2_small()
    patched = neutreno.hf.apply_neutreno(copy.deepcopy(plain), lam=0.6).eval()
    result["generate"] = {"model": "GPT-2 small shape", "prompt": 16, "new_tokens": 64}
    for batch in (1, 8):
        prompt = torch.randint(0, plain.config.vocab_size, (batch, 16))
        print(f"[generate batch {batch}] timing unpatched, patched...", flush=True)
        calls = {n: make_generate(m, prompt, 64) for n, m in (("unpatched", plain), ("patched", patched))}
        times = interleaved_times(calls, args.rounds, 1, warmup=1)  # medians of fewer were ±2%
        ratio = times["patched"]["median_s"] / times["unpatched"]["median_s"]
        result["generate"][f"batch_{batch}"] = {
            "seconds": times,
            "patched_over_unpatched_time": ratio,
            "patched_over_unpatched_interval": time_ratio(times, "patched", "unpatched"),
        }
        print(f"[generate batch {batch}] {times['unpatched']['median_s']:.2f}s → "
              f"{times['patched']['median_s']:.2f}s = {ratio:.3f}", flush=True)  # fmt: skip
    print(f"wrote {write_result('hf_patch', result)}")


if __name__ == "__main__":
    main()
