"""A GPT's training state written down from first principles, for oracles that share no code
with the planner: which tensors exist, their global shapes, the dimension Megatron TP splits,
and which global slice of each tensor a (pp, tp) rank of a layout holds."""
from __future__ import annotations

import math
from dataclasses import dataclass

BYTES_PER_ELEMENT = 4 + 4 + 4  # fp32 parameter and two Adam moments


@dataclass(frozen=True)
class Gpt:
    layers: int
    hidden: int
    ffn: int
    vocab: int
    seq: int

    def tensors(self) -> list[tuple[str, str, int, tuple[int, ...], int | None]]:
        """(name, block, layer, global shape, TP-split dim or None)."""
        h, f, v = self.hidden, self.ffn, self.vocab
        out = [("wte", "embed", -1, (v, h), 0), ("wpe", "embed", -1, (self.seq, h), None)]
        for i in range(self.layers):
            out += [(f"{i}.ln1.w", "layer", i, (h,), None), (f"{i}.ln1.b", "layer", i, (h,), None),
                    (f"{i}.qkv.w", "layer", i, (3 * h, h), 0), (f"{i}.qkv.b", "layer", i, (3 * h,), 0),
                    (f"{i}.proj.w", "layer", i, (h, h), 1), (f"{i}.proj.b", "layer", i, (h,), None),
                    (f"{i}.ln2.w", "layer", i, (h,), None), (f"{i}.ln2.b", "layer", i, (h,), None),
                    (f"{i}.fc1.w", "layer", i, (f, h), 0), (f"{i}.fc1.b", "layer", i, (f,), 0),
                    (f"{i}.fc2.w", "layer", i, (h, f), 1), (f"{i}.fc2.b", "layer", i, (h,), None)]
        return out + [("lnf.w", "head", -1, (h,), None), ("lnf.b", "head", -1, (h,), None),
                      ("lm", "head", -1, (v, h), 0)]

    def stage_tensors(self, pp: int, npp: int) -> list:
        """The tensors() stage `pp` of `npp` holds: the embedding first, the head last, layers evenly."""
        per_stage = self.layers // npp
        return [t for t in self.tensors() if (t[1] == "embed" and pp == 0) or (t[1] == "head" and pp == npp - 1)
                or (t[1] == "layer" and pp * per_stage <= t[2] < (pp + 1) * per_stage)]

    def held(self, pp: int, tp: int, npp: int, ntp: int) -> dict[str, tuple[int, int, int]]:
        """Global slice of each tensor held by rank (pp, tp): name -> (lo, hi, elements per index)."""
        out = {}
        for name, _block, _layer, shape, dim in self.stage_tensors(pp, npp):
            numel = math.prod(shape)
            if dim is None:
                out[name] = (0, 1, numel)
            else:
                n = shape[dim]
                out[name] = (tp * n // ntp, (tp + 1) * n // ntp, numel // n)
        return out

    def part_bytes(self) -> dict[str, int]:
        """Bytes of one layer's / the embedding's / the head's TP-split and replicated tensors, all kinds."""
        out = {"s": 0, "r": 0, "Es": 0, "Er": 0, "Hs": 0, "Hr": 0}
        for _name, block, layer, shape, dim in self.tensors():
            if block == "layer" and layer != 0:
                continue
            key = {"layer": "", "embed": "E", "head": "H"}[block] + ("s" if dim is not None else "r")
            out[key] += math.prod(shape) * BYTES_PER_ELEMENT
        return out


def lacking(want: dict, have: dict) -> int:
    """Bytes of `want` (a held() dict) that `have` does not hold."""
    total = 0
    for name, (lo, hi, per) in want.items():
        keep = 0
        if name in have:
            h_lo, h_hi, _ = have[name]
            keep = max(0, min(hi, h_hi) - max(lo, h_lo))
        total += (hi - lo - keep) * per
    return total * BYTES_PER_ELEMENT


def fsdp_masks(gpt: Gpt, pp: int, f: int, tp: int, npp: int, nf: int, ntp: int) -> dict:
    """Which elements of each tensor rank (pp, fsdp f, tp) holds under FSDP2 x TP, as numpy masks: the TP
    slice of its split dim, then FSDP2's cut of dim 0 of that TP piece into `nf` (dims divide evenly)."""
    import numpy as np

    out = {}
    for name, _block, _layer, shape, dim in gpt.stage_tensors(pp, npp):
        bounds = [[0, n] for n in shape]
        if dim is not None:
            n = shape[dim]
            assert n % ntp == 0
            bounds[dim] = [tp * n // ntp, (tp + 1) * n // ntp]
        lo, hi = bounds[0]
        assert (hi - lo) % nf == 0
        bounds[0] = [lo + f * (hi - lo) // nf, lo + (f + 1) * (hi - lo) // nf]
        m = np.zeros(shape, dtype=bool)
        m[tuple(slice(a, b) for a, b in bounds)] = True
        out[name] = m
    return out


def lacking_masks(want: dict, have: dict) -> int:
    """Bytes of `want` (fsdp_masks) that `have` does not hold."""
    return sum(int((m & ~have[n]).sum()) if n in have else int(m.sum()) for n, m in want.items()) * BYTES_PER_ELEMENT
