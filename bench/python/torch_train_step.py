#!/usr/bin/env python3
"""The PyTorch reference for bench/benches/train_step.rs: one LoRA training step of
SmolLM2-135M (30 layers, d=576, 9 heads / 3 kv heads, MLP 1536, vocab 49152, tied embeddings),
LoRA r=16 alpha=32 on q,k,v,o,gate,up,down, frozen base, AdamW, batch 4 x 256 tokens, float32
on the CPU. Weights are random: the step time does not depend on their values.

Written the way a PyTorch user would (HF-style modules, F.scaled_dot_product_attention,
F.cross_entropy over the full logits), so the ratio measures candle against idiomatic PyTorch.

Usage: python3 bench/python/torch_train_step.py [--steps N] [--candle-json PATH]
       [--device cpu|cuda] [--dtype float32|bfloat16] [--batch B] [--seq T]
On a GPU (`--device cuda`) the frozen weights are held in `--dtype` and the LoRA matrices in
float32, as the candle model does; step times are taken after torch.cuda.synchronize().
Prints the median step time and tokens/s, and the candle/PyTorch time ratio when the candle
benchmark's JSON (written by `cargo bench -p hindsight-bench --bench train_step`) exists.
Needs `pip install torch` (the PyPI wheel; CUDA libraries are installed but unused).
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

V, D, L, H, KV, HD, I = 49152, 576, 30, 9, 3, 64, 1536
THETA, EPS = 100000.0, 1e-5
RANK, ALPHA = 16, 32.0
BATCH, SEQ = 4, 256


class LoraLinear(nn.Module):
    def __init__(self, fin, fout):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fout, fin) / math.sqrt(fin), requires_grad=False)
        self.lora_A = nn.Parameter(torch.empty(RANK, fin).uniform_(-1 / math.sqrt(fin), 1 / math.sqrt(fin)))
        self.lora_B = nn.Parameter(torch.zeros(fout, RANK))
        self.scale = ALPHA / RANK

    def forward(self, x):
        # LoRA in float32 whatever the base dtype (as the candle model does).
        delta = F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B) * self.scale
        return F.linear(x, self.weight) + delta.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d), requires_grad=False)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(D), RMSNorm(D)
        self.q, self.k, self.v = LoraLinear(D, H * HD), LoraLinear(D, KV * HD), LoraLinear(D, KV * HD)
        self.o = LoraLinear(H * HD, D)
        self.gate, self.up, self.down = LoraLinear(D, I), LoraLinear(D, I), LoraLinear(I, D)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, t, H, HD).transpose(1, 2)
        k = self.k(h).view(b, t, KV, HD).transpose(1, 2)
        v = self.v(h).view(b, t, KV, HD).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(o.transpose(1, 2).reshape(b, t, H * HD))
        h = self.ln2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(V, D) * 0.02, requires_grad=False)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.norm = RMSNorm(D)

    def forward(self, ids):
        t = ids.shape[1]
        inv = 1.0 / (THETA ** (torch.arange(0, HD, 2).float() / HD))
        freqs = torch.outer(torch.arange(t).float(), inv)  # on the CPU; moved below
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(ids.device, self.embed.dtype), emb.sin().to(ids.device, self.embed.dtype)
        x = self.embed[ids]
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return F.linear(self.norm(x), self.embed).float()


def status_mb(field):
    """A /proc/self/status memory field (VmRSS, VmHWM) in MB; NaN off Linux."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--candle-json", default=os.path.join(
        os.path.dirname(__file__), "..", "..", "target", "hindsight-bench", "train_step_candle.json"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--seq", type=int, default=SEQ)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = Model()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            p.data = p.data.to(dtype)
    model = model.to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, V, (args.batch, args.seq + 1)).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step():
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    loaded_mb = status_mb("VmRSS")
    step()  # warm-up
    sync()
    times, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        sync()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    med = statistics.median(times)
    med_cpu = statistics.median(cpu)
    peak_mb = status_mb("VmHWM")
    tokens = args.batch * args.seq
    print(f"pytorch {torch.__version__} device={args.device} dtype={args.dtype} "
          f"batch={args.batch}x{args.seq} threads={torch.get_num_threads()} "
          f"trainable={sum(p.numel() for p in params)}")
    print(f"pytorch LoRA train step: {med:.3f} s median of {args.steps} "
          f"({tokens / med:.0f} tokens/s), steps {[round(t, 3) for t in times]}; "
          f"CPU time {med_cpu:.2f} s per step")
    print(f"pytorch peak RSS {peak_mb:.0f} MB (model loaded: {loaded_mb:.0f} MB; "
          f"the step's own: {peak_mb - loaded_mb:.0f} MB)")
    if (dev.type, args.dtype, args.batch, args.seq) != ("cpu", "float32", BATCH, SEQ):
        return  # the candle JSON is the CPU f32 4 x 256 step: no like-for-like ratio
    if os.path.exists(args.candle_json):
        c = json.load(open(args.candle_json))
        ratio = c["train_step_s"] / med
        print(f"candle LoRA train step: {c['train_step_s']:.3f} s ({c['train_tokens_per_s']:.0f} tokens/s)")
        print(f"ratio candle/pytorch step time: {ratio:.2f}x (wall)")
        if c.get("train_step_cpu_s"):
            print(f"ratio candle/pytorch CPU time per step: {c['train_step_cpu_s'] / med_cpu:.2f}x")
        if c.get("train_peak_rss_mb"):
            cp, cl = c["train_peak_rss_mb"], c["loaded_rss_mb"]
            print(f"candle peak RSS {cp:.0f} MB (model loaded: {cl:.0f} MB; the step's own: {cp - cl:.0f} MB)")
            print(f"ratio candle/pytorch peak RSS: {cp / peak_mb:.2f}x; "
                  f"the step's own: {(cp - cl) / (peak_mb - loaded_mb):.2f}x")
    else:
        print(f"(no candle result at {args.candle_json}: run "
              f"`cargo bench -p hindsight-bench --bench train_step` first for the ratio)")


if __name__ == "__main__":
    main()
