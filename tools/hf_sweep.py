"""`apply_neutreno` and `HFProbe` over transformers' architectures: every base-model type (``AutoModel``)
built from a tiny random config with its default attention implementation, each in its own process
(the one generic tiny config first; where it does not build or run, the same keys on every sub-config and
head counts, widths and layer counts recognised by name, see ``build``; ``HF_SWEEP_ALL=1`` lists every
attempt's failure for a type left unbuilt).

``--check patch``: each model must be refused with a ValueError, or give its plain outputs bit for bit at
λ = 0, other outputs at λ = 0.6, and those equal to NeuTRENO written at the attention interface over the
model's own eager kernel (λ(V⁰ − V) added head by head, V⁰ the values of the first self-attention call
of the same layer stack in the forward; cross-attention left plain).
``--check probe``: each model must be refused with a ValueError, or, as an encoder, give q and k whose
softmax(q kᵀ/√d) over the real keys is its own maps (or withhold them, saying why); as a causal model,
lower-triangular maps with values split into their heads.

``--check static``: each causal language model (``AutoModelForCausalLM`` types) must be refused with a
ValueError (by apply_neutreno, or its static KV cache), or give, patched, the same greedy-generation
logits on a static cache (``cache_implementation="static"``) as on the dynamic one, a left-padded row
included; a type whose unpatched model does not give them alike (or fails) is not judged.

Types that do not build or run from any of the tiny configs are counted, not judged; so are those too big
for the check's copies of the model under the worker's 6 GiB address-space cap ("unjudged"). Prints a
count per outcome and writes one JSON line per type; exits 1 when a type was accepted and then gave a
wrong result ("mismatch") or failed with another error than a ValueError ("crash").

    python tools/hf_sweep.py --check patch --jobs 2          # all types, some minutes
    python tools/hf_sweep.py --check probe --types bert,gpt2,convbert
    python tools/hf_sweep.py --check static --types gpt2,llama,mistral
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, n_positions=64, attention_dropout=0.0,
    hidden_dropout=0.0, dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, moe_intermediate_size=16, num_experts=4,
    num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, layer_types=None,
    image_size=32, patch_size=8, num_channels=3, embed_dim=32, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)  # fmt: skip
LAM = 0.6
FAILED = ("mismatch", "crash")  # accepted, then wrong
BUILT = "built"  # the worker's line once the model runs: a crash or hang after it is a failure


def model_types(check: str) -> dict:
    """{model type: class name(s)} the check covers: base models, or causal language models."""
    from transformers.models.auto import modeling_auto

    return (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if check == "static"
        else modeling_auto.MODEL_MAPPING_NAMES
    )


def build(model_type: str, check: str = "patch"):
    """The tiny model (eval mode) and its inputs: token ids with a padded row, images, audio or features,
    and decoder token ids where the forward takes them. The generic tiny config first (as ever); where that
    does not build or run, the same keys on every sub-config too, head counts, widths, layer counts and
    rotary dims recognised by their names, then a few inputs the forward may need, each tried in turn."""
    import torch
    import transformers

    name = model_types(check)[model_type]
    name = name[0] if isinstance(name, (list, tuple)) else name
    tiny = TINY if check != "static" else {k: v for k, v in TINY.items() if k != "layer_types"}  # a cache's
    failures = []
    for level in range(4):
        try:
            config = tiny_config(model_type, tiny, level)
            with torch.device("meta"):  # its size first, without allocating it
                size = sum(p.numel() for p in getattr(transformers, name)._from_config(config).parameters())
            if size > MAX_PARAMETERS and level < 3:
                failures.append(f"config {level}: {size} parameters, not tiny")
                continue
            torch.manual_seed(0)
            model = getattr(transformers, name)._from_config(config).eval()
        except Exception as error:
            failures.append(f"config {level}: {type(error).__name__}: {error}")
            continue
        for inputs in candidate_inputs(model, config, level):
            try:
                first_output(model, inputs)
            except Exception as error:
                failures.append(f"config {level}, inputs {sorted(inputs)}: {type(error).__name__}: {error}")
                continue
            return model, inputs
    raise RuntimeError(
        " | ".join(f[:200] for f in failures[-3:])
        if os.environ.get("HF_SWEEP_ALL") is None
        else "\n".join(failures)
    )


MAX_PARAMETERS = 20_000_000  # a config that stays large (a default sub-config): not tiny, try the next

# keys recognised by their names in every (sub-)config, from level 1 on: (pattern, value)
NAMED = [
    (r"(num_)?(key_value|kv)_heads|num_kv_heads|n_kv_heads|multi_query_group_num", 2),
    (r"(.*_)?(attention_heads|heads|n_head|num_head)", 4),
    (
        r"d_model|hidden_size|n_embd|n_embed|embed_dim|embedding_size|hidden_dim|d_embed|model_dim|dim|"
        r"word_embed_proj_dim|text_embed_dim|vision_embed_dim|projection_dim|emb_dim|encoder_hidden_size|"
        r"vision_hidden_size|text_hidden_size|audio_hidden_size|projection_size|d_kv_model",
        32,
    ),
    (r"(.*_)?(intermediate_size|ffn_dim|d_ff|n_inner|mlp_dim|d_inner|feed_forward_size|ffn_hidden_size)", 64),
    (
        r"(num_)?(hidden_)?layers|n_layers?|(encoder|decoder|text|vision|audio)_layers|num_(encoder|decoder)_layers|"
        r"depth|num_blocks",
        3,
    ),
    (r"rotary_dim|partial_rotary_dim", 4),
    (r"head_dim|attention_head_dim|d_kv|kv_channels|d_head", 8),
    (r"(.*_)?vocab_size", 96),
    (r"max_source_positions", 32),
]


def tiny_config(model_type: str, tiny: dict, level: int):
    """Level 0: the one tiny config (TINY on the top config only). 1: TINY's keys the sub-configs have, and
    NAMED's keys in them. 2: NAMED's keys on the top config too. 3: as 2, without layer_types or head_dim."""
    import re

    import transformers

    if not level:
        return transformers.AutoConfig.for_model(model_type, **tiny)
    named = [(re.compile(pattern + "$"), value) for pattern, value in NAMED]
    if level < 2:
        config = transformers.AutoConfig.for_model(model_type, **tiny)
    else:  # the top config's own keys, at construction (a config may validate them there)
        top = {}
        default = transformers.AutoConfig.for_model(model_type)
        for key, value in vars(default).items():
            if (
                isinstance(value, int)
                and not isinstance(value, bool)
                and not key.startswith("_")
                and key not in tiny
            ):
                for pattern, small in named:
                    if pattern.match(key):
                        top[key] = min(value, small) if value > 0 else value
                        break
        if getattr(default, "attention_types", None):  # GPT-Neo: [[kinds, repeats]] counts the layers
            top.update(attention_types=[[["global", "local"], 1], [["global"], 1]])  # 3 layers
        if "rotary_dim" in vars(default):
            top["rotary_dim"] = 4
        if level >= 3:
            top.update({k: None for k in ("layer_types",) if k in vars(default)})
        config = transformers.AutoConfig.for_model(model_type, **{**tiny, **top})
    seen = set()

    def shrink(c, top: bool):
        if id(c) in seen:
            return
        seen.add(id(c))
        for key, value in list(vars(c).items()):
            if isinstance(value, transformers.PretrainedConfig):
                shrink(value, False)
            elif (
                isinstance(value, (list, tuple))
                and value
                and all(isinstance(v, transformers.PretrainedConfig) for v in value)
            ):
                for v in value:
                    shrink(v, False)
            elif key.startswith("_") or isinstance(value, bool):
                continue
            elif not top and key in tiny and (value is None or type(value) is type(tiny[key])):
                setattr(c, key, tiny[key])
            elif not top and isinstance(value, int):
                for pattern, small in named:
                    if pattern.match(key):
                        setattr(c, key, min(value, small) if value > 0 else value)
                        break
        for key in ("layer_types", "attention_types"):  # lists that count the layers
            if level >= 3 and isinstance(getattr(c, key, None), list):
                setattr(c, key, None)
        if level >= 3 and hasattr(c, "head_dim") and hasattr(c, "hidden_size"):
            c.head_dim = c.hidden_size // max(getattr(c, "num_attention_heads", 4) or 4, 1)
        pad = getattr(c, "pad_token_id", None)
        if isinstance(pad, int) and pad >= (getattr(c, "vocab_size", None) or 10**9):
            c.pad_token_id = 0

    shrink(config, True)
    return config


def candidate_inputs(model, config, level: int):
    """The inputs to try, in turn: the original ones (level 0), then what the forward's signature asks for."""
    import inspect

    import torch

    generator = torch.Generator().manual_seed(0)
    main = model.main_input_name
    params = inspect.signature(model.forward).parameters
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]  # fmt: skip

    def sub(*keys):  # a value of the config or of its sub-configs
        stack = [config]
        while stack:
            c = stack.pop(0)
            for key in keys:
                if isinstance(getattr(c, key, None), int):
                    return getattr(c, key)
            stack += [v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
        return None

    ids = torch.randint(3, 90, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    text = {"input_ids": ids, "attention_mask": mask} if "attention_mask" in params else {"input_ids": ids}
    size = sub("image_size")
    size = size if isinstance(size, int) else 32
    images = torch.randn(2, sub("num_channels") or 3, size, size, generator=generator)
    audio = torch.randn(2, 4000, generator=generator)
    decoder = {"decoder_input_ids": torch.randint(3, 90, (2, 5), generator=generator)}
    mels = sub("num_mel_bins", "feature_size", "input_feat_per_channel", "n_mels") or 80
    frames = 2 * (sub("max_source_positions") or 32)
    features = [
        torch.randn(2, mels, frames, generator=generator),
        torch.randn(2, frames, mels, generator=generator),
    ]
    mains = {"input_ids": [text], "pixel_values": [{"pixel_values": images}],
             "input_values": [{"input_values": audio}],
             "input_features": [{"input_features": f} for f in features]}.get(main, [])  # fmt: skip
    if level == 0 and main in ("input_ids", "pixel_values", "input_values"):
        if "decoder_input_ids" in params:  # shorter than the encoder's: a cross-attention tells itself apart
            yield {**mains[0], **decoder}
        yield mains[0]
        return
    extras = [{}]
    if "decoder_input_ids" in params:
        extras = [decoder, {}]
    for first in mains:
        for extra in extras:
            inputs = {**first, **extra}
            if "pixel_values" in params and "input_ids" in inputs and "pixel_values" not in inputs:
                yield {**inputs, "pixel_values": images}  # two towers (CLIP): both inputs
            if "input_ids" in params and "input_ids" not in inputs:
                yield {**inputs, **text}  # (input_ids and pixel_values to a CLIP-like main input)
            if all(r in inputs for r in required):
                yield inputs


def first_output(model, inputs):
    import torch

    torch.manual_seed(0)  # the same draws in every call (ViT-MAE masks patches at random)
    with torch.no_grad():
        out = model(**inputs)
    for key in ("last_hidden_state", "logits"):
        if isinstance(getattr(out, key, None), torch.Tensor):
            return getattr(out, key)
    return out[0]


def interface_reference(model, inputs, lam: float):
    """The model's first output with NeuTRENO written at its attention interface, not by neutreno.hf:
    each call runs the model's own eager attention, then adds λ(V⁰ − V) head by head. Each layer stack
    (the outermost list of layers, a ModuleList, around the attention module) has its own V⁰: the values of
    its first self-attention call in the forward (SPEC §2). A call whose keys are not its queries' sequence
    (a cross-attention: another length than the queries', or a module declaring is_cross_attention) runs
    plain and gives no V⁰; so does an attention outside any list of layers."""
    import transformers
    from torch import nn
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    model = copy.deepcopy(model)
    stack_of = {}  # id(module) -> id of the outermost ModuleList of layers holding it (T5's blocks, not
    for holder in model.modules():  # the list of sublayers inside each block; ALBERT's list of one group)
        if isinstance(holder, nn.ModuleList):
            for layer in holder:
                for module in layer.modules():
                    stack_of.setdefault(id(module), id(holder))
    first = {}

    def attention(module, query, key, value, *args, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        out, weights = eager(module, query, key, value, *args, **kwargs)  # (B, N, H, d)
        cross = getattr(module, "is_cross_attention", False) is True or key.shape[-2] != query.shape[-2]
        stack = stack_of.get(id(module))
        if cross or stack is None:
            return out, weights
        v = value[:, :, value.shape[-2] - query.shape[-2] :]
        if stack not in first:
            first[stack] = v
            return out, weights
        out, heads, kv_heads = out.clone(), query.shape[1], v.shape[1]
        for h in range(heads):
            g = h * kv_heads // heads  # the value head query head h reads
            out[:, :, h] += lam * (first[stack][:, g] - v[:, g])
        return out, weights

    transformers.AttentionInterface.register("hf_sweep_reference", attention)
    AttentionMaskInterface.register("hf_sweep_reference", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation("hf_sweep_reference")
    return first_output(model, inputs)


def check_patch(model, inputs) -> tuple[str, str]:
    from neutreno.hf import apply_neutreno

    plain = first_output(model, inputs)
    try:
        patched = copy.deepcopy(model)
    except (MemoryError, RuntimeError) as error:  # over the worker's address-space cap, before any patch
        if not isinstance(error, MemoryError) and "allocate memory" not in str(error):
            raise
        return "unjudged", f"no memory for a copy of the model (the worker's 6 GiB cap): {error}"[:300]
    try:
        apply_neutreno(patched, LAM)
    except ValueError as error:
        return "refused", str(error)
    try:
        out = first_output(patched, inputs)
        zero = first_output(apply_neutreno(copy.deepcopy(model), 0.0), inputs)
    except Exception as error:  # accepted, then failed
        return "crash", f"{type(error).__name__}: {error}"
    if not zero.equal(plain):
        return "mismatch", "λ = 0 does not give the plain outputs"
    changed = (out - plain).abs().max().item()
    if not changed > 1e-5:
        return "mismatch", f"λ = {LAM} changes the outputs by {changed:.2g} only"
    try:
        reference = interface_reference(model, inputs, LAM)
    except Exception as error:  # no eager kernel of its own to write the reference over
        return "unreferenced", f"patched, λ = 0 exact; no reference: {type(error).__name__}: {error}"
    if not reference.isfinite().all():  # judged only where the model's own eager kernel is finite
        eager = copy.deepcopy(model)
        eager.set_attn_implementation("eager")
        if not first_output(eager, inputs).isfinite().all():
            return (
                "unreferenced",
                "patched, λ = 0 exact; no reference: the model's own eager output is not finite",
            )
    error = (out - reference).abs().max().item()
    verdict = "ok" if error <= 1e-4 else "mismatch"
    return verdict, f"max |patched − reference| {error:.2g}, changed by {changed:.2g}"


def check_static(model, inputs) -> tuple[str, str]:
    import torch

    from neutreno.hf import apply_neutreno

    prompt, mask = inputs["input_ids"][:, :5], torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row

    def generate(m, **settings):
        with torch.no_grad():
            out = m.generate(
                prompt, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                pad_token_id=0, output_logits=True, return_dict_in_generate=True, **settings,
            )  # fmt: skip
        return torch.stack(out.logits, 1)

    def relative(a, b) -> float:
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-9)).item()

    try:
        plain = generate(model)
        control = relative(generate(model, cache_implementation="static"), plain)
    except Exception as error:
        return "unbuilt", f"unpatched static generation fails: {type(error).__name__}: {error}"[:300]
    if control > 1e-4:
        return "unbuilt", f"unpatched static and dynamic caches differ by {control:.2g}"
    patched = copy.deepcopy(model)
    try:
        apply_neutreno(patched, LAM)
        dynamic = generate(patched)
        static = generate(patched, cache_implementation="static")
    except ValueError as error:
        return "refused", str(error)[:300]
    except Exception as error:  # accepted, then failed
        return "crash", f"{type(error).__name__}: {error}"[:300]
    error = relative(static, dynamic)
    verdict = "ok" if error <= 1e-4 else "mismatch"
    moved = (dynamic - plain).abs().max().item()
    return verdict, f"static against dynamic {error:.2g}, the term moves the logits by {moved:.2g}"


def check_probe(model, inputs) -> tuple[str, str]:
    import torch

    from neutreno.diagnostics import HFProbe

    try:
        layers = HFProbe(model, attention=True)(inputs)
    except ValueError as error:
        return "refused", str(error)
    except Exception as error:
        return "crash", f"{type(error).__name__}: {error}"
    if layers.causal:
        bad = [
            i
            for i, (attn, v) in enumerate(zip(layers.attn, layers.v, strict=True))
            if attn.shape[:3] != v.shape[:3] or not attn.equal(attn.tril())
        ]
        return ("mismatch", f"layers {bad}: maps not causal or values not in their heads") if bad else (
            "ok", f"causal, {len(layers.attn)} layers")  # fmt: skip
    if layers.qk_unexplained is not None:
        return "ok", f"q, k withheld: {layers.qk_unexplained}"
    worst = 0.0
    mask = torch.ones(layers.attn[0].shape[-1], dtype=torch.bool) if layers.mask is None else layers.mask
    real = mask[..., None, :, None] & mask[..., None, None, :]
    for attn, q, k in zip(layers.attn, layers.q, layers.k, strict=True):
        scores = q.double() @ k.double().transpose(-2, -1) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~mask[..., None, None, :], float("-inf"))  # padded keys: no weight
        gap = torch.where(real, scores.softmax(-1).float() - attn.float(), 0.0)  # padded queries: junk rows
        worst = max(worst, gap.abs().max().item())
    verdict = "ok" if worst <= 1e-4 else "mismatch"
    return verdict, f"encoder, max |softmax(q kᵀ/√d) − maps| {worst:.2g} over {len(layers.attn)} layers"


def worker(model_type: str, check: str) -> dict:
    import resource
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))  # a config that asks for GBs fails
    try:
        model, inputs = build(model_type, check)
        first_output(model, inputs)
    except Exception as error:
        return {"type": model_type, "outcome": "unbuilt", "detail": f"{type(error).__name__}: {error}"[:300]}
    print(BUILT, flush=True)  # from here on a crash or a hang is the check's failure, not "unbuilt"
    impl = model.config._attn_implementation  # before the probe switches it to eager
    checks = {"patch": check_patch, "probe": check_probe, "static": check_static}
    outcome, detail = checks[check](model, inputs)
    return {"type": model_type, "impl": impl, "outcome": outcome, "detail": detail}


def run_one(model_type: str, check: str, timeout: int) -> dict:
    command = [sys.executable, __file__, "--worker", model_type, "--check", check]
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # jobs run side by side
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as expired:
        built = BUILT in (expired.stdout or b"").decode(errors="replace")
        return {"type": model_type, "outcome": "crash" if built else "unbuilt", "detail": f"over {timeout} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines or lines[-1] == BUILT:  # killed (memory), or a crash
        detail = (done.stderr.strip() or "no output")[-300:]
        return {"type": model_type, "outcome": "crash" if BUILT in lines else "unbuilt", "detail": detail}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", choices=("patch", "probe", "static"), default="patch")
    parser.add_argument(
        "--types", help="comma-separated model types (default: every AutoModel type; causal LMs for static)"
    )
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=120, help="seconds per type")
    parser.add_argument("--out", type=Path, help="JSON lines, one per type")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.check), ensure_ascii=False))
        return 0
    known = model_types(args.check)
    types = args.types.split(",") if args.types else sorted(known)
    unknown = [t for t in types if t not in known]
    if unknown:
        parser.error(f"unknown model types {unknown}")
    twice = sorted({t for t in types if types.count(t) > 1})
    if twice:  # run and counted twice
        parser.error(f"--types names {twice} more than once")
    if args.jobs < 1 or args.timeout < 1:
        parser.error(f"--jobs and --timeout must be >= 1, got {args.jobs} and {args.timeout}")
    from neutreno.progress import progress

    with ThreadPoolExecutor(args.jobs) as pool:
        done = pool.map(lambda t: run_one(t, args.check, args.timeout), types)
        results = list(progress(done, total=len(types), desc=f"sweep {args.check}", unit="type"))
    for result in results:
        if result["outcome"] in FAILED:
            print(f"{result['type']}: {result['outcome']}: {result['detail']}")
    if args.out:
        from neutreno.io import atomic_path

        args.out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(args.out) as tmp:
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    counts = Counter(r["outcome"] for r in results)
    summary = ", ".join(f"{n} {outcome}" for outcome, n in counts.most_common())
    print(f"{args.check} over {len(results)} types: {summary}")
    return 1 if any(r["outcome"] in FAILED for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
