"""What the vLLM connector reads from vLLM's config, beyond what the store options say: its own
counts (``l2_pages``, ``staging_pages``) and flags (``async_backup``), the engine identity of its
pages (the KV format of a KV vLLM keeps as bytes, what fixes the model's weights:
:class:`~kvstrata.model.engines.EngineShard`) and how far vLLM plans ahead of its reports. Pure
functions of the config; no vLLM import but the platform's fp8 type, looked up when a byte-typed
KV needs it."""

from __future__ import annotations

from typing import Any

import torch

from kvstrata.impl.errors import ConfigError
from kvstrata.model.engines import engine_kv_format, engine_weights, holds_bytes

__all__ = [
    "agreed_backend",
    "attention_backends",
    "backend_option",
    "count_option",
    "flag_option",
    "kv_format",
    "model_weights",
    "platform_writer",
    "report_lag",
    "writing_backend",
]


def count_option(extra: dict[str, Any], key: str, default: int) -> int:
    """The extra config's ``key``, an int >= 1 (``default`` when absent); :class:`ConfigError`."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"kvstrata vLLM connector: key {key!r} expects an int >= 1, got {value!r}"
        )
    return value


def kv_format(dtype: torch.dtype, cache_dtype: Any, where: str) -> str:
    """The logical element type of a KV vLLM keeps as bytes (``""`` when ``dtype`` is the element
    type): its ``--kv-cache-dtype`` on this platform (``fp8`` is e4m3fnuz on ROCm's MI300)."""
    if not holds_bytes(dtype):
        return ""
    configured = str(cache_dtype or "auto")
    if configured == "auto":
        raise ConfigError(
            f"{where}: vLLM keeps this KV as {dtype} but its cache dtype is 'auto': kvstrata "
            "cannot tell which format the bytes are in (set --kv-cache-dtype)"
        )
    from vllm.platforms import current_platform  # noqa: PLC0415 (vLLM picks it at first use)

    return engine_kv_format(configured, str(current_platform.fp8_dtype()))


def model_weights(model_config: Any) -> str:
    """What fixes the weights beyond the model's path, where the operator chose it: the revision
    asked for (vLLM resolves every Hub model's revision, to ``main`` when none was asked; that
    default is left out, so nodes that could and could not resolve it agree) and a weight
    quantization the checkpoint does not carry (online quantization; a quantized checkpoint's own
    method is named by its path). ``""`` when neither: the identity earlier versions gave."""
    revision = getattr(model_config, "revision", None)
    revision = getattr(revision, "initial", revision)  # huggingface_hub's ResolvedRevision
    arch = getattr(model_config, "model_arch_config", None)
    from_checkpoint = getattr(arch, "quantization_config", None) or getattr(
        getattr(model_config, "hf_config", None), "quantization_config", None
    )
    quantization = None if from_checkpoint else getattr(model_config, "quantization", None)
    return engine_weights(revision, quantization)


def report_lag(vllm_config: Any, pp_size: int) -> int:
    """How many plans vLLM builds after a step's plan before it takes that step's output (its
    engine core's batch queue holds ``max_concurrent_batches`` steps): at least 1, the one step
    ahead of async scheduling, so a report is taken back whichever runner vLLM picked."""
    batches = getattr(vllm_config, "max_concurrent_batches", None)
    if not isinstance(batches, int):  # an older vLLM: 0.33's rule, which may count one more
        # plan than its queue held (a larger lag only keeps saves and staging slots longer)
        asynchronous = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        batches = pp_size + 1 if asynchronous else pp_size
    return max(1, batches - 1)


def attention_backends(vllm_config: Any, layer_names: list[str]) -> set[str]:
    """The attention backends that run ``layer_names`` in this process, by name (``get_name()``,
    then ``:`` and the kernel's ``isa`` where a layer has one: vLLM's CPU backend): vLLM's layers
    in its forward context, there once the model is loaded (in a worker by the time it registers
    its KV caches; the CPU backend's metadata builder has set each layer's ``isa`` by then);
    empty where none of them is."""
    layers = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    names = set()
    for name in layer_names:
        if name in layers:
            backend = str(layers[name].get_attn_backend().get_name())
            isa = getattr(layers[name], "isa", None)
            names.add(f"{backend}:{isa}" if isa else backend)
    return names


def writing_backend(backends: set[str], dtype: object, configured: object, where: str) -> str:
    """The :attr:`~kvstrata.model.engines.EngineShard.kv_backend` of a worker whose layers run on
    ``backends`` (:func:`attention_backends`): for a KV vLLM keeps as bytes, the one backend that
    writes it and the platform's fp8 type (the kernels decide what the bytes mean: Triton keeps
    every fp8 cache in that type, ``fp8_e5m2`` included, and it is ``float8_e4m3fnuz`` on ROCm's
    MI300), ``"TRITON_ATTN on float8_e4m3fn"``; ``""`` for any other KV, whose bytes mean the
    same whichever backend wrote them. ``configured``: the backend the operator named (the
    ``kv_backend`` extra config), checked against the one found. :class:`ConfigError` for a
    byte-typed KV written by several backends, by none known, or by another than configured."""
    if configured is not None and backends != {configured}:
        raise ConfigError(
            f"{where}: kv_backend is {configured!r}, but {sorted(backends) or 'no known backend'} "
            "writes the KV"
        )
    if not holds_bytes(dtype):
        return ""
    if len(backends) != 1:
        raise ConfigError(
            f"{where}: a KV vLLM keeps as {dtype} is written by attention backends "
            f"{sorted(backends) or 'unknown'}: its pages are keyed by the one backend that writes "
            "them (set one attention backend)"
        )
    return platform_writer(next(iter(backends)))


def platform_writer(backend: str | None) -> str:
    """``backend`` on this platform: its name and the platform's fp8 type (``""`` for none)."""
    if backend is None:
        return ""
    from vllm.platforms import current_platform  # noqa: PLC0415 (vLLM picks it at first use)

    return f"{backend} on {str(current_platform.fp8_dtype()).removeprefix('torch.')}"


def agreed_backend(reported: list[str], where: str) -> str | None:
    """The writing backend every worker reported in vLLM's connector handshake (``reported``: one
    :func:`writing_backend` per worker); ``None`` when no worker reported.
    :class:`ConfigError` when workers disagree (none would find the others' pages)."""
    named = set(reported)
    if len(named) > 1:
        raise ConfigError(f"{where}: workers write their KV with other backends: {sorted(named)}")
    return named.pop() if named else None


def backend_option(extra: dict[str, Any], where: str) -> str | None:
    """The ``kv_backend`` extra config: the attention backend the operator says writes a KV kept
    as bytes (vLLM's name, ``"TRITON_ATTN"``; the CPU backend's with its kernel,
    ``"CPU_ATTN:vec"``), so the scheduler side needs no handshake (under a ``MultiConnector``
    whose first connector has a handshake of its own). ``None`` when not given."""
    value = extra.get("kv_backend")
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{where}: kv_backend must be an attention backend's name, got {value!r}")
    return value


def flag_option(extra: dict[str, Any], key: str, default: bool, where: str) -> bool:
    """The extra config's ``key``, a bool (``default`` when absent); :class:`ConfigError`."""
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: key {key!r} expects true or false, got {value!r}")
    return value
