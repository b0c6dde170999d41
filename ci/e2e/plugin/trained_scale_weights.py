"""An SGLang plugin for the model-level comparison: dummy weights at a trained model's scale.

With `--load-format dummy`, SGLang 0.5.20 draws every weight from U(-1e-3, 1e-3) with one
seed for all of them. Attention then adds next to nothing to the residual stream (a
1e-3 projection of a 1e-3 projection, far below bf16's resolution of the embedding), so
the KV cache cannot move a logprob: a server that loads another layer's rows from its
host cache answers exactly like one that loads the right rows.

This plugin keeps SGLang's dummy loader and draws its weights again so that every layer
matters: each tensor whose name ends in "weight" (2-D and more) from
U(-sqrt(3 / fan_in), sqrt(3 / fan_in)), fan_in its last dimension (unit-variance outputs
for unit-variance inputs, as a trained model keeps them), and 1-D norm weights at 1;
each from its own seed (the name's CRC-32), so layers differ. Everything else keeps
SGLang's values. Same config, same weights, in every server of a comparison.

It reaches every process that loads weights (the scheduler of each rank) through
SGLang's plugin framework (`sglang.srt.plugins`, entry point group
"sglang.srt.plugins", loaded at the start of each scheduler process): the folder that
holds this file and its .dist-info goes on the servers' PYTHONPATH. Each time it draws
a model's weights it prints LOG_LINE to the server's log, which the comparison requires
of every dummy-weight server (e2e_verdict).
"""
from __future__ import annotations

import math
import sys
import zlib

import torch

TARGET = "sglang.srt.model_loader.loader.initialize_dummy_weights"
LOG_LINE = "trained-scale dummy weights drawn"


def draw_bound(name: str, param: torch.Tensor) -> float | None:
    """The half-width of the uniform draw for a tensor, 0.0 for a norm weight (set to 1),
    None for a tensor that keeps SGLang's dummy value."""
    if not name.endswith("weight"):
        return None
    if param.dim() >= 2:
        return math.sqrt(3.0 / param.shape[-1])
    return 0.0 if "norm" in name else None


def redraw(model: torch.nn.Module, seed: int = 1234) -> int:
    """Draw the weights of `model` again (see the module docstring); returns how many."""
    count = 0
    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param):
            continue
        bound = draw_bound(name, param)
        if bound is None:
            continue
        count += 1
        if bound == 0.0:
            param.fill_(1.0)
            continue
        generator = torch.Generator(device=param.device)
        generator.manual_seed(seed + zlib.crc32(name.encode()))
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
        with torch.no_grad():
            count = redraw(model)
        print(f"{LOG_LINE}: {count} tensors", file=sys.stderr, flush=True)

    HookRegistry.register(TARGET, initialize_dummy_weights, HookType.AROUND)
