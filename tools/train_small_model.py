#!/usr/bin/env python3
"""Trains models/m3-small: a small MiniMax-M3-architecture model, built from HF transformers'
minimax_m3_vl classes, on the project corpus.

  prepare (here, needs `tokenizers`):
      train_small_model.py prepare --tokenizer models/m3-small --out .dev/trained/data
    tokenizes the TRAIN split (all but the last 5% of each corpus file, see
    tools/train_tokenizer.py split_text) and the held-out split into uint16 token streams.
  train (GPU machine: torch, transformers >= 5.17):
      train_small_model.py train --data .dev/trained/data --out $OUT [--minutes 7]
    writes weights.N.safetensors (fp32, HF text-model names `model.*`, `lm_head.weight`;
    the best-validation weights), curve.json (train/val loss), quality.json (held-out
    perplexity and indexer recall), and train.log.

Recipe: next-token cross entropy on random 1024-token windows, AdamW, bf16 autocast over
fp32 master weights, time-based cosine learning-rate schedule, residual dropout in training.
Attention follows HF's math exactly (Gemma QK norms, partial RoPE, GQA, fp32 softmax) and
uses HF's block selection (local block forced, top-k of max-pooled index scores, per KV
group) for the sparse layers; only the first `--dense-fraction` of the time runs the sparse
layers densely (indexer warm-up). The indexer (not differentiable through top-k) learns from
an auxiliary loss per sparse layer: KL(target || softmax(index block scores)) where target
is the stop-gradient dense causal attention probability mass per key block, averaged over
the query heads of each KV group. The local block is excluded on both sides (it is always
selected) and the target is renormalised over the other past blocks; the indexer reads a
detached input so the auxiliary loss trains only the indexer. Expert balance uses
DeepSeek-V3's aux-loss-free update of e_score_correction_bias (bias += rate * sign(mean load
- load)), which only affects selection, as in the architecture.
"""
import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_CONTEXT = 1024

# The text config; export_small_model.py writes it into config.json the way
# MiniMaxM3Config::to_json does (src/model/minimax_m3/config.cpp).
TEXT = dict(
    vocab_size=6144,
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    rotary_dim=32,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    dense_intermediate_size=1024,
    intermediate_size=128,
    shared_intermediate_size=256,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.0,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    swiglu_beta=1.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=13,   # ]~!b[
    eos_token_id=2,    # [e~[
    index_n_heads=2,
    index_head_dim=64,
    index_block_size=32,
    index_topk_blocks=4,
    index_local_blocks=1,
    index_init_blocks=0,
    moe_layer_freq=[0, 1, 1, 1, 1, 1],
    sparse_layer_freq=[0, 1, 1, 1, 1, 1],
)


def _f32(v):
    """The double a C++ float field widens to (to_json writes config.h's float members so)."""
    import struct
    return struct.unpack("<f", struct.pack("<f", v))[0]


def hf_config_dict(text=TEXT):
    """config.json (deployment-shaped, what MiniMaxM3Config::to_json writes)."""
    t = dict(text)
    for key in ("rms_norm_eps", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit", "swiglu_beta"):
        t[key] = _f32(t[key])
    sparse = {
        "use_sparse_attention": True,
        "sparse_attention_freq": t["sparse_layer_freq"],
        "sparse_num_index_heads": t["index_n_heads"],
        "sparse_index_dim": t["index_head_dim"],
        "sparse_block_size": t["index_block_size"],
        "sparse_topk_blocks": t["index_topk_blocks"],
        "sparse_local_block": t["index_local_blocks"],
        "sparse_init_block": t["index_init_blocks"],
        "sparse_score_type": "max",
        "sparse_disable_index_value": t["sparse_layer_freq"],
    }
    text_cfg = {
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "model_type": "minimax_m3_vl_text",
        "vocab_size": t["vocab_size"], "hidden_size": t["hidden_size"],
        "num_hidden_layers": t["num_hidden_layers"], "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"], "head_dim": t["head_dim"],
        "intermediate_size": t["intermediate_size"],
        "shared_intermediate_size": t["shared_intermediate_size"],
        "dense_intermediate_size": t["dense_intermediate_size"],
        "num_local_experts": t["num_local_experts"], "num_experts_per_tok": t["num_experts_per_tok"],
        "n_shared_experts": t["n_shared_experts"], "scoring_func": "sigmoid", "use_routing_bias": True,
        "routed_scaling_factor": t["routed_scaling_factor"], "hidden_act": "swigluoai",
        "swiglu_alpha": t["swiglu_alpha"], "swiglu_limit": t["swiglu_limit"], "swiglu_beta": t["swiglu_beta"],
        "rms_norm_eps": t["rms_norm_eps"], "use_gemma_norm": True, "use_qk_norm": True,
        "qk_norm_type": "per_head", "attention_output_gate": False, "rope_theta": t["rope_theta"],
        "rotary_dim": t["rotary_dim"], "partial_rotary_factor": t["rotary_dim"] / t["head_dim"],
        "max_position_embeddings": t["max_position_embeddings"],
        "tie_word_embeddings": t["tie_word_embeddings"], "bos_token_id": t["bos_token_id"],
        "eos_token_id": t["eos_token_id"], "moe_layer_freq": t["moe_layer_freq"], "num_mtp_modules": 0,
        "sparse_attention_config": sparse,
    }
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 14, "image_size": 56,
              "temporal_patch_size": 2, "spatial_merge_size": 2}
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
        "torch_dtype": "bfloat16", "image_token_index": 200025, "video_token_index": 200026,
        "projector_hidden_size": t["hidden_size"], "tie_word_embeddings": t["tie_word_embeddings"],
        "text_config": text_cfg, "vision_config": vision,
    }


# ----------------------------------------------------------------------------- prepare

def cmd_prepare(args):
    import numpy as np
    from tokenizers import Tokenizer
    sys.path.insert(0, HERE)
    import train_tokenizer as tt
    tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    bos = tok.token_to_id(tt.BOS)
    eos = tok.token_to_id(tt.EOS)
    os.makedirs(args.out, exist_ok=True)
    meta = {"files": {}, "bos": bos, "eos": eos}
    streams = {"train": [], "val": []}
    for name, parts in tt.read_splits(args.corpus or tt.default_corpus_dir()).items():
        for split, text in zip(("train", "val"), parts):
            ids = tok.encode(text).ids
            # Each split of each file is one document: ]~!b[ text [e~[
            streams[split] += [bos] + ids + [eos]
            meta["files"].setdefault(name, {})[split] = {"chars": len(text), "tokens": len(ids)}
    for split, ids in streams.items():
        arr = np.asarray(ids, dtype=np.uint16)
        arr.tofile(os.path.join(args.out, split + ".bin"))
        meta[split + "_tokens"] = int(arr.size)
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta, indent=1))
    return 0


# ----------------------------------------------------------------------------- model

def build_model(device):
    import torch
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM
    cfg = MiniMaxM3VLConfig(**hf_config_dict())
    text = cfg.text_config
    text._attn_implementation = "eager"
    assert text.layer_types[1] == "minimax_m3_sparse" and text.mlp_layer_types[1] == "sparse"
    assert text.index_topk_blocks == TEXT["index_topk_blocks"] and text.index_block_size == TEXT["index_block_size"]
    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM(text).to(device=device, dtype=torch.float32)
    rot = 2 * model.model.rotary_emb.inv_freq.numel()
    assert rot == TEXT["rotary_dim"], f"HF rotary width {rot}"
    # Residual-branch output projections scaled down (GPT-2 style) for a stable start.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1 / math.sqrt(2 * TEXT["num_hidden_layers"]))
    return model


def index_block_scores(indexer, x, cos, sin):
    """HF MiniMaxM3VLIndexer.forward up to the block max-pool: [B, H_idx, T, NB] (future -inf)."""
    import torch
    import torch.nn.functional as F
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb
    B, T, _ = x.shape
    q = indexer.q_norm(indexer.q_proj(x).view(B, T, -1, indexer.head_dim)).transpose(1, 2)
    k = indexer.k_norm(indexer.k_proj(x).view(B, T, 1, indexer.head_dim)).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos[..., :indexer.head_dim], sin[..., :indexer.head_dim])
    s = torch.matmul(q.float(), k.float().transpose(-1, -2))  # [B, H, T, T]
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    s = s.masked_fill(future, float("-inf"))
    bs = indexer.block_size
    nb = -(-T // bs)
    if nb * bs != T:
        s = F.pad(s, (0, nb * bs - T), value=float("-inf"))
    return s.view(B, s.shape[1], T, nb, bs).amax(-1)


def select_blocks(indexer, block_scores):
    """HF's selection as a keep mask [B, H_idx, T, NB]: local block forced, top-k, no future."""
    import torch
    B, H, T, nb = block_scores.shape
    q_block = torch.arange(T, device=block_scores.device) // indexer.block_size
    sc = block_scores.detach().clone()
    sc.scatter_(-1, q_block.view(1, 1, T, 1).expand(B, H, T, 1), float("inf"))
    k = min(indexer.topk_blocks, nb)
    top_s, top_i = sc.topk(k, dim=-1)
    keep = torch.zeros_like(sc, dtype=torch.bool)
    keep.scatter_(-1, top_i, top_s > float("-inf"))
    return keep


def forward(model, ids, dense_attention=False, dropout=0.0, want_stats=False, cos_sin=None):
    """Returns (logits, index_kl list, stats). stats per sparse layer when want_stats."""
    import torch
    import torch.nn.functional as F
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb
    tm = model.model
    B, T = ids.shape
    h = tm.embed_tokens(ids)
    pos = torch.arange(T, device=ids.device)[None]
    cos, sin = cos_sin if cos_sin is not None else tm.rotary_emb(h, pos)
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    kls, stats = [], []
    for layer in tm.layers:
        attn = layer.self_attn
        D = attn.head_dim
        G = TEXT["num_key_value_heads"]
        x = layer.input_layernorm(h)
        q = attn.q_norm(attn.q_proj(x).view(B, T, -1, D)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(B, T, -1, D)).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, -1, D).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        H = q.shape[1]
        kr = k.repeat_interleave(H // G, dim=1)
        vr = v.repeat_interleave(H // G, dim=1)
        s = torch.matmul(q, kr.transpose(-1, -2)).float() * attn.scaling  # [B, H, T, T]
        mask = causal[None, None]
        if attn.indexer is not None:
            ix = attn.indexer
            bsz = ix.block_size
            nb = -(-T // bsz)
            bscore = index_block_scores(ix, x.detach(), cos, sin)  # [B, G, T, NB], grads to indexer
            keep = select_blocks(ix, bscore)
            with torch.no_grad():
                p = torch.softmax(s.detach().masked_fill(~causal, float("-inf")), dim=-1)
                p = p.view(B, G, H // G, T, T).mean(2)                       # per KV group
                if nb * bsz != T:
                    p = F.pad(p, (0, nb * bsz - T))
                mass = p.view(B, G, T, nb, bsz).sum(-1)                      # [B, G, T, NB]
                q_block = torch.arange(T, device=ids.device) // bsz
                blk = torch.arange(nb, device=ids.device)
                past = blk[None, :] < q_block[:, None]                       # [T, NB] non-local past
                rows = past.any(-1)                                          # rows with >= 1 past block
                tgt = mass * past
                tgt_sum = tgt.sum(-1, keepdim=True)
                tgt = tgt / tgt_sum.clamp_min(1e-20)
            if rows.any():
                logit = bscore.masked_fill(~past, float("-inf"))[:, :, rows]  # [B, G, R, NB]
                logp = torch.log_softmax(logit, dim=-1)
                t = tgt[:, :, rows]
                kl = (t * (torch.log(t.clamp_min(1e-20)) - logp.masked_fill(~past[rows], 0.0))).sum(-1)
                kls.append(kl.mean())
            if want_stats:
                with torch.no_grad():
                    sel_mass = (mass * keep).sum(-1)                          # recall of the selection
                    n_valid = (q_block + 1).float()                          # [T]
                    k_sel = torch.clamp(n_valid, max=ix.topk_blocks)
                    local_mass = mass.gather(-1, q_block.view(1, 1, T, 1).expand(B, G, T, 1)).squeeze(-1)
                    rest = mass.sum(-1) - local_mass
                    rand = local_mass + rest * ((k_sel - 1) / (n_valid - 1).clamp_min(1))
                    sparse_rows = n_valid > ix.topk_blocks
                    stats.append({"recall": sel_mass[:, :, sparse_rows].mean().item(),
                                  "random": rand[:, :, sparse_rows].mean().item(),
                                  "rows": int(sparse_rows.sum().item()) * B * G})
            if not dense_attention:
                km = keep.repeat_interleave(bsz, dim=-1)[..., :T]           # [B, G, T, T]
                mask = (km & causal).repeat_interleave(H // G, dim=1)
        s = s.masked_fill(~mask, torch.finfo(torch.float32).min)
        a = torch.softmax(s, dim=-1).to(q.dtype)
        o = torch.matmul(a, vr).transpose(1, 2).reshape(B, T, -1)
        o = attn.o_proj(o)
        if dropout:
            o = F.dropout(o, dropout, training=True)
        h = h + o
        m = layer.mlp(layer.post_attention_layernorm(h))
        if dropout:
            m = F.dropout(m, dropout, training=True)
        h = h + m
    h = tm.norm(h)
    return model.lm_head(h), kls, stats


# ----------------------------------------------------------------------------- train

def save_weights(state, out_dir, max_bytes=12 << 20):
    from safetensors.torch import save_file
    shard, size, n = {}, 0, 0
    names = sorted(state)
    for i, name in enumerate(names):
        t = state[name].detach().float().cpu().contiguous()
        shard[name] = t
        size += t.numel() * 4
        nxt = state[names[i + 1]].numel() * 4 if i + 1 < len(names) else 0
        if i + 1 == len(names) or size + nxt > max_bytes:
            save_file(shard, os.path.join(out_dir, f"weights.{n}.safetensors"))
            shard, size, n = {}, 0, n + 1


def cmd_train(args):
    import numpy as np
    import torch
    import torch.nn.functional as F
    t_start = time.time()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    os.makedirs(args.out, exist_ok=True)
    log_f = open(os.path.join(args.out, "train.log"), "w")

    def log(*a):
        msg = " ".join(str(x) for x in a)
        print(msg, flush=True)
        log_f.write(msg + "\n")
        log_f.flush()

    train = torch.from_numpy(np.fromfile(os.path.join(args.data, "train.bin"), dtype=np.uint16).astype(np.int64))
    val = torch.from_numpy(np.fromfile(os.path.join(args.data, "val.bin"), dtype=np.uint16).astype(np.int64))
    T = args.context
    n_val = val.numel() // T if args.val_windows <= 0 else min(args.val_windows, val.numel() // T)
    val_x = val[: n_val * T].view(n_val, T).to(dev)
    val_y = val[1: n_val * T + 1].view(n_val, T).to(dev)
    train = train.to(dev)
    model = build_model(dev)
    if args.init:
        from safetensors.torch import load_file
        sd = {}
        for f in sorted(os.listdir(args.init)):
            if f.startswith("weights.") and f.endswith(".safetensors"):
                sd.update(load_file(os.path.join(args.init, f)))
        missing, unexpected = model.load_state_dict(sd, strict=False)
        log("init from", args.init, "missing", missing, "unexpected", unexpected)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"device {dev} params {n_params} train tokens {train.numel()} val tokens {n_val * T}")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "indexer" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "indexer" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    routers = [l.mlp.gate for l in model.model.layers if hasattr(l.mlp, "gate")]
    loads = {id(r): torch.zeros(r.num_experts, device=dev) for r in routers}

    def hook(mod, inp, out):
        if model.training:
            loads[id(mod)] += torch.bincount(out[2].reshape(-1), minlength=mod.num_experts).float()
    hooks = [r.register_forward_hook(hook) for r in routers]
    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    budget = args.minutes * 60.0
    curve = {"step": [], "tokens": [], "train_loss": [], "index_kl": [], "val": []}
    best = (float("inf"), None, -1)

    @torch.no_grad()
    def evaluate(dense=False, stats=False):
        model.eval()
        tot, n, st = 0.0, 0, []
        for i in range(0, n_val, args.batch):
            with amp:
                logits, _, s = forward(model, val_x[i:i + args.batch], dense_attention=dense, want_stats=stats)
            tot += F.cross_entropy(logits.float().view(-1, logits.shape[-1]), val_y[i:i + args.batch].reshape(-1),
                                   reduction="sum").item()
            n += val_y[i:i + args.batch].numel()
            st.append(s)
        model.train()
        return tot / n, st

    step, tokens = 0, 0
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    t0 = time.time()
    run_loss, run_kl, run_n = 0.0, 0.0, 0
    while True:
        elapsed = time.time() - t0
        frac = elapsed / budget
        if frac >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        warm = min(1.0, (step + 1) / args.warmup)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train.numel() - T - 1, (args.batch,), device=dev, generator=gen)
        idx = starts[:, None] + torch.arange(T + 1, device=dev)[None]
        chunk = train[idx]
        x, y = chunk[:, :-1], chunk[:, 1:]
        dense = frac < args.dense_fraction
        with amp:
            logits, kls, _ = forward(model, x, dense_attention=dense, dropout=args.dropout)
            lm = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
            kl = torch.stack(kls).mean() if kls else torch.zeros((), device=dev)
            loss = lm + args.index_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing (DeepSeek-V3)
            for r in routers:
                ld = loads[id(r)]
                r.e_score_correction_bias += args.bias_rate * torch.sign(ld.mean() - ld)
                ld.zero_()
        step += 1
        tokens += x.numel()
        run_loss += lm.item()
        run_kl += kl.item()
        run_n += 1
        if step % args.eval_every == 0 or step == 1:
            vl, _ = evaluate()
            curve["step"].append(step)
            curve["tokens"].append(tokens)
            curve["train_loss"].append(run_loss / run_n)
            curve["index_kl"].append(run_kl / run_n)
            curve["val"].append(vl)
            log(f"step {step} tok {tokens} t {time.time() - t0:.0f}s lr {lr:.2e} dense {dense} "
                f"train {run_loss / run_n:.4f} kl {run_kl / run_n:.4f} val {vl:.4f} ppl {math.exp(vl):.2f}")
            run_loss, run_kl, run_n = 0.0, 0.0, 0
            if vl < best[0] and not dense:
                best = (vl, {k: v.detach().clone() for k, v in model.state_dict().items()}, step)
    for h_ in hooks:
        h_.remove()
    vl, _ = evaluate()
    curve["step"].append(step)
    curve["tokens"].append(tokens)
    curve["train_loss"].append(run_loss / max(run_n, 1))
    curve["index_kl"].append(run_kl / max(run_n, 1))
    curve["val"].append(vl)
    log(f"final step {step} val {vl:.4f}")
    if best[1] is not None and best[0] < vl:
        model.load_state_dict(best[1])
        log(f"restored best step {best[2]} val {best[0]:.4f}")
    with open(os.path.join(args.out, "curve.json"), "w") as f:
        json.dump(curve, f)
    save_weights(model.state_dict(), args.weights_out or args.out)  # before the evaluation, in case it fails
    # Held-out quality: sparse (the real model) vs dense attention, and indexer recall.
    vl_sparse, st = evaluate(stats=True)
    vl_dense, _ = evaluate(dense=True)
    n_sparse = len(st[0])
    per_layer = []
    sparse_layers = [i for i, f in enumerate(TEXT["sparse_layer_freq"]) if f]
    for li in range(n_sparse):
        w = sum(b[li]["rows"] for b in st)
        rec = sum(b[li]["recall"] * b[li]["rows"] for b in st) / w
        rnd = sum(b[li]["random"] * b[li]["rows"] for b in st) / w
        per_layer.append({"layer": sparse_layers[li], "recall": rec, "random": rnd})
    # Expert load on held-out text.
    load_eval = {id(r): torch.zeros(r.num_experts, device=dev) for r in routers}
    def eval_hook(mod, inp, out):
        load_eval[id(mod)] += torch.bincount(out[2].reshape(-1), minlength=mod.num_experts).float()
    hooks = [r.register_forward_hook(eval_hook) for r in routers]
    evaluate()
    for h_ in hooks:
        h_.remove()
    quality = {
        "params": n_params, "steps": step, "tokens": tokens, "best_step": best[2],
        "val_loss": vl_sparse, "val_ppl": math.exp(vl_sparse),
        "val_loss_dense_attention": vl_dense, "val_ppl_dense_attention": math.exp(vl_dense),
        "val_tokens": n_val * T, "context": T,
        "indexer_recall": per_layer,
        "expert_load": [(load_eval[id(r)] / load_eval[id(r)].sum()).tolist() for r in routers],
        "e_score_correction_bias": [r.e_score_correction_bias.tolist() for r in routers],
        "wall_s": time.time() - t_start, "train_s": time.time() - t0,
        "args": vars(args),
    }
    log(json.dumps({k: quality[k] for k in ("val_loss", "val_ppl", "val_loss_dense_attention", "indexer_recall")}))
    with open(os.path.join(args.out, "quality.json"), "w") as f:
        json.dump(quality, f, indent=1)
    log("saved; total", time.time() - t_start, "s")
    return 0


def cmd_plot(args):
    """curve.json -> a dependency-free SVG line chart (train and held-out loss vs tokens)."""
    with open(args.curve) as f:
        c = json.load(f)
    W, H, L, R, T, B = 640, 360, 60, 20, 20, 50
    xs = [t / 1e6 for t in c["tokens"]]
    series = [("train", c["train_loss"], "#1f77b4"), ("held-out", c["val"], "#d62728")]
    y_lo, y_hi = 2.5, 9.0
    x_hi = max(xs)

    def px(x):
        return L + (W - L - R) * x / x_hi

    def py(y):
        return T + (H - T - B) * (y_hi - min(max(y, y_lo), y_hi)) / (y_hi - y_lo)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>']
    for y in range(3, 10):
        out.append(f'<line x1="{L}" y1="{py(y):.1f}" x2="{W - R}" y2="{py(y):.1f}" stroke="#ddd"/>'
                   f'<text x="{L - 8}" y="{py(y) + 4:.1f}" text-anchor="end">{y}</text>')
    step = 2 if x_hi <= 20 else 5
    for x in range(0, int(x_hi) + 1, step):
        out.append(f'<line x1="{px(x):.1f}" y1="{T}" x2="{px(x):.1f}" y2="{H - B}" stroke="#eee"/>'
                   f'<text x="{px(x):.1f}" y="{H - B + 16}" text-anchor="middle">{x}</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">training tokens (millions)</text>')
    out.append(f'<text x="16" y="{(T + H - B) / 2}" transform="rotate(-90 16 {(T + H - B) / 2})" '
               f'text-anchor="middle">cross-entropy (nats/token)</text>')
    for i, (name, ys, color) in enumerate(series):
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>')
        out.append(f'<text x="{W - R - 110}" y="{T + 18 + 16 * i}" fill="{color}">{name}</text>')
    if args.best_step:
        k = c["step"].index(args.best_step)
        out.append(f'<circle cx="{px(xs[k]):.1f}" cy="{py(c["val"][k]):.1f}" r="4" fill="#d62728"/>'
                   f'<text x="{px(xs[k]) + 6:.1f}" y="{py(c["val"][k]) - 8:.1f}">kept: step {args.best_step}, '
                   f'{c["val"][k]:.3f}</text>')
    out.append("</svg>")
    with open(args.out, "w") as f:
        f.write("\n".join(out) + "\n")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("plot")
    g.add_argument("--curve", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--best-step", type=int, default=0)
    p = sub.add_parser("prepare")
    p.add_argument("--tokenizer", default=os.path.join(os.path.dirname(HERE), "models", "m3-small"))
    p.add_argument("--corpus", default=None)
    p.add_argument("--out", required=True)
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--weights-out", default=None, help="where weights.N.safetensors go (default: --out)")
    t.add_argument("--init", default=None, help="resume from a folder of weights.N.safetensors")
    t.add_argument("--minutes", type=float, default=7.0)
    t.add_argument("--max-steps", type=int, default=0)
    t.add_argument("--context", type=int, default=TRAIN_CONTEXT)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--wd", type=float, default=0.1)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--dropout", type=float, default=0.1)
    t.add_argument("--dense-fraction", type=float, default=0.05)
    t.add_argument("--index-weight", type=float, default=1.0)
    t.add_argument("--bias-rate", type=float, default=1e-3)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--val-windows", type=int, default=0, help="0 = the whole held-out split")
    t.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    return {"prepare": cmd_prepare, "train": cmd_train, "plot": cmd_plot}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
