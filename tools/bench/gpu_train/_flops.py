# SPDX-License-Identifier: Apache-2.0
"""Model FLOPs utilisation: the device's dense bf16 peak looked up by its name, and the two throughput figures the
anchors quote.

- MFU = tokens/s x FLOPs per token / peak, FLOPs per token = ``6 P + 12 L d T`` (``GPTShape.flops_per_token``:
  PaLM's count, as nanoGPT and llm.c report it).
- ColossalAI's figure (``examples/language/gpt`` of its Gemini benchmark): TFLOPS = ``8 P`` x tokens/s / 1e12
  (``8 = 6 + 2``: their benchmark recomputes activations), printed beside ours so the numbers can be read against
  theirs; no peak involved.

The peak table is NVIDIA's datasheet figure for dense (not 2:4 sparse) bf16 tensor-core math, matched against
``torch.cuda.get_device_name()`` in the order listed (the first entry whose every word is in the name, so
``H100 PCIe`` and ``H200 NVL`` are tried before ``H100`` and ``H200``). A device not listed reports no MFU unless ``--peak-tflops`` is given.
"""

from __future__ import annotations

__all__ = ["PEAK_BF16_TFLOPS", "colossalai_tflops", "mfu", "model_tflops", "peak_bf16_tflops"]

#: (words that must all appear in the device name, dense bf16 TFLOPS, the product the figure is for)
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], float, str], ...] = (
    (("GH200",), 989.4, "GH200 (H100 SXM tensor cores)"),
    (("H200", "NVL"), 835.5, "H200 NVL"),
    (("H200",), 989.4, "H200 SXM (the H100 SXM's tensor cores)"),
    (("H100", "PCIe"), 756.5, "H100 PCIe"),
    (("H100", "NVL"), 835.5, "H100 NVL"),
    (("H100",), 989.4, "H100 SXM"),
    (("H800",), 989.4, "H800 SXM"),
    (("A100",), 312.0, "A100 (SXM and PCIe)"),
    (("L40S",), 362.1, "L40S"),
)


def peak_bf16_tflops(device_name: str | None) -> tuple[float | None, str | None]:
    """``(dense bf16 TFLOPS, product)`` of the first :data:`PEAK_BF16_TFLOPS` entry matching ``device_name``
    (case-insensitive, every word present); ``(None, None)`` for a device not in the table (or no device)."""
    if not device_name:
        return None, None
    name = device_name.lower()
    for words, tflops, product in PEAK_BF16_TFLOPS:
        if all(w.lower() in name for w in words):
            return tflops, product
    return None, None


def model_tflops(tokens_per_s: float, flops_per_token: float) -> float:
    """Achieved model TFLOPS: tokens/s x FLOPs per token / 1e12."""
    return tokens_per_s * flops_per_token / 1e12


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] (``None`` without a peak)."""
    if not peak_tflops:
        return None
    return model_tflops(tokens_per_s, flops_per_token) / peak_tflops


def colossalai_tflops(tokens_per_s: float, parameters: int) -> float:
    """ColossalAI's GPT benchmark figure: ``8 P`` FLOPs per token x tokens/s / 1e12."""
    return 8.0 * parameters * tokens_per_s / 1e12
