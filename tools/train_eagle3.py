#!/usr/bin/env python3
"""Trains an EAGLE-3 draft for a target model from tools/eagle3_data's dump, on the CPU with JAX.

  eagle3_data --model models/m3-small --corpus A.txt,B.txt --out DATA      (the C++ dump)
  train_eagle3.py --data DATA --target models/m3-small --out models/m3-small-eagle3 [--steps 800]

The draft is vLLM's LlamaForCausalLMEagle3 layer (see src/model/eagle3): fc over the target's
residual streams entering the aux layers, q/k/v of [norm(embedding), norm(hidden)], causal
attention with full-width NeoX RoPE, SiLU MLP, final norm and an LM head (initialised from the
target's). The embedding is the target's (not stored). Training-time test as in EAGLE-3: step 1
predicts the target's greedy token after position p + 1 from (hidden state at p, token at p + 1);
step j > 1 feeds the draft's own pre-norm output of step j - 1 as the hidden state at position
p + j - 1, attending to step 1's keys up to p and its own chain's keys. Labels are the target's
greedy predictions (what the engine verifies drafts against at temperature 0).

Writes model.safetensors (BF16), config.json and train.json (loss and per-step accuracy on
held-out windows of the dump) into --out. Needs jax, optax, numpy (pip).
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_small_model import f32_to_bf16_bits, read_safetensors, write_safetensors  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--target", required=True, help="the target model's directory (embedding, LM head)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ttt", type=int, default=3, help="training-time-test steps (1 = no chaining)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--holdout", type=int, default=16, help="windows kept out of training for the report")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="rows of the draft's head: the most frequent greedy tokens (d2t maps them); 0 = all")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import optax

    meta = json.load(open(os.path.join(args.data, "meta.json")))
    N, W, H, V = meta["windows"], meta["window"], meta["hidden_size"], meta["vocab_size"]
    aux_ids = meta["aux_layer_ids"]
    A = len(aux_ids)
    eps = meta["rms_norm_eps"]
    tokens = np.fromfile(os.path.join(args.data, "tokens.i32"), dtype=np.int32).reshape(N, W)
    greedy = np.fromfile(os.path.join(args.data, "greedy.i32"), dtype=np.int32).reshape(N, W)
    aux = np.fromfile(os.path.join(args.data, "aux.f32"), dtype=np.float32).reshape(N, A, W, H)
    aux = np.ascontiguousarray(aux.transpose(0, 2, 1, 3).reshape(N, W, A * H))  # fc's input: captures side by side
    target = {k: np.asarray(v, dtype=np.float32)
              for k, (dtype, v) in read_safetensors(os.path.join(args.target, "model.safetensors")).items()
              if dtype in ("F32", "BF16")}
    embed = jnp.asarray(target["language_model.model.embed_tokens.weight"])
    head0 = target["language_model.lm_head.weight"]

    # The draft's vocabulary: the target's most frequent greedy tokens (EAGLE-3's reduced head);
    # labels outside it cannot be drafted and carry no loss.
    Vd = V if args.draft_vocab <= 0 else min(args.draft_vocab, V)
    counts = np.bincount(greedy.ravel(), minlength=V)
    ids = np.arange(V) if Vd == V else np.sort(np.argsort(-counts, kind="stable")[:Vd])
    to_draft = np.full(V, -1, np.int64)
    to_draft[ids] = np.arange(Vd)
    coverage = float(counts[ids].sum() / counts.sum())
    print("draft vocabulary %d of %d: %.1f%% of the greedy labels" % (Vd, V, 100 * coverage), flush=True)
    greedy_d = to_draft[greedy].astype(np.int32)  # -1: not draftable
    head0 = head0[ids]

    D = 64 if H % 64 == 0 else H // args.heads
    Hq, Hkv, I = args.heads, args.kv_heads, args.intermediate
    rng = np.random.default_rng(args.seed)

    def lin(o, i):
        return (rng.standard_normal((o, i)) / math.sqrt(i)).astype(np.float32)

    params = {
        "fc": lin(H, A * H) * 0.5, "in_norm": np.ones(H, np.float32), "hid_norm": np.ones(H, np.float32),
        "post_norm": np.ones(H, np.float32), "norm": np.ones(H, np.float32),
        "q": lin(Hq * D, 2 * H), "k": lin(Hkv * D, 2 * H), "v": lin(Hkv * D, 2 * H), "o": lin(H, Hq * D) * 0.5,
        "gate": lin(I, H), "up": lin(I, H), "down": lin(H, I) * 0.5, "head": head0.copy(),
    }
    params = jax.tree_util.tree_map(jnp.asarray, params)

    inv = 1.0 / (args.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))

    def rope(x, pos):  # x [B, T, heads, D], pos [T]
        f = jnp.asarray(np.outer(np.arange(W + args.ttt), inv).astype(np.float32))[pos]  # [T, D/2]
        c, s = jnp.cos(f)[None, :, None, :], jnp.sin(f)[None, :, None, :]
        a, b = x[..., : D // 2], x[..., D // 2:]
        return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    def norm(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def layer_in(p, h, tok):  # -> q, k, v of [norm(embed(tok)), norm(h)]
        x = jnp.concatenate([norm(embed[tok], p["in_norm"]), norm(h, p["hid_norm"])], axis=-1)
        B, T = tok.shape
        return ((x @ p["q"].T).reshape(B, T, Hq, D), (x @ p["k"].T).reshape(B, T, Hkv, D),
                (x @ p["v"].T).reshape(B, T, Hkv, D))

    def layer_out(p, h, att):  # residual h + o(att), then the MLP; returns pre-norm output
        r = h + att.reshape(att.shape[0], att.shape[1], Hq * D) @ p["o"].T
        x = norm(r, p["post_norm"])
        return r + (jax.nn.silu(x @ p["gate"].T) * (x @ p["up"].T)) @ p["down"].T

    def attend(q, keys, vals, mask):  # q [B,T,Hq,D], keys [B,S,Hkv,D], mask [T,S]
        g = Hq // Hkv
        k = jnp.repeat(keys, g, axis=2)
        v = jnp.repeat(vals, g, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
        s = jnp.where(mask[None, None], s, -1e30)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)

    T = W - 1 - args.ttt  # origins p with a label for every chained step

    def loss_fn(p, aux_b, tok_b, greedy_b):
        # Step 1 at positions 0..T-1: hidden fc(aux[p]), token tok[p + 1], label greedy[p + 1].
        pos1 = jnp.arange(T)
        h = aux_b[:, :T] @ p["fc"].T
        q, k, v = layer_in(p, h, tok_b[:, 1:T + 1])
        q, k = rope(q, pos1), rope(k, pos1)
        causal = jnp.tril(jnp.ones((T, T), bool))
        out = layer_out(p, h, attend(q, k, v, causal))
        keys, vals, mask = [k], [v], [causal]
        total, accs = 0.0, []
        for j in range(args.ttt):
            if j > 0:
                # Step j + 1 of origin p at position p + j: the previous step's output as hidden,
                # token tok[p + j + 1]; keys: step 1's at positions <= p (what the engine's pass over
                # the target's tokens wrote), and this origin's chain (itself included).
                posj = pos1 + j
                qj, kj, vj = layer_in(p, out, tok_b[:, j + 1:T + j + 1])
                qj, kj = rope(qj, posj), rope(kj, posj)
                eye = jnp.eye(T, dtype=bool)
                keys.append(kj)
                vals.append(vj)
                mask = [causal] + [eye] * j
                out = layer_out(p, out, attend(qj, jnp.concatenate(keys, 1), jnp.concatenate(vals, 1),
                                               jnp.concatenate(mask, 1)))
            logits = norm(out, p["norm"]) @ p["head"].T
            label = greedy_b[:, j + 1:T + j + 1]
            valid = label >= 0
            lp = jax.nn.log_softmax(logits, axis=-1)
            nll = -jnp.take_along_axis(lp, jnp.maximum(label, 0)[..., None], axis=-1)[..., 0]
            ce = jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
            total = total + (0.8 ** j) * ce
            accs.append(jnp.mean(jnp.argmax(logits, -1) == label))  # over all labels: undraftable ones miss
        return total, jnp.stack(accs)

    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10), args.steps, args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    state = opt.init(params)

    @jax.jit
    def train_step(p, st, a, t, g):
        (l, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, a, t, g)
        upd, st = opt.update(grads, st, p)
        return optax.apply_updates(p, upd), st, l, acc

    eval_fn = jax.jit(loss_fn)
    train_idx = np.arange(args.holdout, N)
    held = np.arange(args.holdout)
    log = []
    t0 = time.time()
    for step in range(args.steps):
        b = rng.choice(train_idx, args.batch, replace=False)
        params, state, l, acc = train_step(params, state, jnp.asarray(aux[b]), jnp.asarray(tokens[b]),
                                           jnp.asarray(greedy_d[b]))
        if step % 50 == 0 or step == args.steps - 1:
            hl, hacc = eval_fn(params, jnp.asarray(aux[held]), jnp.asarray(tokens[held]), jnp.asarray(greedy_d[held]))
            entry = {"step": step, "train_loss": float(l), "held_loss": float(hl),
                     "held_acc_per_step": [round(float(x), 4) for x in hacc], "seconds": round(time.time() - t0, 1)}
            log.append(entry)
            print(json.dumps(entry), flush=True)

    os.makedirs(args.out, exist_ok=True)
    p = jax.tree_util.tree_map(np.asarray, params)
    names = {
        "fc.weight": "fc", "midlayer.input_layernorm.weight": "in_norm", "midlayer.hidden_norm.weight": "hid_norm",
        "midlayer.post_attention_layernorm.weight": "post_norm", "norm.weight": "norm",
        "midlayer.self_attn.q_proj.weight": "q", "midlayer.self_attn.k_proj.weight": "k",
        "midlayer.self_attn.v_proj.weight": "v", "midlayer.self_attn.o_proj.weight": "o",
        "midlayer.mlp.gate_proj.weight": "gate", "midlayer.mlp.up_proj.weight": "up",
        "midlayer.mlp.down_proj.weight": "down", "lm_head.weight": "head"}
    tensors = [(n, "BF16", p[k].shape, f32_to_bf16_bits(p[k]).tobytes()) for n, k in sorted(names.items())]
    if Vd < V:  # d2t: draft id i is target id i + d2t[i]
        tensors.append(("d2t", "I64", (Vd,), (ids - np.arange(Vd)).astype(np.int64).tobytes()))
    write_safetensors(os.path.join(args.out, "model.safetensors"), tensors)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": I, "num_hidden_layers": 1, "num_attention_heads": Hq, "num_key_value_heads": Hkv,
        "head_dim": D, "hidden_act": "silu", "rms_norm_eps": eps, "rope_theta": args.rope_theta,
        "rope_scaling": None, "max_position_embeddings": meta["max_position_embeddings"], "vocab_size": V,
        "draft_vocab_size": Vd, "target_hidden_size": H, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": aux_ids},
    }
    json.dump(config, open(os.path.join(args.out, "config.json"), "w"), indent=2)
    json.dump({"args": vars(args), "data": meta, "draft_vocab_coverage": coverage, "log": log}, open(os.path.join(args.out, "train.json"), "w"), indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
