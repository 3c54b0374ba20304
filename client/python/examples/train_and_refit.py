"""Train a tiny Llama for a few steps and refit refitd after every step.

The model is built from plain torch modules with Hugging Face parameter
names, sized from the daemon's checkpoint layout (what `refitd --model demo`
serves: 2 layers, hidden 128, 4 heads, 2 kv heads, vocab 1000). After the
last push it checks that the daemon's kernels are exactly what it would make
of these weights: bf16-kept tensors (norms, embeddings) byte for byte, and
FP8 weights against the per-tensor FP8 cast computed here in torch with the
daemon's math (core/fp8_quantizer.h): s = amax / 448, inv = 1 / s,
q = fp8_e4m3fn(clamp(x * inv, -448, 448)), q/k/v and gate/up fused first.

    build/bin/refitd --model demo --listen unix:/tmp/refitd.sock &
    .venv/bin/python client/python/examples/train_and_refit.py --addr unix:/tmp/refitd.sock
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import nn

from refit_client import RefitClient


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions[:, None].float() * freqs[None, :]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        pos = torch.arange(t)
        q = rotate(self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2), pos)
        k = rotate(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2), pos)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden"])
        self.self_attn = Attention(c["hidden"], c["heads"], c["kv_heads"], c["head_dim"])
        self.post_attention_layernorm = RMSNorm(c["hidden"])
        self.mlp = Mlp(c["hidden"], c["intermediate"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"])


class TinyLlama(nn.Module):
    """LlamaForCausalLM's parameter names: model.layers.N.self_attn.q_proj.weight, ..."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def config_from_daemon(client: RefitClient) -> dict:
    """The model's sizes from the checkpoint layout the daemon accepts."""
    shapes = {t.name: t.shape for t in client.tensors(layout="checkpoint")}
    p = "model.layers.0."
    head_dim = 2 * shapes[p + "self_attn.rotary_emb.inv_freq"][0]
    vocab, hidden = shapes["model.embed_tokens.weight"]
    return dict(
        vocab=vocab,
        hidden=hidden,
        layers=sum(1 for n in shapes if n.endswith(".input_layernorm.weight")),
        head_dim=head_dim,
        heads=shapes[p + "self_attn.q_proj.weight"][0] // head_dim,
        kv_heads=shapes[p + "self_attn.k_proj.weight"][0] // head_dim,
        intermediate=shapes[p + "mlp.gate_proj.weight"][0],
    )


def fp8_per_tensor(w: torch.Tensor) -> tuple:
    """The daemon's per-tensor FP8 cast: (q as fp8_e4m3fn, scale as float32)."""
    x = w.float()
    s = x.abs().max() / 448.0
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    q = (x * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, s.reshape(1)


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def check_kernels(client: RefitClient, pushed: dict) -> int:
    """Compares every weight kernel with what the daemon should have made of
    `pushed` (bf16 checkpoint tensors); returns the number of mismatches."""
    mismatches = 0
    for info in client.tensors():
        name = info.name
        if name.endswith((".k_scale", ".v_scale", ".q_scale")):
            continue  # attention scales: not derived from these weights
        prefix, _, leaf = name.rpartition(".")
        base = prefix.rpartition(".")[2]
        parts = [prefix.rpartition(".")[0] + "." + p for p in FUSED.get(base, (base,))]
        if info.dtype == "bf16":
            got = client.read(name, as_="torch")
            want = pushed[name]
            # Embeddings are padded to a multiple of 64 rows; padding is zero.
            ok = torch.equal(got[: want.shape[0]].view(torch.int16), want.view(torch.int16))
            ok = ok and not got[want.shape[0] :].view(torch.int16).any()
        elif info.dtype == "fp8_e4m3" or leaf == "weight_scale":
            w = torch.cat([pushed[p + ".weight"] for p in parts])
            q, s = fp8_per_tensor(w)
            if leaf == "weight_scale":
                ok = torch.equal(client.read(name, as_="torch"), s)
            else:
                got = client.read(name, as_="torch")
                ok = torch.equal(got.view(torch.uint8), q.view(torch.uint8))
        else:
            continue
        if not ok:
            print(f"MISMATCH {name}")
            mismatches += 1
    return mismatches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--addr", default="unix:/tmp/refitd.sock")
    ap.add_argument("--token-file")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    with RefitClient(args.addr, token_file=args.token_file) as client:
        client.wait_until_ready(timeout=60)
        status = client.status()
        if status.model.quantization != "per-tensor" or status.model.tp_size != 1:
            print("this example's check implements per-tensor FP8 at tp_size 1", file=sys.stderr)
            return 2
        c = config_from_daemon(client)
        model = TinyLlama(c)
        for n, p in model.named_parameters():
            if n.endswith("proj.weight") or n.endswith("lm_head.weight") or "embed" in n:
                nn.init.normal_(p, std=1.0 / math.sqrt(c["hidden"]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        version = status.version
        pushed = {}
        for step in range(1, args.steps + 1):
            tokens = torch.randint(0, c["vocab"], (4, 32))
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, c["vocab"]), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            # fp32 master weights, pushed as bf16 (the checkpoint dtype).
            pushed = {n: p.detach().to(torch.bfloat16) for n, p in model.state_dict().items()}
            result = client.push(pushed, base_version=version, label=f"step {step}")
            version = result.version
            print(
                f"step {step}: loss {loss.item():.4f} -> version {result.version} "
                f"fingerprint {result.fingerprint} "
                f"(receive {result.timings.receive_seconds * 1e3:.1f} ms, "
                f"commit {result.timings.commit_seconds * 1e3:.2f} ms)"
            )
        bad = check_kernels(client, pushed)
        if bad:
            print(f"{bad} kernel tensors differ from the local FP8 cast")
            return 1
        print(f"every kernel matches the local quantization (version {version})")
        return 0


if __name__ == "__main__":
    sys.exit(main())
