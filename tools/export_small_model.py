#!/usr/bin/env python3
"""Exports trained m3-small weights into the checkpoint layout `m3serve make-model` writes.

Usage: export_small_model.py --weights DIR [--out models/m3-small] [--mxfp8-out models/m3-small-mxfp8]
                             [--tokenizer models/m3-small] [--template FILE]

DIR holds weights.N.safetensors from tools/train_small_model.py (HF text-model names:
`model.*`, `lm_head.weight`; F32 or BF16). Writes, in each output directory, config.json
(MiniMaxM3Config::to_json's fields, sorted keys), generation_config.json, model.safetensors
(names, shapes, dtypes and tensor set of src/model/minimax_m3/weight_specs.cpp plus the one
vision tensor make-model adds) and the tokenizer files and chat template.

BF16: fp32 -> bf16 round-to-nearest-even (core/dtype.h f32_to_bf16); router weight and
e_score_correction_bias stay F32. MXFP8: the BF16 model's weights (as fp32) quantised exactly
as make_model.cpp quantize_mxfp8_row does: per 1x32 run along K, e = the smallest integer with
448 * 2^e >= amax, clamped to [-127, 127], scale byte e + 127, q = fp8 e4m3 RNE, saturating
to +-448 (core/dtype.cpp f32_to_fp8_e4m3), for the linear layers that are not in
ignored_layers (everything but embed_tokens, lm_head and the router gate).
Needs only numpy.
"""
import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_small_model as tsm  # noqa: E402  (TEXT, hf_config_dict; no torch at import)

PREFIX = "language_model."
VISION_TENSOR = "vision_tower.vision_model.pre_layrnorm.weight"  # make_model.h kMakeModelVisionTensor
IGNORED = ["lm_head", "model.embed_tokens", "re:.*block_sparse_moe\\.gate$"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


# ----------------------------------------------------------------------------- safetensors I/O

_NP = {"F32": np.float32, "BF16": np.uint16, "F8_E4M3": np.uint8, "U8": np.uint8, "I32": np.int32}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=_NP[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = (info["dtype"], arr)
    return out


def write_safetensors(path, tensors):
    """tensors: list of (name, dtype string, shape, raw bytes) in write order."""
    header, offset = {}, 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob += b" " * ((8 - len(blob) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, _, raw in tensors:
            f.write(raw)


# ----------------------------------------------------------------------------- number formats

def f32_to_bf16_bits(x):
    """Round-to-nearest-even fp32 -> bf16 bits (NaN kept quiet), as core/dtype.h."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def bf16_bits_to_f32(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def f32_to_fp8_e4m3(v):
    """core/dtype.cpp f32_to_fp8_e4m3, vectorised (float32 arithmetic, RNE via rint)."""
    v = np.asarray(v, dtype=np.float32)
    sign = np.where(np.signbit(v), 0x80, 0).astype(np.int32)
    a = np.abs(v)
    code = np.zeros(v.shape, dtype=np.int32)
    sub = a < np.float32(0.015625)
    code[sub] = np.rint(a[sub] * np.float32(512.0)).astype(np.int32)
    norm = ~sub
    m, e2 = np.frexp(a[norm])
    m = m.astype(np.float32)
    exponent = e2.astype(np.int32) - 1
    q = np.rint((np.float32(2.0) * m - np.float32(1.0)) * np.float32(8.0)).astype(np.int32)
    carry = q == 8
    q[carry] = 0
    exponent[carry] += 1
    code[norm] = np.minimum(((exponent + 7) << 3) | q, 0x7E)
    code[a >= np.float32(448.0)] = 0x7E
    out = (sign | code).astype(np.uint8)
    out[np.isnan(v)] = 0x7F
    return out


def quantize_mxfp8(w):
    """w [out, K] float32 -> (fp8 codes [out, K] u8, e8m0 scales [out, K/32] u8)."""
    out_f, k = w.shape
    assert k % 32 == 0, w.shape
    blocks = w.astype(np.float32).reshape(out_f, k // 32, 32)
    amax = np.abs(blocks).max(-1).astype(np.float64)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 448.0)), -127).astype(np.int64)
    e = np.clip(e, -127, 127)
    for _ in range(4):  # exact fix-ups of the log2 estimate (make_model's two while loops)
        down = (amax > 0) & (e > -127) & (np.ldexp(448.0, e - 1) >= amax)
        up = (amax > 0) & (e < 127) & (np.ldexp(448.0, e) < amax)
        e = e - down + up
    e = np.clip(e, -127, 127)
    scaled = (blocks.astype(np.float64) * np.ldexp(1.0, -e)[..., None]).astype(np.float32)
    return f32_to_fp8_e4m3(scaled).reshape(out_f, k), (e + 127).astype(np.uint8)


# ----------------------------------------------------------------------------- layout

def weight_specs(t):
    """(name, shape, role) in weight_specs.cpp order; role in linear/norm/router/bias/embed/head."""
    specs = []
    root = PREFIX + "model."
    H, hd = t["hidden_size"], t["head_dim"]
    q_out, kv_out = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    specs.append((root + "embed_tokens.weight", (t["vocab_size"], H), "embed"))
    for l in range(t["num_hidden_layers"]):
        p = f"{root}layers.{l}."
        specs += [(p + "input_layernorm.weight", (H,), "norm"),
                  (p + "post_attention_layernorm.weight", (H,), "norm"),
                  (p + "self_attn.q_proj.weight", (q_out, H), "linear"),
                  (p + "self_attn.k_proj.weight", (kv_out, H), "linear"),
                  (p + "self_attn.v_proj.weight", (kv_out, H), "linear"),
                  (p + "self_attn.o_proj.weight", (H, q_out), "linear"),
                  (p + "self_attn.q_norm.weight", (hd,), "norm"),
                  (p + "self_attn.k_norm.weight", (hd,), "norm")]
        if t["sparse_layer_freq"][l]:
            specs += [(p + "self_attn.index_q_proj.weight", (t["index_n_heads"] * t["index_head_dim"], H), "linear"),
                      (p + "self_attn.index_k_proj.weight", (t["index_head_dim"], H), "linear"),
                      (p + "self_attn.index_q_norm.weight", (t["index_head_dim"],), "norm"),
                      (p + "self_attn.index_k_norm.weight", (t["index_head_dim"],), "norm")]
        if t["moe_layer_freq"][l]:
            m = p + "block_sparse_moe."
            I, S = t["intermediate_size"], t["shared_intermediate_size"] * t["n_shared_experts"]
            specs += [(m + "gate.weight", (t["num_local_experts"], H), "router"),
                      (m + "e_score_correction_bias", (t["num_local_experts"],), "bias")]
            for e in range(t["num_local_experts"]):
                x = f"{m}experts.{e}."
                specs += [(x + "w1.weight", (I, H), "linear"), (x + "w3.weight", (I, H), "linear"),
                          (x + "w2.weight", (H, I), "linear")]
            specs += [(m + "shared_experts.gate_proj.weight", (S, H), "linear"),
                      (m + "shared_experts.up_proj.weight", (S, H), "linear"),
                      (m + "shared_experts.down_proj.weight", (H, S), "linear")]
        else:
            D = t["dense_intermediate_size"]
            specs += [(p + "mlp.gate_proj.weight", (D, H), "linear"), (p + "mlp.up_proj.weight", (D, H), "linear"),
                      (p + "mlp.down_proj.weight", (H, D), "linear")]
    specs.append((root + "norm.weight", (H,), "norm"))
    specs.append((PREFIX + "lm_head.weight", (t["vocab_size"], H), "head"))
    return specs


def to_checkpoint_names(hf):
    """HF text-model tensors (name -> fp32 array) -> our checkpoint names (the oracle's mapping, inverted)."""
    out = {}
    t = tsm.TEXT
    for name, arr in hf.items():
        if name == "lm_head.weight":
            out[PREFIX + "lm_head.weight"] = arr
            continue
        assert name.startswith("model."), name
        rest = name[len("model."):]
        ck = PREFIX + "model." + rest
        parts = rest.split(".")
        if rest.startswith("layers."):
            l = int(parts[1])
            p = f"{PREFIX}model.layers.{l}."
            sub = ".".join(parts[2:])
            if sub.startswith("self_attn.indexer."):
                ck = p + "self_attn.index_" + sub[len("self_attn.indexer."):]
            elif sub == "mlp.gate.weight":
                ck = p + "block_sparse_moe.gate.weight"
            elif sub == "mlp.gate.e_score_correction_bias":
                ck = p + "block_sparse_moe.e_score_correction_bias"
            elif sub == "mlp.experts.gate_up_proj":
                I = t["intermediate_size"]
                for e in range(arr.shape[0]):
                    out[f"{p}block_sparse_moe.experts.{e}.w1.weight"] = arr[e, :I]
                    out[f"{p}block_sparse_moe.experts.{e}.w3.weight"] = arr[e, I:]
                continue
            elif sub == "mlp.experts.down_proj":
                for e in range(arr.shape[0]):
                    out[f"{p}block_sparse_moe.experts.{e}.w2.weight"] = arr[e]
                continue
            elif sub == "mlp.shared_experts.gate_up_proj.weight":
                half = arr.shape[0] // 2
                out[p + "block_sparse_moe.shared_experts.gate_proj.weight"] = arr[:half]
                out[p + "block_sparse_moe.shared_experts.up_proj.weight"] = arr[half:]
                continue
            elif sub == "mlp.shared_experts.down_proj.weight":
                ck = p + "block_sparse_moe.shared_experts.down_proj.weight"
            elif sub == "mlp.gate_up_proj.weight":
                half = arr.shape[0] // 2
                out[p + "mlp.gate_proj.weight"] = arr[:half]
                out[p + "mlp.up_proj.weight"] = arr[half:]
                continue
        out[ck] = arr
    return out


def config_json(mxfp8):
    cfg = tsm.hf_config_dict()
    if mxfp8:
        cfg["quantization_config"] = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "scale_fmt": "ue8m0", "weight_block_size": [1, 32], "ignored_layers": IGNORED}
    return cfg


def write_dir(out_dir, tensors_f32, mxfp8, tokenizer_dir, template):
    os.makedirs(out_dir, exist_ok=True)
    for stale in os.listdir(out_dir):
        if stale.endswith(".safetensors") or stale == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, stale))
    t = tsm.TEXT
    records = []
    for name, shape, role in weight_specs(t):
        arr = tensors_f32[name]
        assert tuple(arr.shape) == tuple(shape), (name, arr.shape, shape)
        if role in ("router", "bias"):
            records.append((name, "F32", shape, np.ascontiguousarray(arr, dtype=np.float32).tobytes()))
            continue
        bits = f32_to_bf16_bits(arr)
        if mxfp8 and role == "linear":
            q, s = quantize_mxfp8(bf16_bits_to_f32(bits))
            records.append((name, "F8_E4M3", shape, q.tobytes()))
            records.append((name + "_scale_inv", "U8", (shape[0], shape[1] // 32), s.tobytes()))
        else:
            records.append((name, "BF16", shape, bits.tobytes()))
    records.append((VISION_TENSOR, "BF16", (32,), np.zeros(32, np.uint16).tobytes()))
    write_safetensors(os.path.join(out_dir, "model.safetensors"), records)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(json.dumps(config_json(mxfp8), indent=2, sort_keys=True) + "\n")
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        f.write(json.dumps({"bos_token_id": t["bos_token_id"], "eos_token_id": t["eos_token_id"]},
                           indent=2, sort_keys=True) + "\n")
    if os.path.abspath(tokenizer_dir) != os.path.abspath(out_dir):
        for fn in TOKENIZER_FILES:
            shutil.copyfile(os.path.join(tokenizer_dir, fn), os.path.join(out_dir, fn))
    if template:
        shutil.copyfile(template, os.path.join(out_dir, "chat_template.jinja"))
    total = sum(len(r[3]) for r in records)
    print(f"wrote {out_dir}: {len(records)} tensors, {total / 2**20:.2f} MiB")


def main():
    repo = os.path.dirname(HERE)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", required=True)
    ap.add_argument("--out", default=os.path.join(repo, "models", "m3-small"))
    ap.add_argument("--mxfp8-out", default=os.path.join(repo, "models", "m3-small-mxfp8"))
    ap.add_argument("--tokenizer", default=os.path.join(repo, "models", "m3-small"))
    ap.add_argument("--template", default=None, help="chat template to copy (default: the tokenizer dir's)")
    args = ap.parse_args()
    hf = {}
    for fn in sorted(os.listdir(args.weights)):
        if fn.startswith("weights.") and fn.endswith(".safetensors"):
            for name, (_, arr) in read_safetensors(os.path.join(args.weights, fn)).items():
                hf[name] = arr.astype(np.float32)
    tensors = to_checkpoint_names(hf)
    expected = {n for n, _, _ in weight_specs(tsm.TEXT)}
    missing, extra = expected - set(tensors), set(tensors) - expected
    if missing or extra:
        sys.exit(f"name mapping mismatch: missing {sorted(missing)[:5]} extra {sorted(extra)[:5]}")
    write_dir(args.out, tensors, False, args.tokenizer, args.template)
    if args.mxfp8_out:
        write_dir(args.mxfp8_out, tensors, True, args.tokenizer, args.template)
    return 0


if __name__ == "__main__":
    sys.exit(main())
