#!/usr/bin/env python3
"""How tight the upper bounds on q·k are that retrieval ranks key groups by, on a real model.

    PYTHONPATH=build/python:examples/python /usr/bin/python3 examples/python/bound_slack.py \\
        model.bin text.txt --seqs 4 [--tokenizer model.bin.tokenizer.json]

A llama2.c checkpoint runs with exact attention on --seqs windows of the text (model_eval.py's
sequences), and each layer's queries and keys are kept (key/value heads repeated per query head).
In each sequence of n tokens the first n/2 keys are the retrieval candidates and the last n/2
queries retrieve from them, as a decoding step does from the tokens before its window. The
candidates are grouped in two ways:
  pages     of --page consecutive keys (KVCache mode "blocks", sparse-lowrank's blocks support);
  clusters  k-means of the candidates per head (--clusters, 10 Lloyd steps, seeded), as the
            clusters modes build them.
Bounds on the largest logit in a group (s·q·k, s = 1/sqrt(head size), in nats):
  box       Σ_c max(q_c·min_c, q_c·max_c), per-coordinate minimum and maximum of the group;
  axes      the same box taken in the principal axes of the first --axes keys (KVCache axes=);
  ball      q·c + ‖q‖·r, centroid c and radius r of the group (the clusters modes' bound);
  box ∧ ball  the smaller of the two, a bound too.
Printed per bound (a Markdown table), over layers, heads and queries:
  slack         the bound minus the group's largest logit, median over a query's groups;
  slack (top)   the same over the query's --top groups of largest true logit;
  mass          the softmax mass (over the candidates) of the --top groups of highest bound, over
                the mass of the --top groups of largest mass: 1 when the bound picks the best
                groups, the fraction of reachable mass it keeps otherwise.
"""

import argparse

import numpy as np
import torch

import llama2c
import model_eval


def principal_axes(rows):
    """Eigenvectors of the rows' covariance as columns, by decreasing variance (signs as in
    linalg/principal_axes.hpp: the largest-magnitude entry positive)."""
    x = rows.astype(np.float64)
    w, u = np.linalg.eigh(np.cov((x - x.mean(0)).T))
    u = u[:, ::-1]
    top = np.abs(u).argmax(0)
    return u * np.sign(u[top, np.arange(u.shape[1])])


def kmeans(keys, count, steps, rng):
    """Labels of `count` clusters of the rows (Lloyd from distinct random rows)."""
    centroids = keys[rng.choice(len(keys), count, replace=False)]

    def nearest():  # ‖x − c‖² up to ‖x‖², without an n × count × d array
        return ((centroids ** 2).sum(1)[None] - 2 * keys @ centroids.T).argmin(1)
    for _ in range(steps):
        labels = nearest()
        for c in range(count):
            if (labels == c).any():
                centroids[c] = keys[labels == c].mean(0)
    return nearest()


def group_bounds(q, keys, groups, axes):
    """{bound name: (queries, groups) upper bounds on q·k} for the key groups (lists of rows)."""
    out = {}
    for name, basis in (("box", np.eye(q.shape[1])), ("axes", axes)):
        qb, kb = q @ basis, keys @ basis
        lo = np.stack([kb[g].min(0) for g in groups])
        hi = np.stack([kb[g].max(0) for g in groups])
        out[name] = np.maximum(qb, 0) @ hi.T + np.minimum(qb, 0) @ lo.T
    centre = np.stack([keys[g].mean(0) for g in groups])
    radius = np.array([np.linalg.norm(keys[g] - centre[i], axis=1).max() for i, g in enumerate(groups)])
    out["ball"] = q @ centre.T + np.linalg.norm(q, axis=1)[:, None] * radius[None]
    out["box ∧ ball"] = np.minimum(out["box"], out["ball"])
    return out


def measure(q, k, groups, axes, top, stats):
    """Adds each bound's per-query figures on one head to stats[name]."""
    scale = q.shape[1] ** -0.5
    logits = scale * (q @ k.T)
    true = np.stack([logits[:, g].max(1) for g in groups], 1)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    mass = np.stack([p[:, g].sum(1) for g in groups], 1)
    t = min(top, len(groups))
    best = -np.sort(-mass, 1)[:, :t].sum(1)
    heavy = np.argsort(-true, 1, kind="stable")[:, :t]
    for name, b in group_bounds(q, k, groups, axes).items():
        slack = scale * b - true
        chosen = np.argsort(-b, 1, kind="stable")[:, :t]
        s = stats.setdefault(name, {"slack": [], "top": [], "mass": []})
        s["slack"].append(np.median(slack, 1))
        s["top"].append(np.take_along_axis(slack, heavy, 1).mean(1))
        s["mass"].append(np.take_along_axis(mass, chosen, 1).sum(1) / np.maximum(best, 1e-300))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="llama2.c-format model file")
    ap.add_argument("text", help="text file (read as bytes)")
    ap.add_argument("--seqs", type=int, default=4, help="number of sequences")
    ap.add_argument("--start", type=int, default=0, help="byte of the text where the first sequence starts")
    ap.add_argument("--tokenizer", default=None, help="the model's BPE tokenizer file")
    ap.add_argument("--token-offset", type=int, default=0, help="token id of byte 0 (model_eval.py)")
    ap.add_argument("--page", type=int, default=16, help="keys per page")
    ap.add_argument("--clusters", type=int, default=None, help="clusters per head (default: candidates / page)")
    ap.add_argument("--axes", type=int, default=64, help="keys whose principal axes turn the box")
    ap.add_argument("--top", type=int, default=4, help="groups opened per query")
    ap.add_argument("--seed", type=int, default=0, help="seed of the k-means")
    args = ap.parse_args(argv)
    if min(args.seqs, args.page, args.top) < 1 or args.axes < 2:
        ap.error("--seqs, --page and --top must be positive and --axes at least 2")

    model = llama2c.read_checkpoint(args.checkpoint)
    c = model.config
    encode, _ = llama2c.text_codec(c.vocab_size, args.token_offset, args.tokenizer)
    inputs, _ = model_eval.load_sequences(args.text, args.seqs, c.seq_len, args.start, encode)
    recorder = model_eval.QKRecorder()
    with torch.inference_mode():
        for s in range(args.seqs):
            model(inputs[s:s + 1], recorder)
    half = c.seq_len // 2
    count = args.clusters or max(1, half // args.page)
    rng = np.random.default_rng(args.seed)
    stats = {"pages": {}, "clusters": {}}
    for q, k in recorder.rows:  # per sequence and layer: (heads, n, d)
        for h in range(q.shape[0]):
            qh, kh = q[h, half:].astype(np.float64), k[h, :half].astype(np.float64)
            axes = principal_axes(kh[:min(args.axes, half)])
            pages = [np.arange(p, min(p + args.page, half)) for p in range(0, half, args.page)]
            labels = kmeans(kh, count, 10, rng)
            clusters = [np.flatnonzero(labels == j) for j in range(count) if (labels == j).any()]
            measure(qh, kh, pages, axes, args.top, stats["pages"])
            measure(qh, kh, clusters, axes, args.top, stats["clusters"])

    print(f"# {args.checkpoint}: {c.n_layers} layers, {c.n_heads} query heads of {c.head_size} over "
          f"{c.n_kv_heads} key/value heads; {args.seqs} sequences of {c.seq_len} tokens, candidates the "
          f"first {half} keys, queries the last {half}; pages of {args.page}, {count} clusters, axes of the "
          f"first {min(args.axes, half)} keys, top {args.top} groups")
    print("| groups | bound | slack (nats) | slack at the top groups | mass / best mass |")
    print("|---|---|---|---|---|")
    for kind, by_bound in stats.items():
        for name, s in by_bound.items():
            print(f"| {kind} | {name} | {np.concatenate(s['slack']).mean():.3f} | "
                  f"{np.concatenate(s['top']).mean():.3f} | {np.concatenate(s['mass']).mean():.3f} |")


if __name__ == "__main__":
    main()
