"""A tiny inference engine that serves refitd's FP8 kernels in place.

It attaches to the daemon (refit_client.attach: the kernels are zero-copy,
read-only views of the daemon's arena), runs a pure-PyTorch Llama forward
over them — FP8 weights dequantized per layer with their scales, bf16
embeddings and norms as served — and generates greedily from a prompt,
calling safe_point() between steps, so that a refit pushed meanwhile is
committed between two steps and the next step runs on the new version with
no re-attach and no copy.

    build/bin/refitd --model demo --listen unix:/tmp/refitd.sock &
    .venv/bin/python client/python/examples/tiny_engine.py --addr unix:/tmp/refitd.sock \\
        --prompt 1,2,3 --steps 16

The model's shape comes from --config (a checkpoint's config.json) or is the
demo model's (2 layers, hidden 128, 4 heads of 32, 2 kv heads, vocab 1000).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from refit_client import attach

DEMO = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1000,
}


@dataclass
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float = 1e-5
    theta: float = 10000.0

    @staticmethod
    def from_config(config: Dict) -> "Shape":
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return Shape(
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab=int(config["vocab_size"]),
            eps=float(config.get("rms_norm_eps", 1e-5)),
            theta=float(config.get("rope_theta", 10000.0)),
        )


def dequantized(tensors: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A linear layer's weight in float32: FP8 times its scale (per tensor or
    per output channel), or the kept weight as is."""
    w = tensors[f"{name}.weight"]
    scale = tensors.get(f"{name}.weight_scale")
    if scale is None:
        return w.to(torch.float32)
    return w.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float32)


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    # x: [heads, seq, head_dim]
    seq, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos(), angles.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def forward(tensors: Dict[str, torch.Tensor], shape: Shape, tokens: List[int]) -> torch.Tensor:
    """Logits (float32, [vocab]) of the token after `tokens`."""
    ids = torch.tensor(tokens, dtype=torch.long)
    x = tensors["model.embed_tokens.weight"][ids].to(torch.float32)
    seq = len(tokens)
    q_rows = shape.heads * shape.head_dim
    kv_rows = shape.kv_heads * shape.head_dim
    group = shape.heads // shape.kv_heads
    mask = torch.full((seq, seq), float("-inf")).triu(1)
    for layer in range(shape.layers):
        p = f"model.layers.{layer}"
        h = rms_norm(x, tensors[f"{p}.input_layernorm.weight"], shape.eps)
        qkv = h @ dequantized(tensors, f"{p}.self_attn.qkv_proj").T
        q, k, v = qkv.split([q_rows, kv_rows, kv_rows], dim=-1)
        q = rope(q.view(seq, shape.heads, shape.head_dim).transpose(0, 1), shape.theta)
        k = rope(k.view(seq, shape.kv_heads, shape.head_dim).transpose(0, 1), shape.theta)
        v = v.view(seq, shape.kv_heads, shape.head_dim).transpose(0, 1)
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        scores = q @ k.transpose(-1, -2) / shape.head_dim**0.5 + mask
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(seq, q_rows)
        x = x + attn @ dequantized(tensors, f"{p}.self_attn.o_proj").T
        h = rms_norm(x, tensors[f"{p}.post_attention_layernorm.weight"], shape.eps)
        gate, up = (h @ dequantized(tensors, f"{p}.mlp.gate_up_proj").T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ dequantized(tensors, f"{p}.mlp.down_proj").T
    x = rms_norm(x, tensors["model.norm.weight"], shape.eps)
    logits = x[-1] @ tensors["lm_head.weight"].to(torch.float32).T
    return logits[: shape.vocab]


def generate(
    engine,
    shape: Shape,
    prompt: List[int],
    steps: int,
    on_step: Optional[Callable[[int, torch.Tensor, List[int]], None]] = None,
) -> List[int]:
    """Greedy generation, a safe point before every step."""
    tokens = list(prompt)
    for step in range(steps):
        engine.safe_point()
        logits = forward(engine.tensors, shape, tokens)
        if on_step is not None:
            on_step(step, logits, tokens)
        tokens.append(int(logits.argmax()))
    return tokens


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--addr", required=True, help="refitd's unix: address")
    parser.add_argument("--group", default=None)
    parser.add_argument("--config", default=None, help="config.json of the served checkpoint")
    parser.add_argument("--prompt", default="1,2,3", help="comma-separated token ids")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--no-coordinate", action="store_true")
    parser.add_argument("--token-file", default=None,
                        help="an engine token, for a daemon with --auth-tokens")
    args = parser.parse_args(argv)
    config = DEMO
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
        config.setdefault("head_dim", None)
    shape = Shape.from_config(config) if args.config else Shape(2, 4, 2, 32, 1000)
    with attach(args.addr, args.group, coordinate=not args.no_coordinate, name="tiny_engine",
                token_file=args.token_file) as engine:
        print(f"attached {engine.engine_id}: version {engine.version}, {len(engine.tensors)} tensors",
              file=sys.stderr)
        tokens = generate(
            engine,
            shape,
            [int(t) for t in args.prompt.split(",") if t],
            args.steps,
            on_step=lambda step, logits, toks: print(
                f"step {step} version {engine.version} next {int(logits.argmax())}", file=sys.stderr
            ),
        )
        print(",".join(str(t) for t in tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
