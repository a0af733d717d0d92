# Independent float64 reference of the model in ../shared/spec/MODEL.md (beside the repository;
# sections cited below), written from the spec alone so the C++ engine and trainer can be checked
# against it.
# `python3 reference.py` runs the self-tests (spec identities, energy gradients, finite differences).
# Needs torch (Debian: python3-torch); only make_golden.py and the self-tests import it.
import math

import torch

torch.set_default_dtype(torch.float64)


# ---------------------------------------------------------------- config helpers (§7, §8)

def lev_base(vocab_size, digits):
    """Smallest b with b**digits >= vocab_size (§6.2)."""
    b = 1
    while b ** digits < vocab_size:
        b += 1
    return b


def param_shapes(cfg):
    """Ordered (name, shape) list for a config dict in the exact §7 format (§8 table order)."""
    V, D, F = cfg["vocab_size"], cfg["d_model"], cfg["d_ff"]
    H, dh = cfg["n_heads"], cfg["head_dim"]
    Q = H * dh
    emb, attn, mlp = cfg["embedding"], cfg["attention"], cfg["mlp"]
    out = []
    if emb["type"] == "table":
        out.append(("embed.weight", [V, D]))
    else:
        lv = emb["lev"]
        k, s, kn, r, nh = lv["digits"], lv["seed_dim"], lv["knots"], lv["rank"], lv["heads"]
        out += [("lev.codebooks", [k, lev_base(V, k), s]), ("lev.seed_proj", [nh, s, s]),
                ("lev.ln_weight", [nh, s]), ("lev.ln_bias", [nh, s]),
                ("lev.spline", [nh, s, kn, r]), ("lev.out_proj", [nh, r, D])]

    def precond(prefix, r):
        return [] if r == 0 else [(prefix + ".precond.p", [D]), (prefix + ".precond.u", [D, r]),
                                  (prefix + ".precond.v", [D, r])]

    for l in range(cfg["n_layers"]):
        p = f"layers.{l}"
        out += [(p + ".attn_norm.weight", [D]), (p + ".attn.wq", [Q, D]), (p + ".attn.wk", [Q, D])]
        if attn["type"] == "standard":
            out += [(p + ".attn.wv", [Q, D]), (p + ".attn.wo", [D, Q])]
        else:
            if attn["diag"] == "shared":
                out.append((p + ".attn.diag", [D]))
            elif attn["diag"] == "per_head":
                out.append((p + ".attn.diag", [H, D]))
            out += precond(p + ".attn", attn["precond_rank"])
        out += [(p + ".mlp_norm.weight", [D]), (p + ".mlp.w_gate", [F, D]), (p + ".mlp.w_up", [F, D])]
        if mlp["type"] == "swiglu":
            out.append((p + ".mlp.w_down", [D, F]))
        else:
            out += precond(p + ".mlp", mlp["precond_rank"])
    out.append(("final_norm.weight", [D]))
    if not emb["tie_output"]:
        out.append(("lm_head.weight", [V, D]))
    return out


def step_size(cfg, T):
    """η of §4.4."""
    return 1.0 / T if cfg["recursion"]["step_size"] == "inverse_T" else 1.0


# ---------------------------------------------------------------- building blocks (§1, §2)

def rmsnorm(x, g, eps):
    return g * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rope(v, pos, theta, sign=1.0):
    """R_p (sign=+1) or R_p^T = R_{-p} (sign=-1) on the last dim of v [N, H, d_h]; pos [N]."""
    dh = v.shape[-1]
    half = dh // 2
    m = torch.arange(half, dtype=v.dtype)
    freq = theta ** (-2.0 * m / dh)
    ang = sign * pos.to(v.dtype)[:, None] * freq[None, :]             # [N, half]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    lo, hi = v[..., :half], v[..., half:]
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)


def causal_softmax(s):
    """softmax over j <= i of s[..., i, j]."""
    n = s.shape[-1]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)


def precond_apply(u, prm, prefix):
    """P(u) of §4.3 on rows of u [N, D]; identity when the layer has no preconditioner."""
    if prefix + ".precond.p" not in prm:
        return u
    p, Pu, Pv = prm[prefix + ".precond.p"], prm[prefix + ".precond.u"], prm[prefix + ".precond.v"]
    return torch.nn.functional.softplus(p) * u + (u @ Pv) @ Pu.T + (u @ Pu) @ Pv.T


def heads(x, H):
    return x.reshape(x.shape[0], H, -1)


# ---------------------------------------------------------------- attention (§4)

def attn_standard(cfg, prm, l, h):
    H, eps, theta = cfg["n_heads"], cfg["norm_eps"], cfg["rope_theta"]
    pre = f"layers.{l}.attn"
    tau = math.sqrt(cfg["head_dim"])
    pos = torch.arange(h.shape[0])
    c = rmsnorm(h, prm[f"layers.{l}.attn_norm.weight"], eps)
    q = rope(heads(c @ prm[pre + ".wq"].T, H), pos, theta)
    k = rope(heads(c @ prm[pre + ".wk"].T, H), pos, theta)
    v = heads(c @ prm[pre + ".wv"].T, H)
    p = causal_softmax(torch.einsum("ihd,jhd->hij", q, k) / tau)
    o = torch.einsum("hij,jhd->ihd", p, v).reshape(h.shape[0], -1)
    return h + o @ prm[pre + ".wo"].T


def cem_attn_direction(cfg, prm, l, y, c, kappa):
    """u_i of §4.2 for queries y [N, D] against the fixed context c and keys kappa [N, H, d_h].
    Returns (u, scores s [H, N, N], probabilities p)."""
    H, theta, diag = cfg["n_heads"], cfg["rope_theta"], cfg["attention"]["diag"]
    pre = f"layers.{l}.attn"
    tau = math.sqrt(cfg["head_dim"])
    pos = torch.arange(y.shape[0])
    wq = prm[pre + ".wq"]
    q = rope(heads(y @ wq.T, H), pos, theta)
    s = torch.einsum("ihd,jhd->hij", q, kappa) / tau
    if diag == "shared":
        s = s + ((prm[pre + ".diag"] * y) @ c.T / tau)[None]
    elif diag == "per_head":
        s = s + torch.einsum("kd,id,jd->kij", prm[pre + ".diag"], y, c) / tau
    p = causal_softmax(s)
    a = rope(torch.einsum("hij,jhd->ihd", p, kappa), pos, theta, sign=-1.0)
    u = a.reshape(y.shape[0], -1) @ wq
    if diag == "shared":
        u = u + prm[pre + ".diag"] * (p.sum(0) @ c)
    elif diag == "per_head":
        u = u + torch.einsum("kd,kij,jd->id", prm[pre + ".diag"], p, c)
    return u, s, p


def cem_attn_context(cfg, prm, l, h):
    """The fixed context c and rotated keys kappa of one CEM attention sub-layer."""
    c = rmsnorm(h, prm[f"layers.{l}.attn_norm.weight"], cfg["norm_eps"])
    kappa = rope(heads(c @ prm[f"layers.{l}.attn.wk"].T, cfg["n_heads"]),
                 torch.arange(h.shape[0]), cfg["rope_theta"])
    return c, kappa


def attn_cem(cfg, prm, l, h, T):
    g = prm[f"layers.{l}.attn_norm.weight"]
    c, kappa = cem_attn_context(cfg, prm, l, h)
    eta = step_size(cfg, T)
    x = h
    for _ in range(T):
        y = rmsnorm(x, g, cfg["norm_eps"])
        u, _, _ = cem_attn_direction(cfg, prm, l, y, c, kappa)
        x = x + eta * precond_apply(u, prm, f"layers.{l}.attn")
    return x


# ---------------------------------------------------------------- MLP (§5)

def mlp_swiglu(cfg, prm, l, h):
    pre = f"layers.{l}.mlp"
    c = rmsnorm(h, prm[f"layers.{l}.mlp_norm.weight"], cfg["norm_eps"])
    z = torch.nn.functional.silu(c @ prm[pre + ".w_gate"].T) * (c @ prm[pre + ".w_up"].T)
    return h + z @ prm[pre + ".w_down"].T


def mlp_cem(cfg, prm, l, h, T):
    pre = f"layers.{l}.mlp"
    gain = prm[f"layers.{l}.mlp_norm.weight"]
    w_up = prm[pre + ".w_up"]
    c = rmsnorm(h, gain, cfg["norm_eps"])
    gate = torch.nn.functional.silu(c @ prm[pre + ".w_gate"].T)
    eta = step_size(cfg, T)
    x = h
    for _ in range(T):
        y = rmsnorm(x, gain, cfg["norm_eps"])
        x = x + eta * precond_apply((gate * (y @ w_up.T)) @ w_up, prm, pre)
    return x


# ---------------------------------------------------------------- embeddings (§6)

def bspline2(x):
    ax = x.abs()
    inner = 0.75 - x * x
    outer = 0.5 * (1.5 - ax) ** 2
    return torch.where(ax < 0.5, inner, torch.where(ax < 1.5, outer, torch.zeros_like(x)))


def lev_embed(cfg, prm, ids):
    lv = cfg["embedding"]["lev"]
    k, kn, nh = lv["digits"], lv["knots"], lv["heads"]
    b = lev_base(cfg["vocab_size"], k)
    digits = [(ids // b ** (k - 1 - j)) % b for j in range(k)]
    C = prm["lev.codebooks"]
    z = sum(C[j][digits[j]] for j in range(k))                           # [N, s]
    knots = torch.arange(kn, dtype=z.dtype) / (kn - 1)
    out = 0
    for hd in range(nh):
        u = z @ prm["lev.seed_proj"][hd].T
        mu = u.mean(-1, keepdim=True)
        var = ((u - mu) ** 2).mean(-1, keepdim=True)
        y = prm["lev.ln_weight"][hd] * (u - mu) / torch.sqrt(var + 1e-5) + prm["lev.ln_bias"][hd]
        zeta = torch.sigmoid(y)                                           # [N, s]
        w = bspline2((zeta[..., None] - knots) * (kn - 1))                # [N, s, κ]
        B = w / w.sum(-1, keepdim=True)
        phi = torch.einsum("ndq,dqc->ndc", B, prm["lev.spline"][hd])      # [N, s, r]
        M = phi.prod(dim=1)                                               # [N, r]
        out = out + M @ prm["lev.out_proj"][hd]
    return out


def embed(cfg, prm, ids):
    if cfg["embedding"]["type"] == "table":
        return prm["embed.weight"][ids]
    return lev_embed(cfg, prm, ids)


# ---------------------------------------------------------------- model (§3)

def forward(cfg, prm, ids, T):
    """Logits [N, V] for token ids (a LongTensor [N]) at recursion depth T."""
    h = embed(cfg, prm, ids)
    for l in range(cfg["n_layers"]):
        if cfg["attention"]["type"] == "standard":
            h = attn_standard(cfg, prm, l, h)
        else:
            h = attn_cem(cfg, prm, l, h, T)
        if cfg["mlp"]["type"] == "swiglu":
            h = mlp_swiglu(cfg, prm, l, h)
        else:
            h = mlp_cem(cfg, prm, l, h, T)
    head = prm["embed.weight"] if cfg["embedding"]["tie_output"] else prm["lm_head.weight"]
    return rmsnorm(h, prm["final_norm.weight"], cfg["norm_eps"]) @ head.T


def mean_nll(logits, ids):
    return -torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None]).mean()


def loss_and_grads(cfg, prm, ids, T):
    """(logits, loss, {name: dNLL/dparam}) with autograd; prm values are detached copies."""
    leaves = {n: v.detach().clone().requires_grad_(True) for n, v in prm.items()}
    logits = forward(cfg, leaves, ids, T)
    loss = mean_nll(logits, ids)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return logits.detach(), loss.detach(), dict(zip(leaves.keys(), grads))


# ---------------------------------------------------------------- self-tests

def _tiny_cfg(**over):
    cfg = {"architecture": "cemlm", "format_version": 1, "vocab_size": 61, "d_model": 16,
           "n_layers": 2, "n_heads": 2, "head_dim": 6, "d_ff": 24, "max_seq_len": 64,
           "norm_eps": 1e-5, "rope_theta": 100.0,
           "embedding": {"type": "table", "tie_output": False},
           "attention": {"type": "cem", "diag": "none", "precond_rank": 0},
           "mlp": {"type": "cem", "precond_rank": 0},
           "recursion": {"default": 1, "max": 8, "step_size": "inverse_T"},
           "bos_id": 1, "eos_id": 2}
    for key, val in over.items():
        if isinstance(val, dict):
            cfg[key] = {**cfg[key], **val}
        else:
            cfg[key] = val
    return cfg


def _rand_params(cfg, gen):
    return {n: torch.randn(s, generator=gen) * 0.4 + (1.0 if "norm" in n else 0.0)
            for n, s in param_shapes(cfg)}


def _close(a, b, tol, what):
    err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
    assert err < tol, f"{what}: rel err {err:.3e} >= {tol:.0e}"
    print(f"  ok  {what}  (rel err {err:.1e})")


def _rope_matrix(p, dh, theta):
    eye = torch.eye(dh)[:, None, :]                       # dh basis vectors as [dh, 1, dh]
    return rope(eye, torch.full((dh,), p), theta).squeeze(1).T


def selftest_rope():
    R3, Rm3 = _rope_matrix(3, 6, 100.0), _rope_matrix(-3, 6, 100.0)
    _close(R3.T @ R3, torch.eye(6), 1e-12, "RoPE R_p orthogonal")
    _close(R3.T, Rm3, 1e-12, "RoPE R_p^T = R_{-p}")
    R5, R2 = _rope_matrix(5, 6, 100.0), _rope_matrix(2, 6, 100.0)
    _close(R3.T @ R5, R2, 1e-12, "RoPE R_i^T R_j = R_{j-i}")


def selftest_precond(gen):
    """§4.3: P is the symmetric matrix diag(softplus p) + P_u P_v^T + P_v P_u^T."""
    cfg = _tiny_cfg(attention={"precond_rank": 3})
    prm = _rand_params(cfg, gen)
    p, Pu, Pv = (prm["layers.0.attn.precond." + x] for x in "puv")
    M = torch.diag(torch.log1p(torch.exp(p))) + Pu @ Pv.T + Pv @ Pu.T
    u = torch.randn(5, cfg["d_model"], generator=gen)
    _close(precond_apply(u, prm, "layers.0.attn"), u @ M.T, 1e-12, "precond P(u) == explicit matrix")


def selftest_cem_equals_mha(gen):
    """§4.2: T=1, diag none, no preconditioner is MHA with W_V=W_K, W_O=W_Q^T, values rotated by
    their position and the output rotated back. The MHA here is an explicit per-position loop."""
    cfg = _tiny_cfg()
    prm = _rand_params(cfg, gen)
    N, H, dh = 7, cfg["n_heads"], cfg["head_dim"]
    h = torch.randn(N, cfg["d_model"], generator=gen)
    got = attn_cem(cfg, prm, 0, h, 1)
    g, wq, wk = prm["layers.0.attn_norm.weight"], prm["layers.0.attn.wq"], prm["layers.0.attn.wk"]
    want = torch.empty_like(h)
    for i in range(N):
        ci = h[i] * g / torch.sqrt((h[i] ** 2).mean() + cfg["norm_eps"])
        concat = []
        for k in range(H):
            rows = slice(k * dh, (k + 1) * dh)
            Ri = _rope_matrix(i, dh, cfg["rope_theta"])
            q = Ri @ (wq[rows] @ ci)
            keys, vals = [], []
            for j in range(i + 1):
                cj = h[j] * g / torch.sqrt((h[j] ** 2).mean() + cfg["norm_eps"])
                kj = _rope_matrix(j, dh, cfg["rope_theta"]) @ (wk[rows] @ cj)
                keys.append(q @ kj / math.sqrt(dh))
                vals.append(kj)
            p = torch.softmax(torch.stack(keys), 0)
            concat.append(Ri.T @ (p[:, None] * torch.stack(vals)).sum(0))
        want[i] = h[i] + wq.T @ torch.cat(concat)
    _close(got, want, 1e-12, "CEM attn T=1 diag none r=0 == MHA(W_V=W_K, W_O=W_Q^T, rotated V)")


def _energy_attn(cfg, prm, l, i, y, c):
    """E_i(y) of §4.2 built from the explicit matrices A_k = diag(d_k) + W_Qk^T R_i^T R_j W_Kk."""
    H, dh, D = cfg["n_heads"], cfg["head_dim"], cfg["d_model"]
    tau = math.sqrt(dh)
    diag = cfg["attention"]["diag"]
    wq, wk = prm[f"layers.{l}.attn.wq"], prm[f"layers.{l}.attn.wk"]
    E = 0
    for k in range(H):
        rows = slice(k * dh, (k + 1) * dh)
        dk = torch.zeros(D) if diag == "none" else (
            prm[f"layers.{l}.attn.diag"] if diag == "shared" else prm[f"layers.{l}.attn.diag"][k])
        Ri = _rope_matrix(i, dh, cfg["rope_theta"])
        logits = []
        for j in range(i + 1):
            Rj = _rope_matrix(j, dh, cfg["rope_theta"])
            A = torch.diag(dk) + wq[rows].T @ Ri.T @ Rj @ wk[rows]
            logits.append(y @ A @ c[j] / tau)
        E = E - tau * torch.logsumexp(torch.stack(logits), 0)
    return E


def selftest_cem_attn_energy(gen):
    """u_i (the update direction) equals −∇_y E_i, by autograd of the explicit energy and by
    central finite differences, for every diag mode."""
    for diag in ("none", "shared", "per_head"):
        cfg = _tiny_cfg(attention={"diag": diag})
        prm = _rand_params(cfg, gen)
        N = 6
        h = torch.randn(N, cfg["d_model"], generator=gen)
        c, kappa = cem_attn_context(cfg, prm, 0, h)
        y = torch.randn(N, cfg["d_model"], generator=gen)
        u, s, _ = cem_attn_direction(cfg, prm, 0, y, c, kappa)
        for i in (0, 3, N - 1):
            yi = y[i].clone().requires_grad_(True)
            E = _energy_attn(cfg, prm, 0, i, yi, c)
            (gE,) = torch.autograd.grad(E, yi)
            _close(u[i], -gE, 1e-11, f"CEM attn diag={diag} i={i}: u = -grad E (autograd)")
            fd = torch.zeros_like(yi)
            for a in range(cfg["d_model"]):
                e = torch.zeros_like(yi)
                e[a] = 1e-5
                fd[a] = (_energy_attn(cfg, prm, 0, i, y[i] + e, c)
                         - _energy_attn(cfg, prm, 0, i, y[i] - e, c)) / 2e-5
            _close(u[i], -fd, 1e-8, f"CEM attn diag={diag} i={i}: u = -grad E (finite diff)")
            # The scores the update uses are the energy's logits y^T A_k c_j / tau.
            E_from_s = -math.sqrt(cfg["head_dim"]) * torch.logsumexp(s[:, i, : i + 1], -1).sum()
            _close(E_from_s, E.detach(), 1e-12, f"CEM attn diag={diag} i={i}: energy from scores")


def selftest_cem_mlp_energy(gen):
    cfg = _tiny_cfg()
    prm = _rand_params(cfg, gen)
    w_up = prm["layers.0.mlp.w_up"]
    gate = torch.nn.functional.silu(torch.randn(cfg["d_ff"], generator=gen))
    y = torch.randn(cfg["d_model"], generator=gen)

    def energy(v):
        return -0.5 * (gate * (w_up @ v) ** 2).sum()

    direction = (gate * (y @ w_up.T)) @ w_up
    fd = torch.stack([(energy(y + 1e-5 * e) - energy(y - 1e-5 * e)) / 2e-5
                      for e in torch.eye(cfg["d_model"])])
    _close(direction, -fd, 1e-8, "CEM MLP: update = -grad E (finite diff)")


def selftest_lev_loop(gen):
    """LEV embedding against a scalar loop over heads, seed dims, knots and rank (§6.2)."""
    cfg = _tiny_cfg(embedding={"type": "lev", "tie_output": False,
                               "lev": {"digits": 2, "seed_dim": 3, "knots": 4, "rank": 2, "heads": 2}})
    prm = _rand_params(cfg, gen)
    ids = torch.tensor([0, 7, 8, 60, 33])
    got = lev_embed(cfg, prm, ids)
    lv, b = cfg["embedding"]["lev"], lev_base(61, 2)
    assert b == 8
    for n, t in enumerate(ids.tolist()):
        z = prm["lev.codebooks"][0, t // 8] + prm["lev.codebooks"][1, t % 8]
        e = torch.zeros(cfg["d_model"])
        for hd in range(lv["heads"]):
            u = prm["lev.seed_proj"][hd] @ z
            mu, var = u.mean(), ((u - u.mean()) ** 2).sum() / u.numel()
            y = prm["lev.ln_weight"][hd] * (u - mu) / math.sqrt(var + 1e-5) + prm["lev.ln_bias"][hd]
            M = torch.ones(lv["rank"])
            for d in range(lv["seed_dim"]):
                zeta = 1 / (1 + math.exp(-y[d].item()))
                w = []
                for q in range(lv["knots"]):
                    x = abs((zeta - q / (lv["knots"] - 1)) * (lv["knots"] - 1))
                    w.append(0.75 - x * x if x < 0.5 else 0.5 * (1.5 - x) ** 2 if x < 1.5 else 0.0)
                phi = sum(w[q] / sum(w) * prm["lev.spline"][hd, d, q] for q in range(lv["knots"]))
                M = M * phi
            e = e + M @ prm["lev.out_proj"][hd]
        _close(got[n], e, 1e-12, f"LEV embed token {t} == scalar loop")


def selftest_grad_fd(gen):
    """Autograd of the whole loss against a central finite difference along a random direction."""
    cfg = _tiny_cfg(attention={"diag": "per_head", "precond_rank": 2}, mlp={"precond_rank": 2},
                    embedding={"type": "lev", "tie_output": False,
                               "lev": {"digits": 2, "seed_dim": 3, "knots": 4, "rank": 2, "heads": 2}})
    prm = _rand_params(cfg, gen)
    ids = torch.randint(0, 61, (8,), generator=gen)
    _, _, grads = loss_and_grads(cfg, prm, ids, 3)
    dirs = {n: torch.randn(v.shape, generator=gen) for n, v in prm.items()}
    eps = 1e-6

    def loss_at(sign):
        return mean_nll(forward(cfg, {n: prm[n] + sign * eps * dirs[n] for n in prm}, ids, 3), ids)

    fd = (loss_at(1) - loss_at(-1)) / (2 * eps)
    an = sum((grads[n] * dirs[n]).sum() for n in prm)
    _close(an, fd, 1e-7, "dNLL/dparams . dir: autograd == finite diff (LEV, per_head, r=2, T=3)")


def self_test():
    gen = torch.Generator().manual_seed(1234)
    print("reference self-test:")
    selftest_rope()
    selftest_precond(gen)
    selftest_cem_equals_mha(gen)
    selftest_cem_attn_energy(gen)
    selftest_cem_mlp_energy(gen)
    selftest_lev_loop(gen)
    selftest_grad_fd(gen)
    print("reference self-test passed")


if __name__ == "__main__":
    self_test()
