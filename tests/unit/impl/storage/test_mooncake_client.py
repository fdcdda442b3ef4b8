"""MooncakeConfig (sources, precedence, validation), the return-code table, and MooncakeClient (its
state machine, argument checks and the native calls against the session's real master).

Calls that would crash the native client (before setup, after close) are made here only where the
wrapper refuses them without touching the native object; the after-close calls on a real, closed
connection run in a subprocess in test_mooncake_faults.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstrata.impl.errors import (
    ConfigError,
    MisuseError,
    StoreError,
    StoreFull,
    StoreNotReady,
    StoreTimeout,
    StoreUnavailable,
)
from kvstrata.impl.storage.mooncake import (
    ENV_VARS,
    ClientHealth,
    ClientState,
    ErrorKind,
    MooncakeClient,
    MooncakeConfig,
    classify,
)
from kvstrata.impl.storage.mooncake.client import TRANSITIONS, ClientEvent
from kvstrata.impl.storage.mooncake.cluster import free_port
from kvstrata.impl.storage.mooncake.codes import describe, error_for
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    StoreKey,
    chain_page_hashes,
)

MASTER = "10.1.2.3:50051"


# ------------------------------------------------------------------------------------------ config
def test_config_defaults_and_sizes() -> None:
    config = MooncakeConfig(master=MASTER)
    assert (config.master_host, config.master_port) == ("10.1.2.3", 50051)
    assert config.metadata_server == "P2PHANDSHAKE"
    assert (config.protocol, config.device_name, config.local_hostname) == ("tcp", "", "127.0.0.1")
    assert config.global_segment_size == 0
    assert config.setup_retries == 2

    sized = MooncakeConfig(
        master="[::1]:9", global_segment_size="64mib", local_buffer_size="0", protocol="RDMA"
    )
    assert sized.global_segment_size == 64 << 20
    assert sized.local_buffer_size == 0
    assert sized.protocol == "rdma"
    assert sized.master_host == "::1"
    assert (
        MooncakeConfig(master=MASTER, global_segment_size="16777216").global_segment_size
        == 16 << 20
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("master", "nohost"),
        ("master", "host:0"),
        ("master", "host:70000"),
        ("master", "two words:1"),
        ("protocol", "udp"),
        ("metadata_server", ""),
        ("device_name", "mlx5 0"),
        ("local_hostname", "127.0.0.1:1234"),
        ("global_segment_size", -1),
        ("global_segment_size", "lots"),
        ("global_segment_size", True),
        ("global_segment_size", "1mib"),
        ("local_buffer_size", 1.5),
        ("setup_retries", 0),
        ("setup_retries", 21),
        ("setup_retries", "two"),
        ("probe_timeout", 0),
        ("probe_timeout", float("nan")),
        ("probe_timeout", 61),
    ],
)
def test_config_refuses_bad_values_naming_the_field(field: str, value: object) -> None:
    values: dict[str, object] = {"master": MASTER, field: value}
    with pytest.raises(ConfigError, match=f"^{field}: "):
        MooncakeConfig(**values)  # type: ignore[arg-type]


def test_config_from_json_and_toml_files(tmp_path: Path) -> None:
    json_file = tmp_path / "mc.json"
    json_file.write_text(json.dumps({"master": MASTER, "global_segment_size": "1gib"}))
    assert MooncakeConfig.from_file(json_file).global_segment_size == 1 << 30

    toml_file = tmp_path / "kvstrata.toml"
    toml_file.write_text(
        '[mooncake]\nmaster = "127.0.0.1:7000"\nprotocol = "tcp"\nsetup_retries = 3\n'
        "\n[other_component]\nanything = 1\n"
    )
    config = MooncakeConfig.from_file(toml_file)
    assert (config.master, config.setup_retries) == ("127.0.0.1:7000", 3)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("typo.json", '{"master": "h:1", "segment": 5}', r"unknown field\(s\) \['segment'\]"),
        ("bad.json", "{", "not valid json"),
        ("bad.toml", "master = ", "not valid toml"),
        ("list.json", "[1]", "table of fields"),
        ("conf.yaml", "master: h:1", r"\.json or \.toml"),
        ("bad_value.toml", 'master = "h:1"\nprotocol = "udp"', "protocol: .* file"),
    ],
)
def test_config_file_errors(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        MooncakeConfig.from_file(path)


def test_config_missing_file_and_missing_master(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        MooncakeConfig.from_file(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match=f"master: required .*{ENV_VARS['master']}"):
        MooncakeConfig.from_env({})
    with pytest.raises(ConfigError, match="unknown field"):
        MooncakeConfig.from_mapping({"master": MASTER, "port": 1})


def test_config_from_env() -> None:
    env = {
        "KVSTRATA_MOONCAKE_MASTER": MASTER,
        "KVSTRATA_MOONCAKE_GLOBAL_SEGMENT_SIZE": "2gib",
        "KVSTRATA_MOONCAKE_SETUP_RETRIES": "4",
        "KVSTRATA_MOONCAKE_PROBE_TIMEOUT": "0.5",
        "KVSTRATA_MOONCAKE_DEVICE_NAME": "",  # empty means unset
    }
    config = MooncakeConfig.from_env(env)
    assert (config.global_segment_size, config.setup_retries) == (2 << 30, 4)
    assert config.probe_timeout == 0.5
    assert set(ENV_VARS.values()) >= set(env)
    with pytest.raises(ConfigError, match=r"setup_retries: .*KVSTRATA_MOONCAKE_SETUP_RETRIES"):
        MooncakeConfig.from_env({**env, "KVSTRATA_MOONCAKE_SETUP_RETRIES": "0"})


def test_config_precedence_is_arguments_then_env_then_file_then_defaults(tmp_path: Path) -> None:
    path = tmp_path / "mc.toml"
    path.write_text('master = "file:1"\nprotocol = "rdma"\nsetup_retries = 5\nprobe_timeout = 9\n')
    env = {
        "KVSTRATA_MOONCAKE_CONFIG": str(path),
        "KVSTRATA_MOONCAKE_MASTER": "env:2",
        "KVSTRATA_MOONCAKE_SETUP_RETRIES": "6",
    }
    config = MooncakeConfig.load(env=env, setup_retries=7, device_name=None)
    assert config.setup_retries == 7  # argument
    assert config.master == "env:2"  # environment over file
    assert (config.protocol, config.probe_timeout) == ("rdma", 9.0)  # file over defaults
    assert config.local_hostname == "127.0.0.1"  # default
    assert MooncakeConfig.load(path, env={}).master == "file:1"
    assert MooncakeConfig.load(env={}, master="arg:3") == MooncakeConfig(master="arg:3")
    with pytest.raises(ConfigError, match=r"probe_timeout: .*arguments"):
        MooncakeConfig.load(env=env, probe_timeout=-1)
    with pytest.raises(ConfigError, match="unknown field"):
        MooncakeConfig.load(env=env, segment="1gb")


# ------------------------------------------------------------------------------------------- codes
@pytest.mark.parametrize(
    ("code", "kind", "error"),
    [
        (-200, ErrorKind.FULL, StoreFull),
        (-704, ErrorKind.MISSING, StoreError),
        (-703, ErrorKind.NOT_READY, StoreNotReady),
        (-706, ErrorKind.LEASE, StoreError),
        (-707, ErrorKind.LEASE, StoreError),
        (-800, ErrorKind.TRANSFER, StoreError),
        (-900, ErrorKind.UNAVAILABLE, StoreUnavailable),
        (-1, ErrorKind.UNAVAILABLE, StoreUnavailable),
        (-1005, ErrorKind.UNAVAILABLE, StoreUnavailable),
        (-901, ErrorKind.TIMEOUT, StoreTimeout),
        (-600, ErrorKind.INVALID, StoreError),
        (-4242, ErrorKind.OTHER, StoreError),
    ],
)
def test_codes_classify_and_raise_typed(code: int, kind: ErrorKind, error: type) -> None:
    assert classify(code) is kind
    raised = error_for(code, "call")
    assert type(raised) is error
    assert str(code) in str(raised) and "call" in str(raised)


def test_codes_success_has_no_kind() -> None:
    with pytest.raises(ValueError, match="success"):
        classify(0)
    assert describe(-200) == "-200 NO_AVAILABLE_HANDLE"
    assert describe(-4242) == "-4242"
    assert issubclass(StoreTimeout, StoreUnavailable)


# ------------------------------------------------------------------------------ client, no native
def test_client_lifecycle_table() -> None:
    assert TRANSITIONS[(ClientState.NEW, ClientEvent.SETUP_OK)] is ClientState.READY
    assert TRANSITIONS[(ClientState.FAILED, ClientEvent.SETUP_OK)] is ClientState.READY
    assert all(
        TRANSITIONS[(state, ClientEvent.CLOSE)] is ClientState.CLOSED for state in ClientState
    )
    assert all(
        state is not ClientState.CLOSED
        for state, event in TRANSITIONS
        if event is not ClientEvent.CLOSE
    )
    assert (ClientState.READY, ClientEvent.SETUP_OK) not in TRANSITIONS


def test_client_refuses_every_call_before_setup_without_touching_native() -> None:
    client = MooncakeClient(MooncakeConfig(master=f"127.0.0.1:{free_port()}"))
    assert client.state is ClientState.NEW
    assert client.health() is ClientHealth.NOT_READY
    keys = [_key("a")]
    for call in (
        lambda: client.batch_is_exist(keys),
        lambda: client.batch_put_from(keys, [1], [1]),
        lambda: client.batch_get_into(keys, [1], [1]),
        lambda: client.batch_remove(keys),
        lambda: client.remove_all(force=True),
        lambda: client.register_buffer(4096, 10),
        lambda: client.unregister_buffer(4096),
    ):
        with pytest.raises(StoreUnavailable, match="new"):
            call()
    assert client.native_store is None  # nothing to call before setup
    client.close()
    client.close()
    assert client.state is ClientState.CLOSED and client.native_store is None
    with pytest.raises(StoreUnavailable, match="after close"):
        client.setup()
    with pytest.raises(MisuseError):
        MooncakeClient("127.0.0.1:1")  # type: ignore[arg-type]


def test_setup_against_a_dead_master_fails_fast_and_may_be_retried() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    client = MooncakeClient(MooncakeConfig(master=address, probe_timeout=1))
    for _ in range(2):
        with pytest.raises(StoreUnavailable, match=f"master {address} is not reachable"):
            client.setup()
        assert client.state is ClientState.FAILED
        assert client.health() is ClientHealth.NOT_READY
    with pytest.raises(StoreUnavailable), client:
        pass  # entering sets up, which fails
    client.close()
    assert client.state is ClientState.CLOSED


# ------------------------------------------------------------------------------ client, real master
def _key(name: str) -> StoreKey:
    page = chain_page_hashes([ord(c) for c in name], len(name))[0]
    model = ModelIdentity(name="client-test", dtype="uint8", kind=KVKind.MLA, page_size=len(name))
    return KeySpace(model=model).page_keys(Namespace(), page)[0]


def test_client_round_trip_and_removal(mooncake_store: MooncakeClient) -> None:
    client = mooncake_store
    assert client.state is ClientState.READY
    assert client.hostname is not None and client.hostname.startswith("127.0.0.1:")
    assert client.health() is ClientHealth.HEALTHY
    buffer = torch.arange(4 * 4096, dtype=torch.int32).view(torch.uint8)
    base, size = buffer.data_ptr(), 4096
    client.register_buffer(base, buffer.numel())
    try:
        keys = [_key("ab"), _key("cd")]
        assert client.batch_is_exist(keys) == [0, 0]
        assert client.batch_put_from(keys, [base, base + size], [size, size]) == [0, 0]
        assert client.batch_is_exist([*keys, _key("ef")]) == [1, 1, 0]
        got = client.batch_get_into(
            [*keys, _key("ef")], [base + 2 * size, base + 3 * size, base], [size] * 3
        )
        assert got == [size, size, -704]
        assert torch.equal(buffer[2 * size : 4 * size], buffer[: 2 * size])
        assert client.batch_remove(keys[:1], force=True) == [0]
        assert client.batch_is_exist(keys) == [0, 1]
        # the native instance the client calls: the same connection, the same objects
        assert client.native_store.batch_is_exist([k.text for k in keys]) == [0, 1]
        assert client.remove_all(force=True) == 1
        assert client.batch_is_exist([]) == []
    finally:
        client.unregister_buffer(base)


def test_an_object_of_several_ranges_round_trips(mooncake_store: MooncakeClient) -> None:
    """Issue 20: ``batch_put_parts`` stores each object as its ranges concatenated in order (one
    object per key, readable whole by ``batch_get_into``); ``batch_get_parts`` scatters it back;
    a malformed shape or a range outside every registered buffer reaches no native call."""
    client = mooncake_store
    buffer = torch.arange(4096, dtype=torch.int32).view(torch.uint8)  # 16 KiB, distinct bytes
    base = buffer.data_ptr()
    client.register_buffer(base, buffer.numel())
    try:
        keys = [_key("pa"), _key("pb")]  # object = [1 KiB at 8 KiB, 1 KiB at 0], [2 KiB at 4 KiB]
        ptrs, sizes = [[base + 8192, base], [base + 4096]], [[1024, 1024], [2048]]
        assert client.batch_put_parts(keys, ptrs, sizes) == [0, 0]
        got = client.batch_get_into(keys, [base + 12288, base + 14336], [2048, 2048])
        assert got == [2048, 2048]
        assert torch.equal(buffer[12288:13312], buffer[8192:9216])
        assert torch.equal(buffer[13312:14336], buffer[:1024])
        assert torch.equal(buffer[14336:], buffer[4096:6144])
        buffer[12288:] = 0
        back = client.batch_get_parts(keys[:1], [[base + 14336, base + 12288]], [[1024, 1024]])
        assert back == [2048]
        assert torch.equal(buffer[14336:15360], buffer[8192:9216])
        assert torch.equal(buffer[12288:13312], buffer[:1024])
        for bad_ptrs, bad_sizes, message in (
            ([[base]], [[16, 16]], "differ in shape"),
            ([[]], [[]], "differ in shape"),
            ([[base], [base]], [[16], [16]], "differ in shape"),
            ([[base, base - 4096]], [[16, 16]], "not inside a buffer registered"),
        ):
            with pytest.raises(MisuseError, match=message):
                client.batch_put_parts([_key("pc")], bad_ptrs, bad_sizes)
        assert client.batch_is_exist([_key("pc")]) == [0]
        assert client.batch_remove(keys, force=True) == [0, 0]
    finally:
        client.unregister_buffer(base)


def test_ranges_in_two_registered_buffers_pass_and_a_straddling_one_does_not(
    mooncake_store: MooncakeClient,
) -> None:
    """The range check's fast path (one span inside one buffer) never accepts what the range by
    range check refuses: ranges in two buffers pass, a range across a buffer's end does not."""
    client = mooncake_store
    first, second = torch.zeros(8192, dtype=torch.uint8), torch.zeros(8192, dtype=torch.uint8)
    a, b = first.data_ptr(), second.data_ptr()
    client.register_buffer(a, 8192)
    client.register_buffer(b, 8192)
    try:
        keys = [_key("ra"), _key("rb")]
        assert client.batch_put_from(keys, [a, b + 4096], [4096, 4096]) == [0, 0]
        with pytest.raises(MisuseError, match="not inside a buffer registered"):
            client.batch_put_from([_key("rc")], [a + 4096], [8192])  # runs past the first's end
        with pytest.raises(MisuseError, match="pointer"):
            client.batch_put_from([_key("rc")], [True], [1])  # type: ignore[list-item]
        assert client.batch_is_exist([_key("rc")]) == [0]
        assert client.batch_remove(keys, force=True) == [0, 0]
    finally:
        client.unregister_buffer(a)
        client.unregister_buffer(b)


def test_client_checks_arguments_before_any_native_call(mooncake_store: MooncakeClient) -> None:
    client = mooncake_store
    buffer = torch.zeros(8192, dtype=torch.uint8)
    base = buffer.data_ptr()
    client.register_buffer(base, 8192)
    client.register_buffer(base, 8192)  # the same range again: one more reference
    try:
        with pytest.raises(MisuseError, match="overlaps"):
            client.register_buffer(base + 4096, 8192)
        with pytest.raises(MisuseError, match="not inside a buffer registered"):
            client.batch_get_into([_key("gh")], [base + 4096], [8192])  # runs past the end
        with pytest.raises(MisuseError, match="not inside a buffer registered"):
            client.batch_put_from([_key("gh")], [base - 4096], [16])
        with pytest.raises(MisuseError, match="size"):
            client.batch_put_from([_key("gh")], [base], [0])
        with pytest.raises(MisuseError, match="StoreKey"):
            client.batch_is_exist(["kvs1/raw/string"])  # type: ignore[list-item]
        with pytest.raises(MisuseError, match="differ in length"):
            client.batch_put_from([_key("gh")], [base, base], [1])
        with pytest.raises(MisuseError, match="not registered"):
            client.unregister_buffer(base + 1)
        assert client.batch_is_exist([_key("gh")]) == [0]  # nothing above reached the store
    finally:
        client.unregister_buffer(base)
        client.unregister_buffer(base)
    with pytest.raises(MisuseError, match="not registered"):
        client.unregister_buffer(base)


def test_a_release_is_deferred_to_the_next_call(mooncake_store: MooncakeClient) -> None:
    client = mooncake_store
    buffer = torch.zeros(8192, dtype=torch.uint8)
    base = buffer.data_ptr()
    client.register_buffer(base, 4096)
    client.release_buffer_later(base)  # takes no lock: a finalizer may call it anywhere
    client.register_buffer(base, 8192)  # the next call dropped the old range first
    client.unregister_buffer(base)
    with pytest.raises(MisuseError, match="not registered"):
        client.unregister_buffer(base)


def test_a_second_setup_is_misuse_and_changes_nothing(mooncake_client: MooncakeClient) -> None:
    with pytest.raises(MisuseError, match="twice"):
        mooncake_client.setup()
    assert mooncake_client.state is ClientState.READY
    assert "ready" in repr(mooncake_client)
    assert mooncake_client.batch_is_exist([_key("ij")]) == [0]
