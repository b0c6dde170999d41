"""An SGLang plugin for the model-level comparison: dummy weights at a trained model's scale.

With `--load-format dummy`, SGLang 0.5.20 draws every weight from U(-1e-3, 1e-3) with one
seed for all of them. Attention then adds next to nothing to the residual stream (a
1e-3 projection of a 1e-3 projection, far below bf16's resolution of the embedding), so
the KV cache cannot move a logprob: a server that loads another layer's rows from its
host cache answers exactly like one that loads the right rows.

This plugin keeps SGLang's dummy loader and draws its weights again so that every layer
matters:
- each tensor whose name ends in "weight" with 2 or more dimensions from
  U(-sqrt(3 / fan_in), sqrt(3 / fan_in)), fan_in its last dimension as this rank holds
  it (unit-variance outputs for unit-variance inputs; a row-parallel shard, whose last
  dimension is 1/tp of the layer's input, draws sqrt(tp) wider);
- 1-D norm weights at 1 (a norm that scales by 1 + w then scales by 2);
- quantization scales ("...scale", "...scale_inv") at 1, so a quantized weight keeps the
  drawn scale.
Each tensor draws from its own seed, the CRC-32 of its name and the rank's tensor-parallel
rank, so layers differ and so do the shards of one tensor on different ranks (pipeline
stages hold different layers, hence different names). Everything else keeps SGLang's
values. Same config and ranks, same weights, in every server of a comparison.

It reaches every process that loads weights (the scheduler of each rank) through
SGLang's plugin framework (entry point group "sglang.srt.plugins", loaded at the start of
each scheduler process): the folder that holds this file and its .dist-info goes on the
servers' PYTHONPATH. Each rank prints LOG_LINE with the number of tensors it drew to the
server's log; the comparison requires one such line per rank with a count above 0, equal
to the native server's (harness/compare/verdict.py).
"""
from __future__ import annotations

import math
import sys
import zlib

import torch

TARGET = "sglang.srt.model_loader.loader.initialize_dummy_weights"
LOG_LINE = "trained-scale dummy weights drawn"
ONE = 0.0   # draw_bound's answer for a tensor set to 1


def draw_bound(name: str, param: torch.Tensor) -> float | None:
    """The half-width of the uniform draw for a tensor, ONE for a tensor set to 1, None
    for a tensor that keeps SGLang's dummy value."""
    if name.endswith(("scale", "scale_inv")):
        return ONE
    if not name.endswith("weight"):
        return None
    if param.dim() >= 2:
        return math.sqrt(3.0 / param.shape[-1])
    return ONE if "norm" in name else None


def tensor_parallel_rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError):   # no tensor-parallel group: one rank
        return 0


def redraw(model: torch.nn.Module, rank: int = 0, seed: int = 1234) -> int:
    """Draw the weights of `model` again (see the module docstring); returns how many."""
    count = 0
    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param):
            continue
        bound = draw_bound(name, param)
        if bound is None:
            continue
        count += 1
        if bound == ONE:
            param.fill_(1.0)
            continue
        generator = torch.Generator(device=param.device)
        generator.manual_seed(seed + zlib.crc32(f"{name}@{rank}".encode()))
        if torch.finfo(param.dtype).bits < 16:   # uniform_ has no 8-bit kernels, as in SGLang
            drawn = torch.empty(param.shape, dtype=torch.float16, device=param.device)
            param.copy_(drawn.uniform_(-bound, bound, generator=generator).to(param.dtype))
        else:
            param.uniform_(-bound, bound, generator=generator)
    return count


def register() -> None:
    """The plugin's entry point: wrap SGLang's dummy initialisation."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def initialize_dummy_weights(original, model, *args, **kwargs):
        original(model, *args, **kwargs)   # SGLang's values for what this plugin leaves alone
        rank = tensor_parallel_rank()
        with torch.no_grad():
            count = redraw(model, rank)
        print(f"{LOG_LINE}: {count} tensors (tp rank {rank})", file=sys.stderr, flush=True)

    HookRegistry.register(TARGET, initialize_dummy_weights, HookType.AROUND)
