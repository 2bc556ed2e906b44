"""Fused ``scaled_dot_product_attention`` vs the explicit product, forward + backward, per dtype and
sequence length (DeiT-tiny heads: B 16, H 3, d 64). The evidence behind ``softmax_attention``'s
``impl="auto"`` rule. Writes bench/results/attention_paths.json."""

from __future__ import annotations

import torch

from neutreno.layers.functional import choose_softmax_impl, softmax_attention

from timing import interleaved_times, machine, write_result

LENGTHS = (17, 65, 197, 577, 1025)


def main() -> None:
    torch.manual_seed(0)
    result = {"machine": machine(), "shape": "B16 H3 d64, forward+backward", "runs": []}
    for dtype in (torch.float32, torch.bfloat16):
        for n in LENGTHS:
            q, k, v = (torch.randn(16, 3, n, 64, dtype=dtype, requires_grad=True) for _ in range(3))

            def step(impl: str, q=q, k=k, v=v) -> None:
                softmax_attention(q, k, v, impl=impl).sum().backward()

            times = interleaved_times({i: (lambda i=i: step(i)) for i in ("fused", "explicit")}, 5, 3)
            fused, explicit = times["fused"]["median_s"], times["explicit"]["median_s"]
            chosen = choose_softmax_impl(q.device, dtype, n)
            result["runs"].append(
                {"dtype": str(dtype).removeprefix("torch."), "tokens": n, "fused_ms": fused * 1e3,
                 "explicit_ms": explicit * 1e3, "explicit_speedup": fused / explicit, "auto_picks": chosen}
            )  # fmt: skip
            print(
                f"{dtype!s:>15} N={n:5d}  fused {fused * 1e3:8.2f} ms  explicit {explicit * 1e3:8.2f} ms  "
                f"explicit/fused speed-up {fused / explicit:5.2f}x  (auto picks {chosen})",
                flush=True,
            )
    print(f"wrote {write_result('attention_paths', result)}")


if __name__ == "__main__":
    main()
