"""Trainable attention layers for llama2c.Transformer, run through randattn, and the feature-map
files that hold their learned parameters.

``ModelAttention(method, config, options)`` is one :class:`LayerAttention` per layer (an
``nn.ModuleList``, passed to ``Transformer.forward`` as its attention). Each runs causal
``randattn.attention(q, k, v, method=..., **options)`` on the layer's (batch, n_heads, n, hs) queries and
(batch, n_kv_heads, n, hs) keys and values (grouped-query heads as they are); on tensors that
require grad, its forward and backward both run in randattn. Methods with a learned feature map
hold its parameters as ``nn.Parameter``s:

  hedgehog                      weight (n_kv_heads, m, hs) and bias (n_kv_heads, m): φ(x) =
                                [softmax(W c x + b); softmax(−(W c x + b))] per key/value head,
                                c = scale^(1/2) (Zhang et al. 2024);
  favor, favor-hyp              omega (m, hs), one projection per layer for all of its heads
                                (with learn=True; otherwise the seed's draw).

Initial values: hedgehog's W is the identity when m = hs (φ starts as the softmax of the scaled
row, as in the Hedgehog paper), otherwise N(0, 1/hs) entries from the seed, and b = 0; the
projections are the method's seeded draw. ``torch_features`` evaluates the same maps in torch, for
losses on whole attention matrices (attention transfer in convert_model.py).

A feature-map file is an .npz of every layer's learned arrays ("layer3.weight", ...) with the
method, its options and the model shape that they fit ("meta", JSON); ``feature_map_path(out)``
names the file that belongs to a checkpoint: the checkpoint's path with ".feature_maps.npz"
appended.
"""

import json
import pathlib

import numpy as np
import torch

LEARNED = {"hedgehog": ("weight", "bias"), "favor": ("omega",), "favor-hyp": ("omega",)}
FEATURE_MAP_SUFFIX = ".feature_maps.npz"


def feature_map_path(checkpoint):
    """The feature-map file of a checkpoint: its path with ".feature_maps.npz" appended."""
    return pathlib.Path(str(checkpoint) + FEATURE_MAP_SUFFIX)


def refuse_existing(checkpoint, force, error, also=()):
    """error(message) when the checkpoint, its feature-map file or a path of `also` exists, unless force."""
    for path in (pathlib.Path(checkpoint), feature_map_path(checkpoint), *map(pathlib.Path, also)):
        if path.exists() and not force:
            error(f"{path} exists (--force to overwrite)")


def model_shape(config):
    """What a feature-map file must agree with."""
    return {"n_layers": config.n_layers, "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
            "head_size": config.head_size}


def initial_parameters(method, config, layer, seed, options):
    """{name: float32 tensor} of a layer's learned feature map before training."""
    hs, kv = config.head_size, config.n_kv_heads
    m = int(options.get("features", 64 if method == "hedgehog" else 256))
    if method == "hedgehog":
        if m == hs:
            weight = torch.eye(hs).expand(kv, hs, hs).clone()
        else:
            g = torch.Generator().manual_seed(seed * 1009 + layer)
            weight = torch.randn(kv, m, hs, generator=g) / hs ** 0.5
        return {"weight": weight, "bias": torch.zeros(kv, m)}
    import randattn
    kind = {"favor": "positive", "favor-hyp": "hyperbolic"}[method]
    drawn = {k: v for k, v in options.items() if k in ("features", "projection")}
    feature_map = randattn.FeatureMap(kind, hs, seed=seed + layer, **drawn)
    return {"omega": torch.from_numpy(feature_map.omega).to(torch.float32)}


class LayerAttention(torch.nn.Module):
    """Causal attention of one layer by ``randattn.attention(method=..., **options)``; a learned
    feature map's arrays are parameters of the module (see the module docstring)."""

    def __init__(self, method, config, layer, options, learn=True, seed=0):
        super().__init__()
        self.method, self.options = method, dict(options)
        self.learned = LEARNED.get(method, ()) if learn else ()
        for option in ("weight", "bias", "omega"):
            if option in self.options and option in self.learned:
                raise ValueError(f"{method}: {option} is learned here; do not give it as an option")
        if self.learned:
            for name, value in initial_parameters(method, config, layer, seed, self.options).items():
                setattr(self, name, torch.nn.Parameter(value))
        self.seed = seed + layer  # each layer its own draws, as each layer its own parameters

    def parameters_of_map(self):
        return {name: getattr(self, name) for name in self.learned}

    def forward(self, q, k, v):
        import randattn
        options = {"seed": self.seed, **self.options, **self.parameters_of_map()}
        if self.method == "hedgehog" and "features" not in options and "weight" in options:
            options["features"] = options["weight"].shape[1]
        return randattn.attention(q.contiguous(), k.contiguous(), v.contiguous(), method=self.method,
                                  causal=True, **options)


class ModelAttention(torch.nn.ModuleList):
    """One LayerAttention per layer of a model, in layer order."""

    def __init__(self, method, config, options, learn=True, seed=0):
        super().__init__([LayerAttention(method, config, layer, options, learn, seed)
                          for layer in range(config.n_layers)])
        self.method, self.options, self.shape = method, dict(options), model_shape(config)

    def learned_arrays(self):
        return {f"layer{i}.{name}": p.detach().numpy().copy()
                for i, layer in enumerate(self) for name, p in layer.parameters_of_map().items()}

    def save(self, path):
        """Writes the learned arrays (nothing to write for a method without a learned map)."""
        meta = {"method": self.method, "options": self.options, "model": self.shape}
        np.savez(path, meta=np.array(json.dumps(meta)), **self.learned_arrays())

    @staticmethod
    def read_meta(path):
        """The method, options and model shape a feature-map file records."""
        with np.load(path) as f:
            if "meta" not in f.files:
                raise ValueError(f"{path}: not a feature-map file (no 'meta' entry)")
            return json.loads(str(f["meta"]))

    def load(self, path):
        """Reads a file that save() wrote for a model of the same shape and method (ValueError
        otherwise); the arrays become the layers' parameters, bit for bit. Returns the options
        recorded with them."""
        meta = self.read_meta(path)
        with np.load(path) as f:
            if meta.get("model") != self.shape:
                raise ValueError(f"{path}: feature maps for a model of shape {meta.get('model')}, "
                                 f"this model is {self.shape}")
            if meta.get("method") != self.method:
                raise ValueError(f"{path}: feature maps of method {meta.get('method')!r}, not {self.method!r}")
            arrays = {name: f[name] for name in f.files if name != "meta"}
        expected = self.learned_arrays()
        if set(arrays) != set(expected):
            raise ValueError(f"{path}: holds {sorted(arrays)}, this model needs {sorted(expected)}")
        with torch.no_grad():
            for i, layer in enumerate(self):
                for name, p in layer.parameters_of_map().items():
                    a = arrays[f"layer{i}.{name}"]
                    if a.shape != tuple(p.shape):
                        raise ValueError(f"{path}: layer{i}.{name} has shape {a.shape}, expected {tuple(p.shape)}")
                    p.copy_(torch.from_numpy(a))
        return meta["options"]


def read_feature_maps(path, config):
    """(method, options, one {option: array} per layer) of a feature-map file for a model of
    `config`'s shape (ValueError otherwise), as randattn.attention's per-layer options."""
    meta = ModelAttention.read_meta(path)
    if meta.get("method") not in LEARNED:
        raise ValueError(f"{path}: feature maps of method {meta.get('method')!r}, which has none to learn")
    attention = ModelAttention(meta["method"], config, meta["options"])
    options = attention.load(path)
    per_layer = [{name: p.detach().numpy() for name, p in layer.parameters_of_map().items()} for layer in attention]
    if meta["method"] == "hedgehog":
        options = {**options, "features": per_layer[0]["weight"].shape[1]}
    return meta["method"], options, per_layer


def torch_features(method, x, params, scale, side):
    """The layer's feature map in torch on x (batch, heads, n, hs) (heads = the map's key/value
    heads, or as many query heads with params repeated), nonnegative and scaled so that
    φ(q) φ(k)ᵀ is the method's kernel up to one constant per query row and one per call (which
    normalised attention cancels): hedgehog exactly; favor and favor-hyp stabilised by the
    query's row maximum and by the keys' overall maximum."""
    c = scale ** 0.5
    x = x * c
    if method == "hedgehog":
        u = torch.einsum("bhnd,hmd->bhnm", x, params["weight"]) + params["bias"][None, :, None, :]
        return torch.cat((torch.softmax(u, -1), torch.softmax(-u, -1)), -1)
    u = x @ params["omega"].T
    if method == "favor-hyp":
        u = torch.cat((u, -u), -1)
    u = u - 0.5 * x.pow(2).sum(-1, keepdim=True)
    top = u.amax(-1, keepdim=True) if side == "query" else u.amax(dim=(-2, -1), keepdim=True)
    return torch.exp(u - top.detach())
