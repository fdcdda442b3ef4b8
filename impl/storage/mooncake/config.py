"""How to reach a Mooncake cluster: :class:`MooncakeConfig`, validated on construction (SPEC §9).

Sources and precedence (highest first), as merged by :meth:`MooncakeConfig.load`:

1. keyword arguments (``None`` means "not given", so CLI plumbing can pass its options through);
2. environment variables ``KVSTRATA_MOONCAKE_<FIELD>`` (:data:`ENV_VARS`), e.g.
   ``KVSTRATA_MOONCAKE_MASTER=10.0.0.5:50051``;
3. a JSON or TOML file (by suffix), named by the ``path`` argument or by ``KVSTRATA_MOONCAKE_CONFIG``;
   its keys are the field names, at the top level or inside a ``[mooncake]`` table;
4. the field defaults.

Every value, whatever its source, goes through the same validators; a bad one raises
:class:`~kvstrata.impl.errors.ConfigError` naming the field (and the variable or file it came from),
what was expected and what was given. Unknown keys in a file are refused (a typo is not a default).

Design note: sizes accept ``"64mib"``-style strings through :func:`kvstrata.impl.pools.sizes.parse_size`,
imported only when a string must be parsed. Importing :mod:`kvstrata.impl.pools` pulls in torch (seconds
of start-up), and the storage-node process and the cluster launcher, which only ever pass ints, must not
pay for it.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kvstrata.impl.errors import ConfigError

__all__ = [
    "CONFIG_ENV_VAR",
    "ENV_VARS",
    "MIN_SEGMENT_SIZE",
    "MooncakeConfig",
    "parse_address",
    "to_bytes",
]

ENV_PREFIX = "KVSTRATA_MOONCAKE_"
CONFIG_ENV_VAR = ENV_PREFIX + "CONFIG"
"""Names a JSON or TOML file to read when :meth:`MooncakeConfig.load` is given no path."""

PROTOCOLS = frozenset({"tcp", "rdma"})
MIN_SEGMENT_SIZE = 16 << 20
"""The smallest segment Mooncake mounts (a smaller one fails setup with -600, measured)."""
MAX_SETUP_RETRIES = 20
MAX_PROBE_TIMEOUT = 60.0
_HOST_RE = re.compile(r"[A-Za-z0-9._\-]+\Z")


def parse_address(value: str, *, what: str = "master") -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as ``(host, port)``; :class:`ConfigError` naming
    ``what`` for anything else."""
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected 'host:port', got {value!r}")
    host, sep, port_text = value.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        valid_host = bool(host) and all(c in "0123456789abcdefABCDEF:." for c in host)
    else:
        valid_host = bool(_HOST_RE.match(host))
    if not sep or not valid_host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{what}: expected 'host:port' with a port in 1..65535, got {value!r}")
    return host, int(port_text)


def to_bytes(value: object, field: str) -> int:
    """``value`` (an int, or a string of digits or like ``"64mib"``) as whole bytes >= 0;
    :class:`ConfigError` naming ``field`` otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # plain bytes need no parsing (and no torch import)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if not isinstance(value, str):
        raise ConfigError(
            f"{field}: expected an int of bytes >= 0 or a string like '64mib', got {value!r}"
        )
    from kvstrata.impl.pools.sizes import parse_size  # noqa: PLC0415 (torch; see the docstring)

    return parse_size(value, what=field)


def _global_segment_size(value: object) -> int:
    size = to_bytes(value, "global_segment_size")
    if 0 < size < MIN_SEGMENT_SIZE:
        raise ConfigError(
            f"global_segment_size: expected 0 (no segment) or at least {MIN_SEGMENT_SIZE} bytes "
            f"(16 MiB, Mooncake's minimum), got {value!r}"
        )
    return size


def _local_buffer_size(value: object) -> int:
    return to_bytes(value, "local_buffer_size")


def _setup_retries(value: object) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SETUP_RETRIES:
        raise ConfigError(
            f"setup_retries: expected an int in [1, {MAX_SETUP_RETRIES}], got {value!r}"
        )
    return value


def _probe_timeout(value: object) -> float:
    number: object = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = value
    if (
        isinstance(number, bool)
        or not isinstance(number, int | float)
        or not math.isfinite(number)
        or not 0 < number <= MAX_PROBE_TIMEOUT
    ):
        raise ConfigError(
            f"probe_timeout: expected seconds in (0, {MAX_PROBE_TIMEOUT:g}], got {value!r}"
        )
    return float(number)


def _protocol(value: object) -> str:
    if not isinstance(value, str) or value.strip().lower() not in PROTOCOLS:
        raise ConfigError(f"protocol: expected one of {sorted(PROTOCOLS)}, got {value!r}")
    return value.strip().lower()


def _word(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ConfigError(
            f"{attribute.name}: expected a non-empty string without spaces, got {value!r}"
        )


def _device(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or any(c.isspace() for c in value):
        raise ConfigError(f"{attribute.name}: expected a string without spaces, got {value!r}")


def _master(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    parse_address(value, what=attribute.name)


def _hostname(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not _HOST_RE.match(value):
        raise ConfigError(
            f"{attribute.name}: expected a host name or IP address without a port "
            f"(Mooncake appends one), got {value!r}"
        )


@attrs.frozen
class MooncakeConfig:
    """One client's connection to a Mooncake cluster.

    Invariants (checked on construction): ``master`` is ``host:port``; ``protocol`` is ``tcp`` or
    ``rdma``; sizes are whole bytes; ``global_segment_size`` is 0 (a client that contributes no
    memory, the usual scheduler-side client) or at least 16 MiB; ``setup_retries`` is in
    ``[1, 20]`` (never 0: the retries also cover a clash of the client's random port);
    ``probe_timeout`` is in ``(0, 60]`` seconds.
    """

    master: str = attrs.field(validator=_master)
    """The master's RPC address, ``host:port``."""
    metadata_server: str = attrs.field(default="P2PHANDSHAKE", validator=_word)
    """``P2PHANDSHAKE`` (no metadata server; recommended) or a metadata server URL."""
    protocol: str = attrs.field(default="tcp", converter=_protocol)
    device_name: str = attrs.field(default="", validator=_device)
    """RDMA device names (``""`` for TCP)."""
    local_hostname: str = attrs.field(default="127.0.0.1", validator=_hostname)
    """The address this client advertises to its peers (with P2PHANDSHAKE, verbatim)."""
    global_segment_size: int = attrs.field(default=0, converter=_global_segment_size)
    """Bytes this process contributes to the distributed pool; its objects vanish with it."""
    local_buffer_size: int = attrs.field(default=16 << 20, converter=_local_buffer_size)
    """Mooncake's staging buffer for its bytes API; kvstrata's zero-copy calls do not use it (0 is
    allowed: no buffer)."""
    setup_retries: int = attrs.field(default=2, converter=_setup_retries)
    """``MC_STORE_CLIENT_SETUP_RETRIES``: each retry of an unanswered setup costs about 4.4 s."""
    probe_timeout: float = attrs.field(default=2.0, converter=_probe_timeout)
    """Seconds the TCP probe of the master may take before setup is refused."""

    @property
    def master_host(self) -> str:
        return parse_address(self.master)[0]

    @property
    def master_port(self) -> int:
        return parse_address(self.master)[1]

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain values (what a config file holds)."""
        return attrs.asdict(self)

    # ------------------------------------------------------------------------------ constructors
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, origin: str = "mapping") -> MooncakeConfig:
        """A config from field names to values; :class:`ConfigError` for unknown names."""
        _check_names(values, origin)
        return _construct(dict(values), origin, {})

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MooncakeConfig:
        """A config from a JSON (``.json``) or TOML (``.toml``) file."""
        values, origin = _read_file(Path(path))
        return _construct(values, origin, {})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MooncakeConfig:
        """A config from ``KVSTRATA_MOONCAKE_*`` variables only (``master`` is required)."""
        values = _read_env(os.environ if env is None else env)
        return _construct(values, "environment", {name: ENV_VARS[name] for name in values})

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> MooncakeConfig:
        """Merge keyword arguments > environment > file > defaults (see the module docstring).

        ``path`` defaults to ``$KVSTRATA_MOONCAKE_CONFIG``; ``env`` to ``os.environ``.
        """
        env = os.environ if env is None else env
        given = {name: value for name, value in overrides.items() if value is not None}
        _check_names(given, "arguments")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        if path is None and env.get(CONFIG_ENV_VAR):
            path = env[CONFIG_ENV_VAR]
        if path is not None:
            from_file, origin = _read_file(Path(path))
            values.update(from_file)
            sources.update(dict.fromkeys(from_file, origin))
        from_env = _read_env(env)
        values.update(from_env)
        sources.update({name: ENV_VARS[name] for name in from_env})
        values.update(given)
        sources.update(dict.fromkeys(given, "arguments"))
        return _construct(values, "arguments, environment or file", sources)


FIELDS: tuple[str, ...] = tuple(field.name for field in attrs.fields(MooncakeConfig))
ENV_VARS: dict[str, str] = {name: ENV_PREFIX + name.upper() for name in FIELDS}
"""Field name -> environment variable, e.g. ``master`` -> ``KVSTRATA_MOONCAKE_MASTER``."""


def _check_names(values: Mapping[str, Any], origin: str) -> None:
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"MooncakeConfig ({origin}): unknown field(s) {unknown}; known: {list(FIELDS)}"
        )


def _construct(values: dict[str, Any], origin: str, sources: Mapping[str, str]) -> MooncakeConfig:
    """Build the config; a validation error names where the bad value came from (``sources``:
    field -> variable or file; ``origin`` otherwise)."""
    if "master" not in values:
        raise ConfigError(
            f"master: required ('host:port' of the mooncake_master RPC port), not given in the "
            f"{origin} (argument master=, {ENV_VARS['master']}, or a config file)"
        )
    try:
        return MooncakeConfig(**values)
    except ConfigError as error:
        field = str(error).split(":", 1)[0]
        raise ConfigError(f"{error} (from {sources.get(field, origin)})") from None


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    return {name: env[var] for name, var in ENV_VARS.items() if env.get(var, "") != ""}


def _read_file(path: Path) -> tuple[dict[str, Any], str]:
    origin = f"file {str(path)!r}"
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise ConfigError(f"MooncakeConfig: {origin}: expected a .json or .toml file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"MooncakeConfig: cannot read {origin}: {error}") from None
    try:
        data: Any = json.loads(text) if suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"MooncakeConfig: {origin} is not valid {suffix[1:]}: {error}") from None
    if isinstance(data, dict) and isinstance(data.get("mooncake"), dict):
        data = data["mooncake"]
    if not isinstance(data, dict):
        raise ConfigError(f"MooncakeConfig: {origin} must hold a table of fields")
    _check_names(data, origin)
    return data, origin
