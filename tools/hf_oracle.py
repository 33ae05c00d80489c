#!/usr/bin/env python3
"""Golden outputs for an m3serve checkpoint, computed with HF transformers' MiniMax-M3 code.

Runs where torch + transformers (>= 5.17, which has `minimax_m3_vl` with per-KV-group
block selection) are installed, normally the GPU machine. The model runs in float32 with
eager attention; MXFP8 weights are dequantised here exactly (fp8 * 2^(e8m0 - 127)), never by
HF. Weights are mapped onto the HF modules by hand so the oracle does not depend on HF's
checkpoint conversion rules; `--check-hf-load` additionally loads through `from_pretrained`
and reports whether HF's own conversion gives the same parameters.

    python3 tools/hf_oracle.py --model DIR --prompts prompts.json --out golden.safetensors \
        [--greedy-tokens 64] [--device cuda|cpu] [--check-hf-load] [--spec-check]

prompts.json: {"prompts": [[ids...], ...]}. Output tensors per prompt i (see docs/oracle.md):
  prompt.{i}.input_ids       I32 [T]
  prompt.{i}.logits          F32 [T, V]
  prompt.{i}.selected_blocks I32 [num_sparse_layers, T, num_index_heads, index_topk_blocks]
  prompt.{i}.expert_ids      I32 [num_moe_layers, T, num_experts_per_tok]
  prompt.{i}.greedy          I32 [G]
"""
import argparse
import hashlib
import json
import os
import re
import sys
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

TEXT_PREFIX = "language_model."


def fail(msg):
    print(f"hf_oracle: error: {msg}", file=sys.stderr)
    sys.exit(1)


# ---------------------------------------------------------------------------------------------
# Config


def load_config(model_dir, quirks):
    """Builds the HF config from our config.json and checks HF read what we meant."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig

    path = os.path.join(model_dir, "config.json")
    with open(path, "rb") as f:
        raw_bytes = f.read()
    raw = json.loads(raw_bytes)
    if raw.get("model_type") != "minimax_m3_vl":
        fail(f"{path}: model_type is {raw.get('model_type')!r}, expected 'minimax_m3_vl'")
    cfg_dict = json.loads(raw_bytes)
    quant = cfg_dict.pop("quantization_config", None)  # we dequantise ourselves
    config = MiniMaxM3VLConfig(**cfg_dict)
    tc = config.text_config
    rt = raw["text_config"]
    sparse = rt.get("sparse_attention_config") or {}

    # What HF must have derived from our fields.
    freq = sparse.get("sparse_attention_freq")
    if freq is not None:
        want = ["minimax_m3_sparse" if f else "full_attention" for f in freq]
        if not sparse.get("use_sparse_attention", True):
            quirks.append("HF ignores sparse_attention_config.use_sparse_attention=false "
                          "(layer_types come from sparse_attention_freq alone)")
        if list(tc.layer_types) != want:
            fail(f"HF layer_types {tc.layer_types} != sparse_attention_freq {freq}")
    moe_freq = rt.get("moe_layer_freq")
    if moe_freq is not None:
        want = ["sparse" if f else "dense" for f in moe_freq]
        if list(tc.mlp_layer_types) != want:
            fail(f"HF mlp_layer_types {tc.mlp_layer_types} != moe_layer_freq {moe_freq}")
    for flat, legacy in (("index_n_heads", "sparse_num_index_heads"), ("index_head_dim", "sparse_index_dim"),
                         ("index_block_size", "sparse_block_size"), ("index_topk_blocks", "sparse_topk_blocks"),
                         ("index_local_blocks", "sparse_local_block")):
        want = sparse.get(legacy, rt.get(flat))
        if want is not None and getattr(tc, flat) != want:
            fail(f"HF {flat}={getattr(tc, flat)} but config.json says {want}")
    if tc.index_n_heads != tc.num_key_value_heads and any(t == "minimax_m3_sparse" for t in tc.layer_types):
        fail(f"index_n_heads {tc.index_n_heads} != num_key_value_heads {tc.num_key_value_heads}")
    if sparse.get("sparse_init_block", 0) != 0:
        quirks.append("HF has no init (sink) blocks; sparse_init_block != 0 is ignored")
    if sparse.get("sparse_score_type", "max") != "max":
        quirks.append("HF always max-pools block scores; sparse_score_type is ignored")
    if float(rt.get("swiglu_beta", 1.0)) != 1.0:
        quirks.append("HF hard-codes the +1 on up (swiglu_beta=1); config swiglu_beta is ignored")
    if rt.get("scoring_func", "sigmoid") != "sigmoid":
        quirks.append("HF always uses sigmoid routing; scoring_func is ignored")
    if rt.get("use_routing_bias") is False:
        quirks.append("HF always adds e_score_correction_bias for selection; use_routing_bias=false is ignored")
    if rt.get("n_shared_experts", 1) != 1:
        quirks.append("HF always builds exactly one shared expert; n_shared_experts is ignored")
    if "partial_rotary_factor" not in rt and "partial_rotary_factor" not in (rt.get("rope_parameters") or {}):
        quirks.append("config.json has no partial_rotary_factor: HF would use FULL-width RoPE "
                      "(HF ignores text_config.rotary_dim)")
    info = {"raw": raw, "config_sha256": hashlib.sha256(raw_bytes).hexdigest(), "quant": quant}
    return config, info


def expected_rotary_width(raw_text):
    head_dim = raw_text.get("head_dim") or raw_text["hidden_size"] // raw_text["num_attention_heads"]
    if raw_text.get("rotary_dim"):
        return int(raw_text["rotary_dim"])
    factor = raw_text.get("partial_rotary_factor")
    if factor is None:
        factor = (raw_text.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5)
    return int(head_dim * factor)


# ---------------------------------------------------------------------------------------------
# Checkpoint reading and weight mapping


def checkpoint_files(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            wm = json.load(f)["weight_map"]
        files = sorted(set(wm.values()))
    else:
        files = sorted(p for p in os.listdir(model_dir) if p.endswith(".safetensors"))
    if not files:
        fail(f"{model_dir}: no .safetensors files")
    return [os.path.join(model_dir, f) for f in files]


class Checkpoint:
    """Lazy name -> tensor access over all shards (one tensor in memory at a time)."""

    def __init__(self, model_dir):
        self.handles, self.where = [], {}
        for path in checkpoint_files(model_dir):
            h = safe_open(path, framework="pt")
            self.handles.append(h)
            for k in h.keys():
                if k in self.where:
                    fail(f"tensor {k} appears in more than one shard")
                self.where[k] = h

    def keys(self):
        return list(self.where)

    def __contains__(self, name):
        return name in self.where

    def get(self, name, device):
        return self.where[name].get_tensor(name).to(device)


def dequant_mxfp8(w, scale, block):
    """W[o, k] = fp8(W_q[o, k]) * 2^(S[o, k / block] - 127), computed exactly in float32."""
    if w.dim() != 2:
        fail(f"MXFP8 weight must be 2-D, got {tuple(w.shape)}")
    out, inp = w.shape
    if inp % block or tuple(scale.shape) != (out, inp // block):
        fail(f"MXFP8 scale shape {tuple(scale.shape)} does not match weight {tuple(w.shape)} / block {block}")
    if scale.dtype == torch.uint8:
        if bool((scale == 255).any()):
            fail("MXFP8 scale 255 (NaN in e8m0)")
        # 2^(s-127) built from float32 bits: exact, no pow/exp rounding. s = 0 is the subnormal 2^-127.
        bits = scale.to(torch.int32) << 23
        mult = torch.where(scale == 0, torch.full_like(bits, 0x00400000), bits).view(torch.float32)
    else:
        mult = scale.to(torch.float32)  # e.g. float8_e8m0fnu or a float container holding 2^k
    wf = w.to(torch.float32)
    if bool(torch.isnan(wf).any()):
        fail("MXFP8 weight holds NaN codes")
    return (wf.view(out, inp // block, block) * mult.unsqueeze(-1)).view(out, inp)


def hf_target(name):
    """Maps one checkpoint key to (hf_key, kind, index) where kind says how it lands.

    kind: 'full' (same shape), 'half0'/'half1' (first/second half of rows of a fused gate_up),
    'expert' (row `index` of a [E, ...] tensor), 'expert_half0'/'expert_half1'.
    """
    if name == TEXT_PREFIX + "lm_head.weight":
        return "lm_head.weight", "full", None
    if not name.startswith(TEXT_PREFIX + "model."):
        return None
    rest = name[len(TEXT_PREFIX + "model."):]
    base = "model.language_model."
    m = re.fullmatch(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight", rest)
    if m:
        layer, expert, w = m.group(1), int(m.group(2)), m.group(3)
        p = f"{base}layers.{layer}.mlp.experts."
        if w == "w2":
            return p + "down_proj", "expert", expert
        return p + "gate_up_proj", "expert_half0" if w == "w1" else "expert_half1", expert
    m = re.fullmatch(r"layers\.(\d+)\.block_sparse_moe\.(gate\.weight|e_score_correction_bias)", rest)
    if m:
        leaf = "weight" if m.group(2) == "gate.weight" else "e_score_correction_bias"
        return f"{base}layers.{m.group(1)}.mlp.gate.{leaf}", "full", None
    m = re.fullmatch(r"layers\.(\d+)\.(block_sparse_moe\.shared_experts|mlp)\.(gate|up|down)_proj\.weight", rest)
    if m:
        owner = "mlp.shared_experts" if m.group(2).startswith("block") else "mlp"
        p = f"{base}layers.{m.group(1)}.{owner}."
        if m.group(3) == "down":
            return p + "down_proj.weight", "full", None
        return p + "gate_up_proj.weight", "half0" if m.group(3) == "gate" else "half1", None
    m = re.fullmatch(r"layers\.(\d+)\.self_attn\.index_(q|k)_(proj|norm)\.weight", rest)
    if m:
        return f"{base}layers.{m.group(1)}.self_attn.indexer.{m.group(2)}_{m.group(3)}.weight", "full", None
    return base + rest, "full", None


def load_weights_manually(model, ckpt, quant, device):
    """Copies every text tensor into the HF model; returns (n_written, n_dequantised)."""
    block = 32
    if quant:
        if quant.get("quant_method") != "mxfp8":
            fail(f"unsupported quant_method {quant.get('quant_method')!r}")
        wbs = quant.get("weight_block_size", [1, 32])
        if list(wbs)[:1] != [1]:
            fail(f"weight_block_size {wbs} is not [1, K]")
        block = int(wbs[1])
    targets = dict(model.state_dict(keep_vars=True))
    written = {}  # hf_key -> bool mask of written elements
    n_deq = 0
    for name in ckpt.keys():
        if name.endswith("_scale_inv"):
            if name[: -len("_scale_inv")] not in ckpt:
                fail(f"scale {name} has no weight")
            continue
        if not name.startswith(TEXT_PREFIX):
            continue  # vision tower / projector: not needed for text
        t = ckpt.get(name, device)
        scale = ckpt.get(name + "_scale_inv", device) if (name + "_scale_inv") in ckpt else None
        if scale is not None:
            if not quant:
                fail(f"{name} has a scale but config.json has no quantization_config")
            if t.dtype != torch.float8_e4m3fn:
                fail(f"{name}: quantised weight dtype {t.dtype}, expected float8_e4m3fn")
            val = dequant_mxfp8(t, scale, block)
            n_deq += 1
        else:
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                fail(f"{name} is fp8 but has no weight_scale_inv")
            val = t.to(torch.float32)
        tgt = hf_target(name)
        if tgt is None:
            fail(f"checkpoint tensor {name} has no place in the HF model")
        key, kind, idx = tgt
        if key not in targets:
            fail(f"checkpoint tensor {name} maps to {key}, which the HF model does not have")
        param = targets[key]
        dst = param.data
        mask = written.setdefault(key, torch.zeros(dst.shape, dtype=torch.bool, device=dst.device))
        if kind.startswith("expert"):
            dst, mask = dst[idx], mask[idx]
        if kind.endswith("half0") or kind.endswith("half1"):
            rows = dst.shape[0] // 2
            sl = slice(0, rows) if kind.endswith("half0") else slice(rows, 2 * rows)
            dst, mask = dst[sl], mask[sl]
        if tuple(dst.shape) != tuple(val.shape):
            fail(f"{name}: shape {tuple(val.shape)} does not fit {key} slot {tuple(dst.shape)}")
        if bool(mask.any()):
            fail(f"{name}: slot in {key} written twice")
        dst.copy_(val.to(device=dst.device, dtype=dst.dtype))
        mask.fill_(True)
    # Every text parameter and persistent buffer must be fully covered.
    missing = []
    for key, p in targets.items():
        if not (key.startswith("model.language_model.") or key.startswith("lm_head.")):
            continue
        m = written.get(key)
        if m is None or not bool(m.all()):
            missing.append(key)
    if missing:
        fail(f"{len(missing)} HF text tensors not (fully) filled from the checkpoint, e.g. {missing[:5]}")
    return len(written), n_deq


# ---------------------------------------------------------------------------------------------
# Model


def build_model(config, device):
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    with torch.device(device):
        model = MiniMaxM3SparseForConditionalGeneration._from_config(
            config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    model.eval()
    tcfg = model.config.text_config
    if tcfg._attn_implementation != "eager":
        fail(f"attention implementation is {tcfg._attn_implementation!r}, wanted eager")
    if getattr(tcfg, "_experts_implementation", "eager") not in (None, "eager"):
        fail(f"experts implementation is {tcfg._experts_implementation!r}, wanted eager")
    return model


def check_rotary(model, raw_text):
    lm = model.model.language_model
    width = 2 * lm.rotary_emb.inv_freq.numel()
    want = expected_rotary_width(raw_text)
    if width != want:
        fail(f"HF rotary width is {width}, expected {want} (rotary_dim / partial_rotary_factor); "
             f"rope_parameters={lm.config.rope_parameters}")
    return width


class Recorder:
    """Forward hooks on the indexers and routers of the HF model."""

    def __init__(self, model):
        lm = model.model.language_model
        self.sparse_layers, self.moe_layers = [], []
        self.on = False
        self.sel, self.experts = {}, {}
        for i, layer in enumerate(lm.layers):
            if getattr(layer.self_attn, "indexer", None) is not None:
                self.sparse_layers.append(i)
                layer.self_attn.indexer.register_forward_hook(self._sel_hook(i))
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                self.moe_layers.append(i)
                gate.register_forward_hook(self._gate_hook(i))

    def _sel_hook(self, i):
        def hook(_mod, _inp, out):
            if self.on:
                if i in self.sel:
                    raise RuntimeError(f"indexer of layer {i} ran twice in one forward")
                self.sel[i] = out.detach()
        return hook

    def _gate_hook(self, i):
        def hook(_mod, _inp, out):
            if self.on:
                if i in self.experts:
                    raise RuntimeError(f"router of layer {i} ran twice in one forward")
                idx = out[2] if isinstance(out, tuple) else out
                self.experts[i] = idx.detach()
        return hook

    def start(self):
        self.sel, self.experts, self.on = {}, {}, True

    def stop(self):
        self.on = False


def canonical_selection(sel, topk_blocks, block_size, T):
    """[1, H, T, k'] HF block ids -> [T, H, topk_blocks], sorted ascending, -1 padded at the end."""
    if sel.dim() != 4 or sel.shape[0] != 1 or sel.shape[2] != T:
        raise RuntimeError(f"unexpected indexer output shape {tuple(sel.shape)} (want [1, H, {T}, k])")
    s = sel[0].transpose(0, 1).to(torch.int64)  # [T, H, k']
    big = torch.iinfo(torch.int64).max
    s = torch.where(s < 0, torch.full_like(s, big), s).sort(dim=-1).values
    s = torch.where(s == big, torch.full_like(s, -1), s)
    k = s.shape[-1]
    if k > topk_blocks:
        raise RuntimeError(f"indexer returned {k} blocks > index_topk_blocks {topk_blocks}")
    if k < topk_blocks:
        s = torch.cat([s, torch.full((*s.shape[:-1], topk_blocks - k), -1, dtype=s.dtype, device=s.device)], -1)
    # Contract checks (m3-architecture.md 2.6): local block kept, min(topk, n) valid, no duplicates.
    pos = torch.arange(T, device=s.device)
    local = (pos // block_size).view(T, 1, 1)
    valid = s >= 0
    n_valid = valid.sum(-1)
    want = torch.clamp(pos // block_size + 1, max=topk_blocks).view(T, 1)
    problems = []
    if not bool((s == local).any(-1).all()):
        problems.append("local block missing")
    if not bool((n_valid == want).all()):
        problems.append("valid count != min(topk, blocks so far)")
    if not bool((s[..., 1:] != s[..., :-1])[valid[..., 1:]].all()):
        problems.append("duplicate block ids")
    if bool((s > local)[valid].any()):
        problems.append("future block selected")
    return s.to(torch.int32), problems


@torch.no_grad()
def run_prompt(model, rec, ids, device, topk_blocks, block_size, k_experts, greedy_tokens):
    T = len(ids)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    rec.start()
    out = model(input_ids=x, use_cache=False)
    rec.stop()
    logits = out.logits[0].float()
    if logits.shape[0] != T:
        raise RuntimeError(f"logits for {logits.shape[0]} positions, expected {T}")
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError("non-finite logits")
    problems = []
    sels = []
    for layer in rec.sparse_layers:
        if layer not in rec.sel:
            raise RuntimeError(f"indexer of sparse layer {layer} did not run")
        s, p = canonical_selection(rec.sel[layer], topk_blocks, block_size, T)
        problems += [f"layer {layer}: {q}" for q in p]
        sels.append(s)
    n_heads = model.config.text_config.index_n_heads
    sel = torch.stack(sels) if sels else torch.zeros((0, T, n_heads, topk_blocks), dtype=torch.int32)
    exps = []
    for layer in rec.moe_layers:
        e = rec.experts[layer].reshape(T, -1).to(torch.int64).sort(dim=-1).values
        if e.shape[1] != k_experts:
            raise RuntimeError(f"router of layer {layer} chose {e.shape[1]} experts, expected {k_experts}")
        exps.append(e.to(torch.int32))
    experts = torch.stack(exps) if exps else torch.zeros((0, T, k_experts), dtype=torch.int32)
    # Greedy continuation: full forward over the whole sequence each step, no KV cache.
    seq = list(ids)
    greedy = []
    for _ in range(greedy_tokens):
        y = model(input_ids=torch.tensor([seq], dtype=torch.long, device=device), use_cache=False)
        nxt = int(torch.argmax(y.logits[0, -1].float()).item())
        greedy.append(nxt)
        seq.append(nxt)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.int32),
        "logits": logits.cpu().contiguous(),
        "selected_blocks": sel.cpu().contiguous(),
        "expert_ids": experts.cpu().contiguous(),
        "greedy": torch.tensor(greedy, dtype=torch.int32),
    }, problems


# ---------------------------------------------------------------------------------------------
# Optional: independent float64 re-implementation of m3-architecture.md section 2


class SpecReference:
    """Reads our config.json directly (not through HF) so a field HF misreads shows up as a diff.

    Weights are fetched per use (no cache): meant for small checkpoints such as the tiny preset.
    """

    def __init__(self, raw, ckpt, device, quant_block):
        self.ckpt, self.dev, self.block = ckpt, device, quant_block
        t = raw["text_config"]
        sp = t.get("sparse_attention_config") or {}
        self.L = t["num_hidden_layers"]
        self.NH, self.KV = t["num_attention_heads"], t["num_key_value_heads"]
        self.HD = t.get("head_dim") or t["hidden_size"] // self.NH
        self.R = expected_rotary_width(t)
        self.theta, self.eps = float(t["rope_theta"]), float(t["rms_norm_eps"])
        self.sparse = sp.get("sparse_attention_freq") or [0] * self.L
        self.moe = t["moe_layer_freq"]
        self.BS = sp.get("sparse_block_size", t.get("index_block_size"))
        self.TOPK = sp.get("sparse_topk_blocks", t.get("index_topk_blocks"))
        self.IH = sp.get("sparse_num_index_heads", t.get("index_n_heads"))
        self.ID = sp.get("sparse_index_dim", t.get("index_head_dim"))
        self.E, self.K = t["num_local_experts"], t["num_experts_per_tok"]
        self.alpha, self.limit = float(t["swiglu_alpha"]), float(t["swiglu_limit"])
        self.beta = float(t.get("swiglu_beta", 1.0))
        self.scale = float(t["routed_scaling_factor"])
        self.use_bias = bool(t.get("use_routing_bias", True))

    def w(self, name):
        t = self.ckpt.get(name, self.dev)
        if name + "_scale_inv" in self.ckpt:
            t = dequant_mxfp8(t, self.ckpt.get(name + "_scale_inv", self.dev), self.block)
        return t.to(torch.float64)

    def rms(self, x, name):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * (1 + self.w(name))

    def rope(self, x, pos):  # NeoX halves inside the first R dims
        R = self.R
        inv = 1.0 / (self.theta ** (torch.arange(0, R, 2, dtype=torch.float64, device=self.dev) / R))
        ang = pos[:, None].double() * inv[None]
        c, s = torch.cos(ang), torch.sin(ang)
        a, b = x[..., : R // 2], x[..., R // 2: R]
        return torch.cat([a * c - b * s, b * c + a * s, x[..., R:]], -1)

    def swiglu(self, g, u):
        g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return (u + self.beta) * g * torch.sigmoid(self.alpha * g)

    def mlp(self, x, p):
        return self.swiglu(x @ self.w(p + "gate_proj.weight").T, x @ self.w(p + "up_proj.weight").T) \
            @ self.w(p + "down_proj.weight").T

    @torch.no_grad()
    def forward(self, ids):
        dev, T = self.dev, len(ids)
        pos = torch.arange(T, device=dev)
        P = TEXT_PREFIX + "model."
        h = self.w(P + "embed_tokens.weight")[torch.tensor(ids, device=dev)]
        causal = pos[None, :] <= pos[:, None]
        sels, exps = [], []
        for l in range(self.L):
            p = f"{P}layers.{l}."
            x = self.rms(h, p + "input_layernorm.weight")
            q = (x @ self.w(p + "self_attn.q_proj.weight").T).view(T, self.NH, self.HD).transpose(0, 1)
            k = (x @ self.w(p + "self_attn.k_proj.weight").T).view(T, self.KV, self.HD).transpose(0, 1)
            v = (x @ self.w(p + "self_attn.v_proj.weight").T).view(T, self.KV, self.HD).transpose(0, 1)
            q = self.rope(self.rms(q, p + "self_attn.q_norm.weight"), pos)
            k = self.rope(self.rms(k, p + "self_attn.k_norm.weight"), pos)
            allow = causal[None].expand(self.KV, T, T)
            if self.sparse[l]:
                iq = (x @ self.w(p + "self_attn.index_q_proj.weight").T).view(T, self.IH, self.ID).transpose(0, 1)
                iq = self.rope(self.rms(iq, p + "self_attn.index_q_norm.weight"), pos)
                ik = self.rope(self.rms(x @ self.w(p + "self_attn.index_k_proj.weight").T,
                                        p + "self_attn.index_k_norm.weight"), pos)
                nb = (T + self.BS - 1) // self.BS
                sc = (iq @ ik.T).masked_fill(~causal[None], float("-inf"))
                sc = torch.nn.functional.pad(sc, (0, nb * self.BS - T), value=float("-inf"))
                bsc = sc.view(self.IH, T, nb, self.BS).amax(-1)
                blk = torch.arange(nb, device=dev)
                bsc = torch.where(blk[None, None, :] == (pos // self.BS)[None, :, None], float("inf"), bsc)
                keep = torch.zeros(self.IH, T, nb, dtype=torch.bool, device=dev)
                # min(topk, n) best valid blocks per (group, query); ties broken by lower block id.
                order = torch.sort(bsc, dim=-1, descending=True, stable=True).indices[..., : self.TOPK]
                keep.scatter_(-1, order, True)
                keep &= torch.isfinite(bsc) | (bsc > 0)
                allow = allow & keep.repeat_interleave(self.BS, -1)[..., :T]
                ids_ = torch.where(keep, blk[None, None, :], torch.full_like(keep, -1, dtype=torch.int64))
                ids_ = torch.sort(torch.where(ids_ < 0, nb, ids_), -1).values[..., : self.TOPK]
                ids_ = torch.where(ids_ == nb, -1, ids_)
                if ids_.shape[-1] < self.TOPK:
                    ids_ = torch.nn.functional.pad(ids_, (0, self.TOPK - ids_.shape[-1]), value=-1)
                sels.append(ids_.transpose(0, 1))
            rep = self.NH // self.KV
            att = (q @ k.repeat_interleave(rep, 0).transpose(1, 2)) * self.HD ** -0.5
            att = att.masked_fill(~allow.repeat_interleave(rep, 0), float("-inf"))
            o = torch.softmax(att, -1) @ v.repeat_interleave(rep, 0)
            h = h + o.transpose(0, 1).reshape(T, -1) @ self.w(p + "self_attn.o_proj.weight").T
            x = self.rms(h, p + "post_attention_layernorm.weight")
            if self.moe[l]:
                m = p + "block_sparse_moe."
                sg = torch.sigmoid(x @ self.w(m + "gate.weight").T)
                choice = sg + self.w(m + "e_score_correction_bias") if self.use_bias else sg
                idx = choice.topk(self.K, -1).indices
                wts = sg.gather(-1, idx)
                wts = wts / wts.sum(-1, keepdim=True)
                exps.append(idx.sort(-1).values)
                y = torch.zeros_like(x)
                for e in range(self.E):
                    rows, slot = (idx == e).nonzero(as_tuple=True)
                    if rows.numel():
                        xe, px = x[rows], f"{m}experts.{e}."
                        a = self.swiglu(xe @ self.w(px + "w1.weight").T, xe @ self.w(px + "w3.weight").T)
                        y.index_add_(0, rows, (a @ self.w(px + "w2.weight").T) * wts[rows, slot, None])
                y = self.scale * y
                if m + "shared_experts.gate_proj.weight" in self.ckpt:
                    y = y + self.mlp(x, m + "shared_experts.")
            else:
                y = self.mlp(x, p + "mlp.")
            h = h + y
        h = self.rms(h, P + "norm.weight")
        logits = h @ self.w(TEXT_PREFIX + "lm_head.weight").T
        return logits, sels, exps

    def compare(self, ids, res):
        logits, sels, exps = self.forward(ids)
        gl = res["logits"].to(self.dev, torch.float64)
        rel = float((logits - gl).norm() / gl.norm())
        if len(sels) != res["selected_blocks"].shape[0] or len(exps) != res["expert_ids"].shape[0]:
            return {"logits_rel": rel, "selection_equal": False, "experts_equal": False,
                    "note": "sparse/MoE layer counts differ between config.json and HF"}
        sel_ok = all(bool((a.cpu() == b.long()).all()) for a, b in zip(sels, res["selected_blocks"]))
        exp_ok = all(bool((a.cpu() == b.long()).all()) for a, b in zip(exps, res["expert_ids"]))
        return {"logits_rel": rel, "selection_equal": sel_ok, "experts_equal": exp_ok}


# ---------------------------------------------------------------------------------------------
# Optional: compare with HF's own from_pretrained conversion


def check_hf_load(model_dir, model, device):
    """Loads via from_pretrained and returns a one-line verdict (never fatal)."""
    try:
        from transformers import AutoConfig
        from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
            MiniMaxM3SparseForConditionalGeneration)
        cfg = AutoConfig.from_pretrained(model_dir)
        qc = getattr(cfg, "quantization_config", None)
        kwargs = {}
        if qc is not None:
            from transformers import FineGrainedFP8Config
            q = dict(qc) if isinstance(qc, dict) else qc.to_dict()
            q["dequantize"] = True
            kwargs["quantization_config"] = FineGrainedFP8Config.from_dict(q)
        hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager", device_map=str(device), **kwargs)
        mine = model.state_dict()
        theirs = hf.state_dict()
        worst, n, missing = 0.0, 0, []
        for k, v in mine.items():
            if not (k.startswith("model.language_model.") or k.startswith("lm_head.")):
                continue
            if k not in theirs:
                missing.append(k)
                continue
            w = theirs[k].to(device=v.device, dtype=torch.float32)
            if w.shape != v.shape:
                missing.append(f"{k} shape {tuple(w.shape)}")
                continue
            worst = max(worst, float((w - v).abs().max()))
            n += 1
        del hf
        if missing:
            return f"from_pretrained: {len(missing)} text tensors absent or reshaped, e.g. {missing[:3]}"
        return f"from_pretrained: {n} text tensors, max |diff| vs manual load = {worst:.3g}"
    except Exception as e:  # diagnostic only
        return f"from_pretrained failed: {type(e).__name__}: {str(e)[:300]}"


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    ap.add_argument("--prompts", required=True, help='JSON file {"prompts": [[ids...], ...]}')
    ap.add_argument("--out", required=True, help="output .safetensors")
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                    help="extra metadata stored in the golden file (e.g. m3_preset=tiny m3_seed=0 m3_mxfp8=1), "
                         "so the engine's test can regenerate the exact checkpoint")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--check-hf-load", action="store_true",
                    help="also load through HF from_pretrained and compare parameters (diagnostic)")
    ap.add_argument("--spec-check", action="store_true",
                    help="also run an independent float64 implementation of the architecture spec and "
                         "compare logits / selections / experts with HF (small checkpoints only)")
    args = ap.parse_args()
    if args.greedy_tokens < 0:
        fail("--greedy-tokens must be >= 0")

    import transformers
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False  # true float32 GEMMs
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    with open(args.prompts) as f:
        pj = json.load(f)
    prompts = pj.get("prompts") if isinstance(pj, dict) else None
    if not isinstance(prompts, list) or not prompts:
        fail(f"{args.prompts}: expected {{\"prompts\": [[ids...], ...]}} with at least one prompt")

    quirks = []
    t0 = time.time()
    config, info = load_config(args.model, quirks)
    tc = config.text_config
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p or not all(isinstance(t, int) and 0 <= t < tc.vocab_size for t in p):
            fail(f"prompt {i} must be a non-empty list of token ids in [0, {tc.vocab_size})")
    model = build_model(config, device)
    for name, p in model.named_parameters():  # poison: any text weight the loader misses shows up
        if name.startswith("model.language_model.") or name.startswith("lm_head."):
            p.data.fill_(float("nan"))
    lm = model.model.language_model
    if not tc.tie_word_embeddings and model.lm_head.weight.data_ptr() == lm.embed_tokens.weight.data_ptr():
        fail("HF tied lm_head to embed_tokens although tie_word_embeddings is false")
    rot = check_rotary(model, info["raw"]["text_config"])
    ckpt = Checkpoint(args.model)
    n_written, n_deq = load_weights_manually(model, ckpt, info["quant"], device)
    block = int((info["quant"] or {}).get("weight_block_size", [1, 32])[1])
    spec = SpecReference(info["raw"], ckpt, device, block) if args.spec_check else None
    hf_load = check_hf_load(args.model, model, device) if args.check_hf_load else None
    rec = Recorder(model)
    want_sparse = [i for i, t in enumerate(tc.layer_types) if t == "minimax_m3_sparse"]
    want_moe = [i for i, t in enumerate(tc.mlp_layer_types) if t == "sparse"]
    if rec.sparse_layers != want_sparse or rec.moe_layers != want_moe:
        fail(f"hooked sparse layers {rec.sparse_layers} / moe layers {rec.moe_layers} "
             f"do not match config {want_sparse} / {want_moe}")
    print(f"hf_oracle: transformers {transformers.__version__}, torch {torch.__version__}, device {device}")
    print(f"hf_oracle: model {args.model} (config sha256 {info['config_sha256'][:16]}), "
          f"{n_written} HF tensors filled, {n_deq} MXFP8 weights dequantised, rotary width {rot}, "
          f"sparse layers {want_sparse}, moe layers {want_moe}, load {time.time() - t0:.1f}s")
    if hf_load:
        print(f"hf_oracle: {hf_load}")

    tensors = {}
    all_problems = []
    spec_results = []
    for i, ids in enumerate(prompts):
        t1 = time.time()
        res, problems = run_prompt(model, rec, ids, device, tc.index_topk_blocks, tc.index_block_size,
                                   tc.num_experts_per_tok, args.greedy_tokens)
        for k, v in res.items():
            tensors[f"prompt.{i}.{k}"] = v
        all_problems += [f"prompt {i} {q}" for q in problems]
        if spec is not None:
            c = spec.compare(ids, res)
            spec_results.append(c)
            if c["logits_rel"] > 1e-4 or not c["selection_equal"] or not c["experts_equal"]:
                all_problems.append(f"prompt {i} spec reference disagrees with HF: {c}")
        lg = res["logits"]
        sel = res["selected_blocks"]
        T = len(ids)
        nblocks = torch.arange(T) // tc.index_block_size + 1
        sparse_pos = int((nblocks > tc.index_topk_blocks).sum())
        print(f"  prompt {i}: T={T} last-argmax={int(lg[-1].argmax())} logit-range=[{float(lg.min()):.3f}, "
              f"{float(lg.max()):.3f}] positions-with-real-selection={sparse_pos} "
              f"greedy[:12]={res['greedy'][:12].tolist()} ({time.time() - t1:.1f}s)")
        if spec is not None:
            print(f"    spec reference: {spec_results[-1]}")
        if sel.numel() and sparse_pos:
            t_last = T - 1
            print(f"    layer {want_sparse[0]} pos {t_last} blocks per kv group: "
                  f"{sel[0, t_last].tolist()}")
    for q in all_problems:
        print(f"hf_oracle: WARNING: {q}")
    for q in quirks:
        print(f"hf_oracle: quirk: {q}")

    meta = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model_dir": os.path.abspath(args.model),
        "config_sha256": info["config_sha256"],
        "rotary_width": str(rot),
        "mxfp8_dequantized_by_oracle": "true" if n_deq else "false",
        "mxfp8_weights_dequantized": str(n_deq),
        "compute_dtype": "float32",
        "attn_implementation": "eager",
        "device": str(device),
        "num_prompts": str(len(prompts)),
        "greedy_tokens": str(args.greedy_tokens),
        "sparse_layers": json.dumps(want_sparse),
        "moe_layers": json.dumps(want_moe),
        "index_block_size": str(tc.index_block_size),
        "index_topk_blocks": str(tc.index_topk_blocks),
        "num_index_heads": str(tc.index_n_heads),
        "experts_per_tok": str(tc.num_experts_per_tok),
        "warnings": json.dumps(all_problems),
        "hf_quirks": json.dumps(quirks),
        "hf_load_check": hf_load or "not run",
        "spec_check": json.dumps(spec_results) if spec is not None else "not run",
    }
    for kv in args.meta:
        if "=" not in kv:
            fail(f"--meta expects KEY=VALUE, got {kv!r}")
        key, value = kv.split("=", 1)
        meta[key] = value
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_file(tensors, args.out, metadata=meta)
    print(f"hf_oracle: wrote {args.out} ({len(tensors)} tensors, {len(prompts)} prompts) "
          f"in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
