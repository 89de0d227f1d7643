"""Cost-model presets: measured profiles (time coefficients and memory constants) and the memory model
that turns a profile plus an optimiser layout into a ``CostModel`` with ``max_tokens`` per scheme.

Memory model (DESIGN.md section 9): ``M(S) = L*S*(H/tp)*A_tp + M_states + reserved`` with
``M_states = (L/os_pp)(H^2/os_tp)*B*alpha/os_dp + (L/pp)(H^2/tp)*B*(1-alpha)
+ (H*V/os_tp)*e(os_pp)*alpha/os_dp + (H*V/tp)*e(pp)*(1-alpha)``, ``e(p) = 32 if p == 1 else 16``;
the longest sequence is ``(bound - safety - M_states - reserved) / (L*(H/tp)*A_tp)`` rounded down to 128.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from passes.ir import CostModel, ParallelScheme, PlanError, SchemeCost, Strategy
from passes.plan_placement import group_aligns

__all__ = [
    "Profile",
    "PRESET_MODELS",
    "PRESET_HARDWARE",
    "load_profile",
    "load_profile_file",
    "state_bytes",
    "max_tokens_for",
    "build_cost_model",
    "default_optimizer_layout",
]

MIB = 2**20
GIB = 2**30
TOKEN_ROUNDING = 128
PRESET_MODELS = ("llama-7b", "llama-13b", "llama-32b")
PRESET_HARDWARE = ("a800-80g",)
_PROFILE_FILES = {"a800-80g": "a800-{model}.json"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Measured facts about one model on one kind of GPU: time coefficients and memory constants."""

    name: str
    """``model@hardware``."""
    layers: int
    """Transformer layers L."""
    hidden: int
    """Hidden size H."""
    vocab: int
    """Vocabulary size V."""
    gpus_per_node: int
    """GPUs per node."""
    memory_bound_mib: float
    """Usable device memory, MiB."""
    reserved_mib: float
    """Memory reserved per GPU (framework, communication buffers), MiB."""
    safety_gib: float
    """Safety margin kept free, GiB."""
    state_bytes_per_h2_layer: float
    """B: bytes of parameters+gradients+optimiser state per H^2 per layer."""
    shardable_fraction: float
    """alpha: share of the states that the optimiser layout shards."""
    activation_bytes: tuple[tuple[int, float], ...]
    """A_tp: activation bytes per token per hidden unit per layer, by TP degree."""
    coefficients: tuple[tuple[ParallelScheme, float, float, float], ...]
    """(scheme, a, b, c) per profiled scheme."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "vocab", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"profile {self.name!r}: {name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.shardable_fraction <= 1.0:
            raise PlanError(f"profile {self.name!r}: shardable fraction must be in [0, 1], got {self.shardable_fraction!r}")
        for scheme, a, b, c in self.coefficients:
            SchemeCost(scheme=scheme, a=a, b=b, c=c, max_tokens=0)  # validates the numbers

    def activation_bytes_for(self, tp: int) -> float:
        """A_tp for one TP degree; an unprofiled degree is an error naming the known ones."""
        table = dict(self.activation_bytes)
        if tp not in table:
            raise PlanError(f"profile {self.name!r} has no activation size for tp={tp}; known: {sorted(table)}")
        return table[tp]

    @property
    def schemes(self) -> tuple[ParallelScheme, ...]:
        """Every profiled scheme."""
        return tuple(s for s, *_ in self.coefficients)

    @classmethod
    def from_dict(cls, data: dict, name: str | None = None) -> "Profile":
        """Parse the JSON form of ``shared/data/profiles`` (and of ``hcompile profile`` output)."""
        try:
            model, hw, mem = data["model"], data["hardware"], data["memory"]
            coefficients = tuple(
                (ParallelScheme(tp=int(s["tp"]), pp=int(s["pp"]), cp=int(s.get("cp", 1))),
                 float(s["a"]), float(s["b"]), float(s["c"]))
                for s in data["schemes"]
            )
            return cls(
                name=name or f"{model['name']}@{hw.get('name', hw.get('gpu', 'unknown'))}",
                layers=int(model["layers"]), hidden=int(model["hidden"]), vocab=int(model["vocab"]),
                gpus_per_node=int(hw["gpus_per_node"]),
                memory_bound_mib=float(hw["memory_bound_mib"]),
                reserved_mib=float(hw["reserved_mib_per_gpu"]),
                safety_gib=float(mem["safety_margin_gib"]),
                state_bytes_per_h2_layer=float(mem["state_bytes_per_hidden2_layer"]),
                shardable_fraction=float(data["optimizer_shardable_fraction"]),
                activation_bytes=tuple(sorted((int(k), float(v)) for k, v in
                                              mem["activation_bytes_per_token_hidden_layer"].items())),
                coefficients=coefficients,
            )
        except (KeyError, TypeError) as exc:
            raise PlanError(f"profile {name or '?'} is missing or has a malformed field: {exc}") from None


def load_profile(model: str, hardware: str = "a800-80g") -> Profile:
    """The preset profile of ``model`` (``llama-7b``/``llama-13b``/``llama-32b``) on ``hardware``."""
    if model not in PRESET_MODELS:
        raise PlanError(f"unknown model {model!r}; known: {', '.join(PRESET_MODELS)}")
    if hardware not in PRESET_HARDWARE:
        raise PlanError(f"unknown hardware {hardware!r}; known: {', '.join(PRESET_HARDWARE)}")
    filename = _PROFILE_FILES[hardware].format(model=model)
    text = resources.files("passes").joinpath("data", "profiles", filename).read_text()
    return Profile.from_dict(json.loads(text), name=f"{model}@{hardware}")


def load_profile_file(path: str | Path) -> Profile:
    """A profile JSON written by ``hcompile profile`` or in the presets' format."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"profile file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"profile file {str(path)!r} is not valid JSON: {exc}") from None
    return Profile.from_dict(data, name=path.stem)


def _embedding_factor(pp: int) -> int:
    return 32 if pp == 1 else 16


def state_bytes(profile: Profile, scheme: ParallelScheme, layout: Strategy) -> float:
    """M_states of ``scheme`` on one GPU when the optimiser layout is the homogeneous ``layout``."""
    if not layout.is_homogeneous:
        raise PlanError(f"the optimiser layout must be homogeneous, got {layout.describe()}")
    os_scheme, os_dp = layout.parts[0]
    L, H, V = profile.layers, profile.hidden, profile.vocab
    B, alpha = profile.state_bytes_per_h2_layer, profile.shardable_fraction
    tp, pp = scheme.tp, scheme.pp
    return (
        (L / os_scheme.pp) * (H * H / os_scheme.tp) * B * alpha / os_dp
        + (L / pp) * (H * H / tp) * B * (1 - alpha)
        + (H * V / os_scheme.tp) * _embedding_factor(os_scheme.pp) * alpha / os_dp
        + (H * V / tp) * _embedding_factor(pp) * (1 - alpha)
    )


def max_tokens_for(profile: Profile, scheme: ParallelScheme, layout: Strategy) -> int:
    """Longest micro-batch (tokens, multiple of 128, 0 when nothing fits) of ``scheme`` under ``layout``."""
    free = (
        profile.memory_bound_mib * MIB
        - profile.safety_gib * GIB
        - profile.reserved_mib * MIB
        - state_bytes(profile, scheme, layout)
    )
    per_token = profile.layers * (profile.hidden / scheme.tp) * profile.activation_bytes_for(scheme.tp) / scheme.cp
    tokens = int(math.floor(free / per_token / TOKEN_ROUNDING)) * TOKEN_ROUNDING
    return max(tokens, 0)


def build_cost_model(profile: Profile, optimizer_layout: Strategy) -> CostModel:
    """Every profiled scheme with its coefficients and its ``max_tokens`` under ``optimizer_layout``."""
    entries = tuple(
        SchemeCost(scheme=s, a=a, b=b, c=c, max_tokens=max_tokens_for(profile, s, optimizer_layout))
        for s, a, b, c in profile.coefficients
    )
    return CostModel(name=f"{profile.name} layout {optimizer_layout.describe()}", entries=entries,
                     gpus_per_node=profile.gpus_per_node)


def default_optimizer_layout(profile: Profile, gpus: int, longest_seq: int) -> Strategy:
    """The homogeneous strategy sized for ``longest_seq``: the fewest GPUs per replica whose scheme holds it
    under its own layout (ties: fewer pipeline stages). ``4x(tp16,pp1)`` for llama-32b on 64 GPUs."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"the GPU count must be a positive integer, got {gpus!r}")
    candidates, supported = [], []
    for scheme in profile.schemes:
        if gpus % scheme.gpus or not group_aligns(scheme.tp * scheme.cp, profile.gpus_per_node):
            continue
        layout = Strategy.homogeneous(scheme, gpus)
        tokens = max_tokens_for(profile, scheme, layout)
        supported.append(tokens)
        if tokens >= longest_seq:
            candidates.append((scheme.gpus, scheme.pp, scheme.cp, -scheme.tp, layout))
    if not supported:
        sizes = sorted({s.gpus for s in profile.schemes})
        raise PlanError(f"no strategy of {profile.name} fills {gpus} GPUs (replica sizes: {sizes})")
    if not candidates:
        raise PlanError(f"a sequence of {longest_seq} tokens is longer than every scheme of {profile.name} can hold "
                        f"on {gpus} GPUs (longest supported: {max(supported)} tokens)")
    return min(candidates, key=lambda c: c[:4])[-1]
