"""What each (PP stage, TP rank) class of a layout holds, and the bytes two classes share.

A class's workload is a rectangle: a range of layers times a range of TP slices counted in
units of G = LCM of the TP sizes involved (paper III-C), plus the embedding on the first stage
and the final norm / LM head on the last. Replicated tensors (layer norms, row-parallel biases,
position embeddings) are whole items held by every TP rank of the stage. Rectangles make the
byte cost matrix a few numpy broadcasts instead of set intersections per item.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from migrate.layout import ModelSpec, ParallelConfig, TensorSpec


@dataclass(frozen=True)
class Workload:
    """State held by one class of a layout: layers [layer_lo, layer_hi) x slices [slice_lo, slice_hi) of `of`."""

    layer_lo: int
    layer_hi: int
    slice_lo: int
    slice_hi: int
    of: int
    first: bool
    last: bool


def slice_units(*tps: int) -> int:
    """G: the TP granularity at which every layout involved is a whole number of slices."""
    return math.lcm(*tps)


def class_workloads(cfg: ParallelConfig, layers: int, units: int) -> list[Workload]:
    """Workload of class c = pp * cfg.tp + tp, for every class of `cfg`."""
    per_stage, per_tp = layers // cfg.pp, units // cfg.tp
    return [
        Workload(p * per_stage, (p + 1) * per_stage, t * per_tp, (t + 1) * per_tp, units, p == 0, p == cfg.pp - 1)
        for p in range(cfg.pp) for t in range(cfg.tp)
    ]


def rank_workload(cfg: ParallelConfig, rank: int, layers: int, units: int) -> Workload:
    pp, _dp, tp = cfg.coords(rank)
    return class_workloads(cfg, layers, units)[pp * cfg.tp + tp]


def held_tensors(model: ModelSpec, w: Workload) -> list[TensorSpec]:
    """The tensors (in model order) a workload holds a piece of."""
    out: list[TensorSpec] = []
    if w.first:
        out += model.embed_tensors()
    for layer in range(w.layer_lo, w.layer_hi):
        out += model.layer_tensors(layer)
    if w.last:
        out += model.head_tensors()
    return out


class ByteModel:
    """Bytes of workload rectangles and of their intersections, vectorised over classes."""

    def __init__(self, units: int, layer_s: int, layer_r: int = 0, embed_s: int = 0, embed_r: int = 0,
                 head_s: int = 0, head_r: int = 0) -> None:
        # *_s: bytes of one slice unit of a block's sharded part; *_r: bytes of its replicated part
        self.units = units
        self.layer_s, self.layer_r = layer_s, layer_r
        self.embed_s, self.embed_r = embed_s, embed_r
        self.head_s, self.head_r = head_s, head_r

    @classmethod
    def of_model(cls, model: ModelSpec, units: int) -> "ByteModel":
        n, bpe = model.numel_by_part(), model.bytes_per_element
        return cls(units, n["layer_sharded"] // units * bpe, n["layer_replicated"] * bpe,
                   n["embed_sharded"] // units * bpe, n["embed_replicated"] * bpe,
                   n["head_sharded"] // units * bpe, n["head_replicated"] * bpe)

    @classmethod
    def items(cls, units: int) -> "ByteModel":
        """The paper's unit: one (layer, TP slice) item costs 1, nothing else is counted."""
        return cls(units, 1)

    @staticmethod
    def _arrays(ws: list[Workload]) -> tuple[np.ndarray, ...]:
        a = np.array([(w.layer_lo, w.layer_hi, w.slice_lo, w.slice_hi, w.first, w.last) for w in ws], dtype=np.int64)
        return tuple(a[:, i] for i in range(6))

    def need(self, ws: list[Workload]) -> np.ndarray:
        llo, lhi, slo, shi, first, last = self._arrays(ws)
        width = shi - slo
        return ((lhi - llo) * (self.layer_s * width + self.layer_r)
                + first * (self.embed_s * width + self.embed_r)
                + last * (self.head_s * width + self.head_r))

    def shared(self, rows: list[Workload], cols: list[Workload]) -> np.ndarray:
        """shared[i, j] = bytes that workload rows[i] and cols[j] both hold."""
        a = [x[:, None] for x in self._arrays(rows)]
        b = [x[None, :] for x in self._arrays(cols)]
        lay = np.clip(np.minimum(a[1], b[1]) - np.maximum(a[0], b[0]), 0, None)
        sl = np.clip(np.minimum(a[3], b[3]) - np.maximum(a[2], b[2]), 0, None)
        return (lay * (self.layer_s * sl + self.layer_r)
                + (a[4] & b[4]) * (self.embed_s * sl + self.embed_r)
                + (a[5] & b[5]) * (self.head_s * sl + self.head_r))

    def cost(self, rows: list[Workload], cols: list[Workload]) -> np.ndarray:
        """cost[i, j] = bytes workload rows[i] needs that cols[j] does not hold (paper: len(curr) - len(curr & prev))."""
        return self.need(rows)[:, None] - self.shared(rows, cols)
