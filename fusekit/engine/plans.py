"""The plan cache's data: :class:`PlanKey` (everything that makes a built plan valid) and
:class:`Plan` (a built plan), with the on-disk formats' names."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..tensors import TensorSpec

#: /2: float32 convolution and matmul plans never down-convert inputs (entries of /1 may: rebuilt)
ENTRY_FORMAT = "fusekit-plan/2"
FUSION_FORMAT = "fusekit-fusion/1"


@dataclass(frozen=True)
class PlanKey:
    """Everything that makes a built plan valid."""

    pattern: str
    digest: str  # content hash of the pattern file
    specs: tuple[tuple[str, TensorSpec], ...]  # operands then outputs
    alignments: tuple[int, ...]  # per entry of ``specs``: largest power of two <= 32 dividing the pointer
    attrs: tuple[tuple[str, Any], ...]
    compute_dtype: str
    gpu: str
    cc: tuple[int, int]
    cudnn_backend: int
    frontend: str
    #: Whether the key's float32 convolutions / matmuls may run on TF32 tensor cores (the numerics
    #: policy, config.allow_tf32(), for its op families); False where TF32 does not apply (other dtypes, ops).
    tf32: bool = False

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for _, spec in d["specs"]:
            spec.pop("view", None)  # the user's view of an array does not change the plan
        return d

    @staticmethod
    def from_json(d: dict) -> "PlanKey":
        def tup(v: Any) -> Any:
            return tuple(tup(x) for x in v) if isinstance(v, list) else v

        missing = sorted({f.name for f in dataclasses.fields(PlanKey)} - set(d))
        if missing:  # a key of an older format (before ``tf32``): its plan may not follow the policy now asked for
            raise ValueError(f"the key has no {', '.join(missing)} (an entry of an older fusekit)")
        specs = tuple((n, TensorSpec(**{k: tup(v) for k, v in sd.items()})) for n, sd in d["specs"])
        fields = {k: tup(v) for k, v in d.items() if k != "specs"}
        return PlanKey(specs=specs, **fields)

    def fingerprint(self) -> str:
        """Stable hash of the whole key (the store's file name)."""
        canon = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:40]

    def describe(self) -> str:
        shapes = ", ".join(f"{n}={s.dtype}{list(s.shape)}:{s.layout}" for n, s in self.specs)
        attrs = ", ".join(f"{k}={v}" for k, v in self.attrs)
        tf32 = ", TF32 allowed" if self.tf32 else ""
        return f"{self.pattern}({shapes}; {attrs}{tf32}) on {self.gpu} sm_{self.cc[0]}{self.cc[1]}"


@dataclass(eq=False)
class Plan:
    """A built cuDNN plan for one key: execute ``graph`` with buffers in ``uids`` order."""

    key: PlanKey
    graph: Any
    uids: tuple[int, ...]
    workspace_size: int
    engine: str
    candidates: int
    build_ms: float
    source: str = "built"  # "built" (heuristics) | "tuned" | "disk"
    engine_id: int | None = None
    knobs: dict[str, int] = field(default_factory=dict)
    tuning: list[dict] | None = field(default=None, repr=False)  # per-candidate timings and verdicts
    evicted: bool = field(default=False, repr=False)

    @classmethod
    def from_entry(cls, key: PlanKey, graph: Any, meta: Mapping[str, Any], load_ms: float) -> "Plan":
        """A plan deserialized from a store entry whose header ``plan`` section is ``meta``."""
        return cls(
            key, graph, tuple(meta["uids"]), int(meta["workspace_size"]), meta["engine"], int(meta.get("candidates", 0)),
            load_ms, source="disk", engine_id=meta.get("engine_id"), knobs=meta.get("knobs") or {}, tuning=meta.get("tuning"),
        )

    def meta(self) -> dict:
        """What the disk store records about the plan (beside the serialized graph)."""
        return {
            "engine": self.engine,
            "engine_id": self.engine_id,
            "knobs": self.knobs,
            "uids": list(self.uids),
            "workspace_size": self.workspace_size,
            "candidates": self.candidates,
            "build_ms": self.build_ms,
            "source": "tuned" if self.source == "tuned" or self.tuning else self.source,
            "tuning": self.tuning,
        }
