"""What one replay runs: the synthetic model shape, the tiers, the policies and the replay's own options
(SPEC §11). Validated on construction; a bad value is a :class:`~kvstrata.impl.errors.ConfigError`
naming the field, what was expected and what was given.

Nothing here imports torch: a configuration (and every error in it) is settled before the pools exist.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import attrs

from kvstrata.impl.config import StorageConfig, enum_converter
from kvstrata.impl.errors import ConfigError
from kvstrata.impl.replay.capacity import Capacity, CapacityKind
from kvstrata.impl.replay.trace import Request
from kvstrata.model.cache import WritePolicy
from kvstrata.model.keys import KVKind, ModelIdentity
from kvstrata.model.l3.policy import PrefetchPolicy

__all__ = [
    "DTYPE_BYTES",
    "L3Backend",
    "ModelShape",
    "ReplayConfig",
    "TierPages",
    "TimestampMode",
]

DTYPE_BYTES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
"""The KV dtypes a replay can use, with their size in bytes."""


DEFAULT_L1 = Capacity(CapacityKind.TOKENS, 256_000, "256k")
DEFAULT_L2 = Capacity(CapacityKind.TOKENS, 1_000_000, "1M")
DEFAULT_L3 = Capacity(CapacityKind.TOKENS, 4_000_000, "4M")


class L3Backend(enum.Enum):
    MOONCAKE = "mooncake"
    MEMORY = "memory"
    FILE = "file"


class TimestampMode(enum.Enum):
    IGNORE = "ignore"  # requests back to back
    HONOUR = "honour"  # wait for each request's timestamp, scaled by ``speed``


def _positive_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{attribute.name}: expected an int >= 1, got {value!r}")


def _non_negative_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{attribute.name}: expected an int >= 0, got {value!r}")


def _positive_float(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{attribute.name}: expected a number > 0, got {value!r}")


def _dtype(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in DTYPE_BYTES:
        raise ConfigError(f"dtype: expected one of {', '.join(DTYPE_BYTES)}, got {value!r}")


def _kv_kind(value: object) -> KVKind:
    if isinstance(value, KVKind) and value is not KVKind.EMBEDDING:
        return value
    if isinstance(value, str) and value.lower() in ("mha", "mla"):
        return KVKind(value.lower())
    raise ConfigError(f"kind: expected 'mha' or 'mla', got {value!r}")


@attrs.frozen
class ModelShape:
    """The synthetic model whose KV the pools hold. The default, MHA with 2 layers, 1 head of dim 2 in
    float16, is 16 bytes per token (4 per token per layer and plane): small enough to replay the
    whole public trace on a laptop. Invariant: MLA has exactly one head (its latent)."""

    kind: KVKind = attrs.field(default=KVKind.MHA, converter=_kv_kind)
    layers: int = attrs.field(default=2, validator=_positive_int)
    heads: int = attrs.field(default=1, validator=_positive_int)
    head_dim: int = attrs.field(default=2, validator=_positive_int)
    dtype: str = attrs.field(default="float16", validator=_dtype)

    def __attrs_post_init__(self) -> None:
        if self.kind is KVKind.MLA and self.heads != 1:
            raise ConfigError(f"heads: MLA has one latent head, got {self.heads}")

    @property
    def planes(self) -> int:
        return 2 if self.kind is KVKind.MHA else 1

    @property
    def bytes_per_token(self) -> int:
        return self.planes * self.layers * self.heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def describe(self) -> str:
        """E.g. ``MHA 2 layers x 1 head x dim 2, float16 = 16 B/token``."""
        return (
            f"{self.kind.name} {self.layers} layers x {self.heads} head(s) x dim {self.head_dim}, "
            f"{self.dtype} = {self.bytes_per_token} B/token"
        )

    def identity(self, page_size: int, seed: int) -> ModelIdentity:
        """The model identity in store keys: every parameter that changes the KV bytes (the shape, the
        dtype, the page size and the synthetic KV's seed), so runs that differ in any of them never
        read each other's pages from a shared store."""
        name = (
            f"kvstrata-replay-{self.kind.value}-l{self.layers}-h{self.heads}-d{self.head_dim}"
            f"-s{seed}"
        )
        return ModelIdentity(name=name, dtype=self.dtype, kind=self.kind, page_size=page_size)


@attrs.frozen
class TierPages:
    """Pages per tier (0: off). Invariant: ``l1 >= 1``; ``l3 > 0`` implies ``l2 > 0``."""

    l1: int
    l2: int
    l3: int


def _write_policy(value: object) -> WritePolicy:
    converted: WritePolicy = enum_converter(WritePolicy, "write_policy")(value)
    return converted


def _prefetch_policy(value: object) -> PrefetchPolicy:
    converted: PrefetchPolicy = enum_converter(PrefetchPolicy, "prefetch_policy")(value)
    return converted


def _l3_backend(value: object) -> L3Backend:
    converted: L3Backend = enum_converter(L3Backend, "l3_backend")(value)
    return converted


def _timestamps(value: object) -> TimestampMode:
    if value == "honor":
        value = "honour"
    converted: TimestampMode = enum_converter(TimestampMode, "timestamps")(value)
    return converted


def _capacity(value: object, flag: str, allow_off: bool) -> Capacity:
    if isinstance(value, Capacity):
        if value.is_off and not allow_off:
            raise ConfigError(f"{flag}: this tier cannot be off")
        return value
    if isinstance(value, str | int) and not isinstance(value, bool):
        return Capacity.parse(value, flag=flag, allow_off=allow_off)
    raise ConfigError(f"{flag}: expected a capacity like '3M', '4gb' or 'inf', got {value!r}")


def _l1(value: object) -> Capacity:
    return _capacity(value, "--l1", allow_off=False)


def _l2(value: object) -> Capacity:
    return _capacity(value, "--l2", allow_off=True)


def _l3(value: object) -> Capacity:
    return _capacity(value, "--l3", allow_off=True)


def _default_l3(instance: ReplayConfig) -> Capacity:
    return Capacity(CapacityKind.OFF, 0, "off") if instance.l2.is_off else DEFAULT_L3


@attrs.frozen
class ReplayConfig:
    """Everything one replay run depends on (besides the trace).

    Tiers: ``l1`` is required to hold at least one page; ``l2`` and ``l3`` may be off; L3 needs L2 (it
    stages pages in the host pool), so with ``l2`` off ``l3`` defaults to off and an explicit L3 is an
    error. ``master`` (``host:port``) selects a configured Mooncake cluster instead of starting a local
    one; the cluster's own size then governs, so ``l3`` only turns L3 on or off.
    """

    l1: Capacity = attrs.field(default=DEFAULT_L1, converter=_l1)
    l2: Capacity = attrs.field(default=DEFAULT_L2, converter=_l2)
    l3: Capacity = attrs.field(default=attrs.Factory(_default_l3, takes_self=True), converter=_l3)
    page_size: int = attrs.field(default=64, validator=_positive_int)
    shape: ModelShape = attrs.field(factory=ModelShape)
    l3_backend: L3Backend = attrs.field(default=L3Backend.MOONCAKE, converter=_l3_backend)
    master: str | None = None
    l3_dir: str | None = None
    write_policy: WritePolicy = attrs.field(
        default=WritePolicy.WRITE_THROUGH, converter=_write_policy
    )
    prefetch_policy: PrefetchPolicy = attrs.field(
        default=PrefetchPolicy.WAIT_COMPLETE, converter=_prefetch_policy
    )
    prefetch_threshold: int = attrs.field(default=256, validator=_non_negative_int)
    timestamps: TimestampMode = attrs.field(default=TimestampMode.IGNORE, converter=_timestamps)
    speed: float = attrs.field(default=1.0, validator=_positive_float)
    verify: bool = True
    settle: bool = False
    seed: int = attrs.field(default=0, validator=_non_negative_int)
    wait_limit_s: float = attrs.field(default=300.0, validator=_positive_float)
    tp: int = attrs.field(default=1, validator=_positive_int)  # TP ranks (processes, gloo)
    key_schema: int = attrs.field(default=2, validator=attrs.validators.in_((1, 2)))
    """The L3 key schema (:class:`~kvstrata.model.keys.KeySpace`): 2, one store object per page from
    a ``page_major`` host pool (the default: it moves small pages faster, docs/benchmarks.md); 1,
    one object per K and V plane from a ``page_first_direct`` pool."""

    def __attrs_post_init__(self) -> None:
        if self.tp > 1 and self.timestamps is TimestampMode.HONOUR:
            raise ConfigError(
                "--tp with --timestamps honour: idling until a timestamp reads each rank's own "
                "clock, so the ranks would not call check_events alike; use --timestamps ignore"
            )
        if self.l2.is_off and not self.l3.is_off:
            raise ConfigError(
                f"--l3 {self.l3}: L3 needs an L2 (host) tier to stage its pages; give --l2 a "
                "capacity or turn L3 off with --l3 0"
            )
        if self.master is not None and self.l3_backend is not L3Backend.MOONCAKE:
            raise ConfigError(
                f"--master names a Mooncake cluster, but --l3-backend is {self.l3_backend.value}"
            )
        if self.l3_dir is not None and self.l3_backend is not L3Backend.FILE:
            raise ConfigError("--l3-dir is the root of the file backend: use --l3-backend file")

    @property
    def has_l3(self) -> bool:
        return not self.l3.is_off

    def storage_config(self) -> StorageConfig:
        """How the cache uses L3 in this replay."""
        return StorageConfig(
            prefetch_threshold=self.prefetch_threshold, prefetch_policy=self.prefetch_policy
        )

    def tier_pages(self, requests: Sequence[Request]) -> TierPages:
        """The tiers' capacities in pages for ``requests`` (``inf``: every full page of the trace).
        :class:`ConfigError` naming the flag when a capacity cannot hold one page."""
        size, per_token = self.page_size, self.shape.bytes_per_token
        unbounded = sum(request.input_length // size for request in requests)

        def pages(capacity: Capacity, flag: str) -> int:
            return capacity.pages(size, per_token, unbounded, flag=flag)

        return TierPages(pages(self.l1, "--l1"), pages(self.l2, "--l2"), pages(self.l3, "--l3"))

    def with_l1(self, l1: Capacity) -> ReplayConfig:
        return attrs.evolve(self, l1=l1)

    def describe(self) -> dict[str, Any]:
        """The configuration as plain JSON values (the ``config`` object of the result)."""
        return {
            "page_size": self.page_size,
            "shape": {
                "kind": self.shape.kind.value,
                "layers": self.shape.layers,
                "heads": self.shape.heads,
                "head_dim": self.shape.head_dim,
                "dtype": self.shape.dtype,
                "bytes_per_token": self.shape.bytes_per_token,
            },
            "capacity": {"l1": str(self.l1), "l2": str(self.l2), "l3": str(self.l3)},
            "l3_backend": self.l3_backend.value if self.has_l3 else None,
            "master": self.master,
            "write_policy": self.write_policy.value,
            "prefetch_policy": self.prefetch_policy.value,
            "prefetch_threshold": self.prefetch_threshold,
            "timestamps": self.timestamps.value,
            "speed": self.speed,
            "verify": self.verify,
            "settle": self.settle,
            "seed": self.seed,
            "tp": self.tp,
            "key_schema": self.key_schema,
        }
