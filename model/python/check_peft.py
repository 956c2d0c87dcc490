#!/usr/bin/env python3
"""Independent check of what hindsight-learner writes, using only numpy and the `safetensors`
package (no code shared with the Rust crate).

Usage: check_peft.py MODEL_DIR ADAPTER_DIR CANDLE_LOGITS

1. The PEFT adapter (adapter_config.json + adapter_model.safetensors) has PEFT's key names,
   shapes (lora_A [r, in], lora_B [out, r]) and dtype (float32), one pair per layer and target.
2. A float64 numpy implementation of the HF Llama/Qwen2 forward pass (written from the
   transformers modeling code: RMSNorm, rotate-half RoPE, grouped-query causal attention, SwiGLU)
   runs the tiny model from MODEL_DIR (config.json + model.safetensors) with the adapter merged
   into the weights (W + scale * B @ A, scale = alpha/r, or alpha/sqrt(r) with rsLoRA), and its
   logits must match candle's (float32) within an absolute tolerance of 1e-3.
Prints OK on success, exits non-zero otherwise.
"""
import json
import math
import os
import re
import sys

try:
    import numpy as np
    from safetensors.numpy import load_file
except ImportError as e:  # pragma: no cover
    sys.exit(f"check_peft.py needs numpy and safetensors: pip install numpy safetensors ({e})")

TOLERANCE = 1e-3
KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_(A|B)\.weight$"
)
MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def check_adapter(adapter_dir, weights, n_layers):
    cfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    for field in ("peft_type", "r", "lora_alpha", "target_modules", "task_type"):
        if field not in cfg:
            fail(f"adapter_config.json lacks {field}")
    if cfg["peft_type"] != "LORA" or cfg["task_type"] != "CAUSAL_LM":
        fail(f"unexpected peft_type/task_type {cfg['peft_type']}/{cfg['task_type']}")
    r = cfg["r"]
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    seen = set()
    for key, t in tensors.items():
        m = KEY.match(key)
        if not m:
            fail(f"key {key} is not a PEFT LoRA key")
        layer, module, proj, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if MODULE[proj] != module:
            fail(f"{key}: {proj} under {module}")
        if t.dtype != np.float32:
            fail(f"{key}: dtype {t.dtype}, expected float32")
        w = weights[f"model.layers.{layer}.{module}.{proj}.weight"]
        out_f, in_f = w.shape
        want = (r, in_f) if ab == "A" else (out_f, r)
        if t.shape != want:
            fail(f"{key}: shape {t.shape}, expected {want}")
        seen.add((layer, proj, ab))
    for layer in range(n_layers):
        for proj in cfg["target_modules"]:
            for ab in "AB":
                if (layer, proj, ab) not in seen:
                    fail(f"missing lora_{ab} for layer {layer} {proj}")
    if len(seen) != len(tensors):
        fail("duplicate keys")
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    return cfg, tensors, scale


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def forward(cfg, w, ids):
    h = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim") or h // nh
    eps = cfg["rms_norm_eps"]
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    t = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd))
    freqs = np.outer(np.arange(t), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    causal = np.triu(np.full((t, t), -np.inf), k=1)

    def lin(name, v, bias=False):
        y = v @ w[name + ".weight"].T
        if bias:
            y = y + w[name + ".bias"]
        return y

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = lin(p + "self_attn.q_proj", a, qkv_bias).reshape(t, nh, hd).transpose(1, 0, 2)
        k = lin(p + "self_attn.k_proj", a, qkv_bias).reshape(t, nkv, hd).transpose(1, 0, 2)
        v = lin(p + "self_attn.v_proj", a, qkv_bias).reshape(t, nkv, hd).transpose(1, 0, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, nh // nkv, axis=0)
        v = np.repeat(v, nh // nkv, axis=0)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd) + causal
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s = s / s.sum(axis=-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(t, nh * hd)
        x = x + lin(p + "self_attn.o_proj", o, cfg.get("attention_bias", False))
        m = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = lin(p + "mlp.gate_proj", m)
        u = lin(p + "mlp.up_proj", m)
        x = x + lin(p + "mlp.down_proj", g / (1.0 + np.exp(-g)) * u)
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight")
    if head is None or cfg.get("tie_word_embeddings"):
        head = w["model.embed_tokens.weight"]
    return x @ head.T


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    model_dir, adapter_dir, logits_path = sys.argv[1:]
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    weights = {k: v.astype(np.float64) for k, v in
               load_file(os.path.join(model_dir, "model.safetensors")).items()}
    acfg, lora, scale = check_adapter(adapter_dir, weights, cfg["num_hidden_layers"])
    for layer in range(cfg["num_hidden_layers"]):
        for proj in acfg["target_modules"]:
            base = f"base_model.model.model.layers.{layer}.{MODULE[proj]}.{proj}"
            a = lora[base + ".lora_A.weight"].astype(np.float64)
            b = lora[base + ".lora_B.weight"].astype(np.float64)
            weights[f"model.layers.{layer}.{MODULE[proj]}.{proj}.weight"] += scale * (b @ a)
    ref = load_file(logits_path)
    ids = ref["input_ids"].astype(np.int64)
    ours = forward(cfg, weights, ids)
    theirs = ref["logits"].astype(np.float64)
    if ours.shape != theirs.shape:
        fail(f"logits shape {theirs.shape}, numpy gives {ours.shape}")
    diff = float(np.max(np.abs(ours - theirs)))
    print(f"max |numpy - candle| = {diff:.3e} over {ours.size} logits (tolerance {TOLERANCE})")
    if not diff <= TOLERANCE:
        fail("logits differ")
    print(f"OK: {len(lora)} adapter tensors, {acfg['target_modules']}, scale {scale:.4f}")


if __name__ == "__main__":
    main()
