"""model/engines.py, exactly: the tests that kill what its mutation run left alive (issue 20,
part 19; ``python scripts/mutation_score.py 'kvstrata.model.engines.*'``).

An engine's keys outlive the process that rendered them (other deployments, later versions read
them), so the slug and digest formats are pinned to known answers, not only compared with each
other; and a misused shard names what is wrong with it, in words, so every message is pinned too.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import pytest

from kvstrata.model.engines import (
    EngineShard,
    HashScheme,
    engine_kv_format,
    engine_page_hash,
    engine_weights,
    model_slug,
)
from kvstrata.model.errors import MisuseError
from kvstrata.model.keys import KVKind

BASE: dict[str, Any] = {
    "scheme": HashScheme.VLLM, "model_name": "m", "dtype": "bfloat16", "mla": False, "page_size": 16,
}  # fmt: skip


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ------------------------------------------------------------------------------------- model names
@pytest.mark.parametrize(
    ("name", "slug"),
    [
        ("__Org/A__", "org_a"),  # separators at either end are dropped
        ("a" * 39 + "/b", "a" * 39),  # cut at 40 characters, then a trailing "_" dropped
        ("Llama 3 . 1", "llama_3_1"),
    ],
)
def test_a_model_slug_is_the_names_key_safe_form_and_its_digest(name: str, slug: str) -> None:
    assert model_slug(name) == f"m_{slug}_{digest(name)}"


def test_a_name_with_nothing_key_safe_is_its_digest_alone() -> None:
    assert model_slug("###") == f"m_{digest('###')}"


def test_weights_digest_known_answer() -> None:
    """The weights' encoding is part of every such key: pinned, domain tag and all."""
    encoded = json.dumps(["kvstrata.weights.v1", "org/a", "revision=r1"])
    assert model_slug("org/a", "revision=r1") == f"m_org_a_{digest(encoded)}"


# ------------------------------------------------------------------------------------- formats
def test_a_platforms_e5m2_type_is_taken_without_its_torch_prefix() -> None:
    assert engine_kv_format("fp8_e5m2", fp8_e5m2="torch.float8_e4m3fnuz") == "float8_e4m3fnuz"


@pytest.mark.parametrize(("dtype", "segment"), [(" torch.BFloat16 ", "bfloat16"),
                                                ("_bfloat16.", "bfloat16"), ("???", "unknown")])  # fmt: skip
def test_a_dtype_segment_is_the_dtypes_slug_or_unknown(dtype: str, segment: str) -> None:
    assert EngineShard(**{**BASE, "dtype": dtype}).model().dtype == segment


def test_an_mla_shard_is_an_mla_identity_with_one_latent_object() -> None:
    model = EngineShard(**{**BASE, "mla": True}).model()
    assert model.kind is KVKind.MLA and model.components == ("latent",)
    assert EngineShard(**BASE).model().kind is KVKind.MHA


def test_an_mla_shard_is_replicated_across_tp_but_keeps_its_pipeline_stage() -> None:
    """MLA KV is the same on every TP rank but not on every pipeline stage (a stage holds its
    own layers): stage 1 of 2 is its own shard."""
    shard = EngineShard(**{**BASE, "mla": True, "pp_rank": 1, "pp_size": 2, "tp_size": 2}).shard()
    assert (shard.tp_rank, shard.pp_rank, shard.pp_size) == (None, 1, 2)


@pytest.mark.parametrize(
    ("revision", "quantization", "weights"),
    [
        (None, None, ""),
        ("r1", None, "revision=r1"),
        (None, "fp8", "quantization=fp8"),
        ("r1", "fp8", "revision=r1;quantization=fp8"),
        ("", "", ""),
    ],
)
def test_the_weights_string_is_pinned(revision: object, quantization: object, weights: str) -> None:
    """``engine_weights`` goes into every key's model digest: its text is a format, pinned."""
    assert engine_weights(revision, quantization) == weights


# ------------------------------------------------------------------------------------- misuse
def test_a_vllm_block_hash_must_be_32_bytes_not_32_characters() -> None:
    with pytest.raises(
        MisuseError, match=exactly(f"a vLLM block hash is 32 bytes, got {'x' * 32!r}")
    ):
        engine_page_hash("x" * 32, HashScheme.VLLM)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: model_slug(" "), "a model name must be a non-empty string, got ' '"),
        (lambda: model_slug("a", 1), "a model's weights must be a string, got 1"),  # type: ignore[arg-type]
        (lambda: engine_kv_format(""), "a KV cache dtype must be a non-empty string, got ''"),
        (lambda: engine_page_hash("ab", HashScheme.SGLANG),
         "an sglang page key is 64 hex digits, got 'ab'"),
        (lambda: engine_page_hash(b"", "vllm"),  # type: ignore[arg-type]
         "scheme must be a HashScheme, got 'vllm'"),
    ],
)  # fmt: skip
def test_misused_helpers_say_what_is_wrong(call: Any, message: str) -> None:
    with pytest.raises(MisuseError, match=exactly(message)):
        call()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"page_size": True}, "EngineShard.page_size: expected an int >= 1, got True"),
        ({"tp_size": 0}, "EngineShard.tp_size: expected an int >= 1, got 0"),
        ({"tp_rank": True}, "EngineShard.tp_rank: expected an int >= 0, got True"),
        ({"pp_rank": 0.5}, "EngineShard.pp_rank: expected an int >= 0, got 0.5"),
        ({"scheme": "vllm"}, "EngineShard.scheme: expected a HashScheme, got 'vllm'"),
        ({"mla": 1}, "EngineShard.mla: expected a bool, got 1"),
        ({"dtype": " "}, "EngineShard.dtype: expected a non-empty string, got ' '"),
        ({"tp_rank": 2, "tp_size": 2}, "EngineShard: tp_rank 2 >= tp_size 2"),
        ({"pp_rank": 1}, "EngineShard: pp_rank 1 >= pp_size 1"),
        ({"writer_rank": 1}, "EngineShard: writer_rank 1 >= tp_size 1"),
        ({"weights": None}, "EngineShard.weights: expected a string, got None"),
        ({"kv_layout": "~"}, "EngineShard.kv_layout: '~' has no letter or digit"),
        ({"dtype": "torch.uint8"},
         "EngineShard: a torch.uint8 KV pool holds some other format's bytes; name it "
         "(kv_format, e.g. 'float8_e4m3fn'), or pages of every such format share keys"),
    ],
)  # fmt: skip
def test_a_misused_shard_says_what_is_wrong(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(MisuseError, match=exactly(message)):
        EngineShard(**{**BASE, **fields})
