"""The routing trace: one JSON line per MoE call (``trace`` option), which
``bench cache`` and ``bench simulate`` replay."""

from __future__ import annotations

import json

from ..errors import ConfigError
from .events import Observer


class TraceWriter(Observer):
    """One JSON line per MoE call: the layer, each token's expert ids, prefetch's
    predictions and scores, and the router's probabilities when the policy asks."""

    def __init__(self, path: str):
        self.path = path
        self._predicted = {}
        self._sigmoid = set()  # layers predicted with a sigmoid router's scores
        try:
            self._file = open(path, "w")
        except OSError as e:
            raise ConfigError(f"cannot write the trace to {path} ({e.strerror})") from None

    def on_predict(self, layer, ids, scores=None, distance=1, softmax=True):
        self._predicted[layer, distance] = (ids, scores)
        if not softmax:
            self._sigmoid.add(layer)

    def on_route(self, layer, ids, experts, probs=None):
        record = {"layer": layer, "ids": ids.reshape(-1, ids.shape[-1]).tolist()}
        for distance, key in ((1, "predicted"), (2, "predicted2")):
            predicted, scores = self._predicted.pop((layer, distance), (None, None))
            if predicted is not None:
                record[key] = predicted.reshape(-1, predicted.shape[-1]).tolist()
            if scores is not None:
                rows = scores.reshape(len(record[key]), -1).tolist()
                record[key + "_scores"] = [[round(x, 4) for x in row] for row in rows]
        if layer in self._sigmoid and ("predicted" in record or "predicted2" in record):
            record["sigmoid_router"] = True
        if probs is not None:
            record["probs"] = [[round(p, 5) for p in row] for row in probs.tolist()]
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def read_trace(path: str):
    """Yield ``(layer, ids[tokens, k])`` from a trace file."""
    for record in read_trace_records(path):
        yield record["layer"], record["ids"]


def read_trace_records(path: str):
    """Each call of a trace file as a dict: ``layer``, ``ids`` [tokens, k] and what
    else it recorded; a step of the real-trace format (``{"tok": n, "layers":
    [[ids] per layer]}``) is one call per layer."""
    import numpy as np

    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if "layers" in d and "ids" not in d:
                for layer, ids in enumerate(d["layers"]):
                    yield {"layer": layer, "ids": np.array([ids], dtype=np.int64)}
                continue
            d["ids"] = np.array(d["ids"], dtype=np.int64)
            for key in ("predicted", "predicted2"):
                if key in d:
                    d[key] = np.array(d[key], dtype=np.int64)
                if key + "_scores" in d:
                    d[key + "_scores"] = np.array(d[key + "_scores"], dtype=np.float64)
            if "probs" in d:
                d["probs"] = np.array(d["probs"], dtype=np.float64)
            yield d
