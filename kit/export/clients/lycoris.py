"""The LyCORIS package's loader (`lycoris.kohya.create_network_from_weights`), as a checker.

Read from lycoris-lora 4.1.3, the network module sd-scripts runs with `--network_module
lycoris.kohya`. `model` is named as for `kit.export.clients.sdscripts`: `unet.` plus
`text_encoder.` (one encoder: prefix `lora_te_`) or `text_encoder1.` / `text_encoder2.` (a list:
`lora_te1_` / `lora_te2_`), in the module names of sd-scripts' own classes (so SDXL's UNet in
LDM names). `aliases` is not used.

The rules, as LyCORIS applies them:

* Keys. A `lora_unet*` / `lora_te*` module name is looked up among **all** the model's modules
  (`named_modules`, no target classes and, unlike sd-scripts, no diffusers-to-LDM renaming: a
  diffusers-named SDXL file loads nothing, silently). Unfound names are skipped without a word.
* Parts. The algorithm is the first whose marker key is present: LoCon (`lora_up.weight`),
  LoHa (`hada_w1_a`), IA3, LoKr (`lokr_w1` or `lokr_w1_a`), full (`diff`), ...; only that
  algorithm's parts are read (LoCon / LoHa / LoKr: theirs plus `alpha`, `dora_scale`; full:
  `diff`, `diff_b`). A found module with no marker, a missing `alpha` (`float(None)`), a layer
  the algorithm does not support, or a tensor that cannot be copied (broadcast) into the
  parameter LyCORIS builds from the layer abort the whole load. LoKr rebuilds its factor shapes
  from the file with `factorization`; a file whose factors it does not reproduce aborts too.
* Arithmetic (the forward of `apply_to`, multiplier s): LoCon W + s·(alpha/r)·(up·down); LoHa
  W + s·(alpha/r)·(w1a·w1b ⊙ w2a·w2b); LoKr W + s·(alpha/r)·kron(w1, w2), alpha/r forced to 1
  when neither factor is low-rank; alpha 0 means alpha = r; full W + s·diff.
  `merge_to` (`merge=True`) differs: it always merges at multiplier 1, and for LoHa and LoKr
  it applies alpha/r **twice** (`get_diff_weight` scales the already scaled `get_weight`).
* DoRA: every loaded DoRA module is per-output (`wd_on_out=True`, the metadata is not read):
  dora_scale must copy into (out, 1) for a Linear, (out, 1, 1, 1) for a conv (an (out, 1) on a
  conv, or an old per-input (1, in) file, aborts the load). V = W + (alpha/r)·ΔW,
  W' = V·(s·(m/‖V‖_row − 1) + 1): the norm is of V per output row (peft's DoRA at s = 1), and
  the strength blends the scale factor, not the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kit.export.clients import Applied, Fatal, f32, failed, row_norm, scalar, shape

CLIENT = "LyCORIS"

_ROOTS_ONE = (("unet.", "lora_unet"), ("text_encoder.", "lora_te"))
_ROOTS_LIST = (
    ("unet.", "lora_unet"),
    ("text_encoder1.", "lora_te1"),
    ("text_encoder2.", "lora_te2"),
)
_EMBEDDINGS = ("token_embedding", "position_embedding")


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS' split of a dimension into (m, n), m <= n, m * n = dimension.

    With a factor that divides it, (factor, dimension / factor); otherwise the divisors are
    walked upward, never past the factor, stopping at the first one at or above √dimension.
    """
    if factor > 0 and dimension % factor == 0:
        m, n = factor, dimension // factor
        return (min(m, n), max(m, n))
    cap = dimension if factor < 0 else factor
    m, n, d = 1, dimension, 1
    while m < n:
        d += 1
        while dimension % d:
            d += 1
        if d > cap:
            break
        m, n = d, dimension // d
    return (min(m, n), max(m, n))


def _modules(model: dict[str, torch.Tensor], roots: tuple) -> dict[str, tuple[str, str | None]]:
    """kohya name -> (kind, weight key) for every module, containers included."""
    out: dict[str, tuple[str, str | None]] = {}
    for root, prefix in roots:
        for key, value in model.items():
            if not key.startswith(root):
                continue
            path, _, param = key[len(root) :].rpartition(".")
            bits = path.split(".") if path else []
            for depth in range(len(bits)):
                out.setdefault(f"{prefix}_{'_'.join(bits[:depth])}", ("container", None))
            name = f"{prefix}_{'_'.join(bits)}"
            if param != "weight":
                out.setdefault(name, ("container", None))
                continue
            kind = {2: "linear", 3: "conv", 4: "conv", 5: "conv", 1: "norm"}.get(
                value.dim(), "container"
            )
            if bits and bits[-1] in _EMBEDDINGS:
                kind = "embedding"
            out[name] = (kind, key)
    return out


def _copied(
    name: str, part: str, src: torch.Tensor, dest: tuple[int, ...], notes: list[str]
) -> torch.Tensor:
    """`param.copy_(src)`: broadcast into LyCORIS' own parameter shape, or abort the load."""
    try:
        if src.dim() > len(dest) or tuple(torch.broadcast_shapes(src.shape, dest)) != dest:
            raise RuntimeError
    except RuntimeError:
        raise Fatal(
            f"{CLIENT}: {name}.{part} {shape(src)} cannot be copied into LyCORIS' {shape(dest)}: the load aborts"
        ) from None
    if tuple(src.shape) != dest:
        notes.append(f"{CLIENT}: {name}.{part} {shape(src)} is broadcast into {shape(dest)}")
    return f32(src).expand(dest).clone()


def _alpha(name: str, parts: dict[str, torch.Tensor], rank: int) -> float:
    if "alpha" not in parts:
        raise Fatal(f"{CLIENT}: {name} has no alpha: float(None) aborts the load")
    alpha = scalar(parts["alpha"])
    return float(rank) if alpha == 0 else alpha


def _locon(
    name: str, parts: dict, weight: torch.Tensor, notes: list[str]
) -> tuple[torch.Tensor, float, int]:
    if "lora_mid.weight" in parts:
        raise Fatal(f"{CLIENT}: {name}: lora_mid (tucker) is not modelled here")
    down = parts["lora_down.weight"] if "lora_down.weight" in parts else None
    if down is None:
        raise Fatal(f"{CLIENT}: {name} has lora_up but no lora_down: the load aborts")
    rank = down.shape[0]
    out, inn, *k = weight.shape
    down = _copied(name, "lora_down.weight", down, (rank, inn, *k), notes)
    up = _copied(name, "lora_up.weight", parts["lora_up.weight"], (out, rank, *[1] * len(k)), notes)
    scale = _alpha(name, parts, rank) / rank
    return (up.flatten(1) @ down.flatten(1)).reshape(weight.shape), scale, 1


def _loha(
    name: str, parts: dict, weight: torch.Tensor, notes: list[str]
) -> tuple[torch.Tensor, float, int]:
    if "hada_t1" in parts:
        raise Fatal(f"{CLIENT}: {name}: hada_t1/t2 (tucker) are not modelled here")
    rank = parts["hada_w1_b"].shape[0]
    out, flat = weight.shape[0], math.prod(weight.shape[1:])
    w = {
        p: _copied(name, p, parts[p], dims, notes)
        for p, dims in (
            ("hada_w1_a", (out, rank)),
            ("hada_w1_b", (rank, flat)),
            ("hada_w2_a", (out, rank)),
            ("hada_w2_b", (rank, flat)),
        )
    }
    delta = (w["hada_w1_a"] @ w["hada_w1_b"]) * (w["hada_w2_a"] @ w["hada_w2_b"])
    return delta.reshape(weight.shape), _alpha(name, parts, rank) / rank, 2


def _lokr_factor(w1, w1a, w1b, w2, w2a, w2b) -> int:
    """`make_module_from_state_dict`'s guess of the factor the file was made with."""
    out_dim, in_dim = tuple(w1.shape) if w1 is not None else (w1a.shape[0], w1b.shape[1])
    first = (out_dim, in_dim)
    out_dim *= w2.shape[0] if w2 is not None else w2a.shape[0]
    in_dim *= w2.shape[1] if w2 is not None else w2b.shape[1]
    if first[0] == factorization(out_dim)[0] and first[1] == factorization(in_dim)[0]:
        return -1
    s1 = tuple(w1.shape) if w1 is not None else (w1a.shape[0], w1b.shape[1])
    s2 = tuple(w2.shape) if w2 is not None else (w2a.shape[0], w2b.shape[1])
    whole = (s1[0] * s2[0], s1[1] * s2[1])
    f1 = max(w1.shape) if w1 is not None else max(w1a.shape[0], w1b.shape[1])
    f2 = max(w2.shape) if w2 is not None else max(w2a.shape[0], w2b.shape[1])
    for f in (f1, f2):
        if whole[0] % f == 0 and whole[1] % f == 0 and f in (s1[0], s2[0]) and f in (s1[1], s2[1]):
            return f
    return min(f1, f2)


def _lokr(
    name: str, parts: dict, weight: torch.Tensor, notes: list[str]
) -> tuple[torch.Tensor, float, int]:
    if "lokr_t2" in parts or "lokr_t1" in parts:
        raise Fatal(f"{CLIENT}: {name}: lokr_t2 (tucker) is not modelled here")
    w1, w1a, w1b = (parts.get(p) for p in ("lokr_w1", "lokr_w1_a", "lokr_w1_b"))
    w2, w2a, w2b = (parts.get(p) for p in ("lokr_w2", "lokr_w2_a", "lokr_w2_b"))
    if (w1 is None and w1b is None) or (w2 is None and (w2a is None or w2b is None)):
        raise Fatal(f"{CLIENT}: {name}: an incomplete LoKr factor aborts the load")
    full = w1a is None and w2a is None
    rank = w1a.shape[1] if w1a is not None else (w2a.shape[1] if w2a is not None else 1)
    alpha = _alpha(name, parts, rank)  # float(alpha) comes first, even where it is overridden
    factor = _lokr_factor(w1, w1a, w1b, w2, w2a, w2b)
    out, inn, *k = weight.shape
    in_m, in_n = factorization(inn, factor)
    out_l, out_k = factorization(out, factor)
    split_1 = w1 is None and w2 is None and rank < max(out_l, in_m) / 2 and not full
    full_2 = full or rank >= max(out_k, in_n) / 2
    if (w1 is not None) == split_1 or (w2 is not None) != full_2:
        raise Fatal(
            f"{CLIENT}: {name}: LyCORIS rebuilds this layer's LoKr as "
            f"w1 {'(a, b)' if split_1 else 'full'}, w2 {'full' if full_2 else '(a, b)'} "
            f"({out_l}x{in_m} ⊗ {out_k}x{in_n}); the file's factors do not fit: the load aborts"
        )
    if split_1:
        one = _copied(name, "lokr_w1_a", w1a, (out_l, rank), notes) @ _copied(
            name, "lokr_w1_b", w1b, (rank, in_m), notes
        )
    else:
        one = _copied(name, "lokr_w1", w1, (out_l, in_m), notes)
    if full_2:
        two = _copied(name, "lokr_w2", w2, (out_k, in_n, *k), notes)
    else:
        flat = in_n * math.prod(k)
        two = _copied(name, "lokr_w2_a", w2a, (out_k, rank), notes) @ _copied(
            name, "lokr_w2_b", w2b, (rank, flat), notes
        )
    while one.dim() < two.dim():
        one = one.unsqueeze(-1)
    scale = 1.0 if (not split_1 and full_2) else alpha / rank
    try:
        delta = torch.kron(one, two).reshape(weight.shape)
    except RuntimeError as err:
        raise Fatal(f"{CLIENT}: {name}: kron(w1, w2) does not fit the layer: {err}") from None
    return delta, scale, 2


def _full_marker(*_: object) -> tuple[torch.Tensor, float, int]:
    raise AssertionError("full (diff) modules are merged by _full")


_LOCON_READS = ("lora_up.weight", "lora_down.weight", "lora_mid.weight", "alpha", "dora_scale")
_LOHA_READS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
_LOKR_READS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
# LyCORIS' MODULE_LIST in order: class, marker parts, parts read, how the update is rebuilt.
_ALGOS: tuple[tuple[str, tuple[str, ...], tuple[str, ...], Callable | None], ...] = (
    ("LoConModule", ("lora_up.weight",), _LOCON_READS, _locon),
    ("LohaModule", ("hada_w1_a",), (*_LOHA_READS, "alpha", "dora_scale"), _loha),
    ("IA3Module", ("on_input",), ("weight", "on_input"), None),
    (
        "LokrModule",
        ("lokr_w1", "lokr_w1_a"),
        (*_LOKR_READS, "lokr_t1", "lokr_t2", "alpha", "dora_scale"),
        _lokr,
    ),
    ("FullModule", ("diff",), ("diff", "diff_b"), _full_marker),
    ("NormModule", ("w_norm",), ("w_norm", "b_norm"), None),
    ("DiagOFTModule", ("oft_blocks",), ("oft_blocks", "rescale", "alpha"), None),
    ("GLoRAModule", ("a1.weight",), (), None),
    ("TLoraModule", ("lambda_layer",), (), None),
)


def _algo(parts: dict[str, torch.Tensor]) -> tuple[str, tuple[str, ...], Callable | None] | None:
    for name, markers, reads, rebuild in _ALGOS:
        if any(m in parts for m in markers):
            return name, reads, rebuild
    return None


def apply(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    model: dict[str, torch.Tensor],
    *,
    strength: float = 1.0,
    aliases: dict[str, str] | None = None,
    merge: bool = False,
) -> Applied:
    """Load `tensors` into `model` as LyCORIS does: its forward at multiplier `strength`, or
    with `merge=True` what its `merge_to` writes into the weights."""
    del metadata, aliases  # LyCORIS builds every module from the tensors alone
    listed = any(k.startswith(("text_encoder1.", "text_encoder2.")) for k in model)
    modules = _modules(model, _ROOTS_LIST if listed else _ROOTS_ONE)
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if "." in key:
            stem, part = key.split(".", 1)
            grouped.setdefault(stem, {})[part] = value
    try:
        return _load(tensors, grouped, modules, model, strength, merge)
    except Fatal as err:
        return failed(CLIENT, tensors, str(err))


def _load(
    tensors: dict[str, torch.Tensor],
    grouped: dict[str, dict[str, torch.Tensor]],
    modules: dict[str, tuple[str, str | None]],
    model: dict[str, torch.Tensor],
    strength: float,
    merge: bool,
) -> Applied:
    merged: dict[str, torch.Tensor] = {}
    warnings: list[str] = []
    read: set[str] = set()
    for stem, parts in grouped.items():
        if not stem.startswith(("lora_unet", "lora_te")) or stem not in modules:
            continue
        kind, weight_key = modules[stem]
        found = _algo(parts)
        if found is None:
            raise Fatal(
                f"{CLIENT}: {stem} has no part LyCORIS recognises ({', '.join(parts)}): the load aborts"
            )
        algo, reads, rebuild = found
        if rebuild is None:
            raise Fatal(f"{CLIENT}: {stem}: {algo} is not modelled here")
        if kind not in ("linear", "conv") or weight_key is None:
            raise Fatal(
                f"{CLIENT}: {stem}: a {kind} layer is not supported by {algo}: the load aborts"
            )
        read.update(f"{stem}.{p}" for p in reads if p in parts)
        weight = f32(model[weight_key])
        if rebuild is _full_marker:
            merged.update(
                _full(stem, parts, weight_key, weight, model, 1.0 if merge else strength, warnings)
            )
            continue
        delta, scale, times = rebuild(stem, parts, weight, warnings)
        multiplier = 1.0 if merge else strength
        if merge and times == 2 and scale != 1.0:
            delta = delta * scale  # merge_to's second alpha / r
        elif times == 2 and scale != 1.0:
            warnings.append(
                f"{CLIENT}: {stem}: merge_to would scale this {algo} update by alpha/r = {scale:g} twice"
            )
        delta = delta * scale
        if "dora_scale" in parts:
            magnitude = _copied(
                stem,
                "dora_scale",
                parts["dora_scale"],
                (weight.shape[0], *[1] * (weight.dim() - 1)),
                warnings,
            )
            total = weight + delta
            factor = magnitude / (row_norm(total) + torch.finfo(torch.float32).eps)
            if multiplier != 1:
                factor = multiplier * (factor - 1) + 1
            merged[weight_key] = total * factor
        else:
            merged[weight_key] = weight + multiplier * delta
    if merge and strength != 1.0:
        warnings.append(
            f"{CLIENT}: merge_to merges at multiplier 1 whatever the strength ({strength:g})"
        )
    unread = sorted(k for k in tensors if k not in read)
    return Applied(CLIENT, merged, unread, warnings)


def _full(
    stem: str,
    parts: dict[str, torch.Tensor],
    weight_key: str,
    weight: torch.Tensor,
    model: dict[str, torch.Tensor],
    multiplier: float,
    warnings: list[str],
) -> dict[str, torch.Tensor]:
    """FullModule: W + s·diff, and b + s·diff_b where the layer has a bias."""
    out = {
        weight_key: weight
        + multiplier * _copied(stem, "diff", parts["diff"], tuple(weight.shape), warnings)
    }
    if "diff_b" in parts:
        bias_key = weight_key[: -len("weight")] + "bias"
        if bias_key in model:
            bias = f32(model[bias_key])
            out[bias_key] = bias + multiplier * _copied(
                stem, "diff_b", parts["diff_b"], tuple(bias.shape), warnings
            )
        else:
            warnings.append(f"{CLIENT}: {stem}.diff_b: the layer has no bias; the forward drops it")
    return out
