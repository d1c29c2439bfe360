"""megatron-core builds the causal (and sliding-window) attention mask on "cuda", whatever the scores' device.

Builds ``DotProductAttention`` (the local attention, one rank) for causal attention, with and without a
sliding window, and calls its ``scale_mask_softmax`` on CPU attention scores with no mask, as its ``forward``
does: in fp32 the softmax is torch's (``forward_torch_softmax``), which builds the mask itself with
``get_default_causal_mask`` / ``get_sliding_window_causal_mask``.

    python repro.py        # the installed megatron-core; PYTHONPATH=<patched copy> python repro.py for a copy

Prints the megatron-core it imported, then one line per case, ``<case>: ok`` or ``<case>: FAIL <error>``;
exits 0 when both cases give the causal softmax, 1 otherwise. megatron-core 0.16.1 on a CPU-only torch:
``FAIL AssertionError: Torch not compiled with CUDA enabled`` for both (with CUDA, the mask lands on the GPU
while the scores are on the CPU). Needs only torch and megatron-core; no GPU, no TransformerEngine, no apex.
"""

import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")   # TransformerConfig's own default

import megatron.core  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

B, HEADS, S = 2, 2, 5


def expected_probs(window_left: int | None) -> torch.Tensor:
    """[S, S] softmax of equal scores over the keys each query may see: keys 0..i, or i - window_left..i."""
    visible = torch.ones(S, S).tril()
    if window_left is not None:
        visible -= torch.ones(S, S).tril(-window_left - 1)
    return visible / visible.sum(-1, keepdim=True)


def run(window_size: tuple[int, int] | None, tp: dist.ProcessGroup) -> str:
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=HEADS, use_cpu_initialization=True,
                               window_size=window_size)
    pgs = ProcessGroupCollection()
    pgs.tp = tp
    attention = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                    attention_type="self", pg_collection=pgs)
    scores = torch.zeros(B, HEADS, S, S)   # [b, np, sq, sk] on the CPU, as DotProductAttention.forward computes them
    try:
        probs = attention.scale_mask_softmax(scores, None, attention.softmax_offset)
    except Exception as error:  # noqa: BLE001 - the failure is what this script reports
        return f"FAIL {type(error).__name__}: {error}"
    want = expected_probs(None if window_size is None else window_size[0])
    if not torch.allclose(probs, want.expand_as(probs)):
        return "FAIL wrong probabilities"
    return "ok"


def main() -> int:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        print(f"megatron-core {megatron.core.__version__} from {megatron.core.__file__} "
              f"(torch {torch.__version__}, CUDA available: {torch.cuda.is_available()})")
        results = {"causal": run(None, dist.group.WORLD), "sliding-window": run((1, 0), dist.group.WORLD)}
    finally:
        dist.destroy_process_group()
    for case, result in results.items():
        print(f"{case}: {result}")
    return 0 if all(result == "ok" for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
