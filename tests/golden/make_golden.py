# Writes the golden cases under tests/golden/data/<case>/ from reference.py: a checkpoint
# (config.json, model.safetensors) with fixed-seed random weights, ids.json, and
# expected.safetensors (logits, loss, grad.<param> of the mean NLL). Runs the reference self-test
# first. Usage: /usr/bin/python3 tests/golden/make_golden.py   (needs python3-torch, python3-numpy)
import json
import math
import os
import struct
import sys

import numpy as np
import torch

sys.dont_write_bytecode = True  # keep __pycache__ out of the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference  # noqa: E402

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
LEV = {"digits": 2, "seed_dim": 4, "knots": 5, "rank": 3, "heads": 2}


def make_config(embedding, attention, mlp, T, step="inverse_T", rope_theta=10000.0, norm_eps=1e-5):
    """A config in the exact MODEL.md §7 format with every key explicit."""
    return {"architecture": "cemlm", "format_version": 1, "vocab_size": 61, "d_model": 16,
            "n_layers": 2, "n_heads": 2, "head_dim": 6, "d_ff": 24, "max_seq_len": 64,
            "norm_eps": norm_eps, "rope_theta": rope_theta, "embedding": embedding,
            "attention": attention, "mlp": mlp,
            "recursion": {"default": T, "max": 8, "step_size": step}, "bos_id": 1, "eos_id": 2}


TABLE_TIED = {"type": "table", "tie_output": True}
TABLE = {"type": "table", "tie_output": False}
LEV_EMB = {"type": "lev", "tie_output": False, "lev": LEV}
STD_ATTN = {"type": "standard", "diag": "none", "precond_rank": 0}
SWIGLU = {"type": "swiglu", "precond_rank": 0}

CASES = {
    "llama_tied": (make_config(TABLE_TIED, STD_ATTN, SWIGLU, 1), 1),
    "cem_none_t2": (make_config(TABLE, {"type": "cem", "diag": "none", "precond_rank": 0},
                                SWIGLU, 2, rope_theta=100.0), 2),
    "cem_shared_precond_t3": (make_config(LEV_EMB, {"type": "cem", "diag": "shared", "precond_rank": 2},
                                          {"type": "cem", "precond_rank": 2}, 3), 3),
    "cem_perhead_unit_t2": (make_config(TABLE, {"type": "cem", "diag": "per_head", "precond_rank": 0},
                                        {"type": "cem", "precond_rank": 0}, 2, step="unit",
                                        rope_theta=100.0, norm_eps=1e-6), 2),
    "lev_std": (make_config(LEV_EMB, STD_ATTN, SWIGLU, 1), 1),
}


def init_value(name, shape, rng):
    """Non-trivial values so every term of the spec contributes (gains ≠ 1, diag ≠ 0, P_v ≠ 0)."""
    def normal(std, mean=0.0):
        return mean + std * rng.standard_normal(shape)

    if name.endswith("norm.weight") or name == "lev.ln_weight":
        return normal(0.2, 1.0)
    if name.endswith("precond.p"):
        return normal(0.3, math.log(math.e - 1))
    if name.endswith("precond.u") or name.endswith("precond.v"):
        return normal(0.2)
    if name == "lev.spline":
        return normal(0.3, 1.0)
    if name in ("embed.weight", "lev.codebooks", "lev.seed_proj", "lev.out_proj", "lm_head.weight"):
        return normal(0.5)
    if name == "lev.ln_bias":
        return normal(0.3)
    return normal(0.3)  # attention and MLP matrices, diag


def write_safetensors(path, tensors):
    """F32 safetensors: u64 LE header length, JSON header (space-padded to 8 bytes), body in order."""
    header, body, offset = {}, [], 0
    for name, value in tensors:
        arr = np.ascontiguousarray(np.asarray(value, dtype="<f4"))
        assert np.all(np.isfinite(arr)), name
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        body.append(arr.tobytes())
        offset += arr.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(b"".join(body))


def rel_err(a, b):
    return ((a - b).abs().max() / max(1.0, b.abs().max().item())).item()


def fp32_rounding_error(cfg, prm, ids, T, logits, grads):
    """How far the same math in float32 lands from float64: the scale of error an fp32
    implementation should expect against these files, printed to size test tolerances."""
    logits32, _, grads32 = reference.loss_and_grads(
        cfg, {n: v.float() for n, v in prm.items()}, torch.from_numpy(ids), T)
    return rel_err(logits32.double(), logits), max(rel_err(grads32[n].double(), g)
                                                   for n, g in grads.items())


def write_case(name, cfg, T, seed):
    rng = np.random.default_rng(seed)
    shapes = reference.param_shapes(cfg)
    f32 = {n: init_value(n, s, rng).astype(np.float32) for n, s in shapes}
    prm = {n: torch.from_numpy(v.astype(np.float64)) for n, v in f32.items()}
    ids = rng.integers(0, cfg["vocab_size"], size=10)
    ids[3] = cfg["vocab_size"] - 1  # the highest id exercises the last LEV digit pattern
    logits, loss, grads = reference.loss_and_grads(cfg, prm, torch.from_numpy(ids), T)
    fp32_err = fp32_rounding_error(cfg, prm, ids, T, logits, grads)

    out = os.path.join(DATA_DIR, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "ids.json"), "w") as f:
        json.dump({"ids": ids.tolist(), "T": T}, f)
        f.write("\n")
    write_safetensors(os.path.join(out, "model.safetensors"), [(n, f32[n]) for n, _ in shapes])
    expected = [("logits", logits.numpy()), ("loss", loss.reshape(1).numpy())]
    expected += [("grad." + n, grads[n].numpy()) for n, _ in shapes]
    write_safetensors(os.path.join(out, "expected.safetensors"), expected)
    print(f"{name}: T={T} loss={loss.item():.6f} |logits|max={logits.abs().max().item():.3f} "
          f"|grad|max={max(g.abs().max().item() for g in grads.values()):.3e} "
          f"fp32 rel err: logits {fp32_err[0]:.1e} grads {fp32_err[1]:.1e}")


def main():
    reference.self_test()
    for seed, (name, (cfg, T)) in enumerate(CASES.items()):
        write_case(name, cfg, T, seed=1000 + seed)


if __name__ == "__main__":
    main()
