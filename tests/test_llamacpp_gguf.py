"""GGUF conversion of the seeded GPT-2 with the pinned sdist's converter, on the tiny test model.
Needs the unpacked sdist (`make llamacpp`): skipped where it is absent, failed instead where a run requires the build (SERVINGPLAN_REQUIRE_LLAMACPP=1)."""
import sys

import pytest

from helpers import require_llamacpp
from servingplan.llamacpp import build
from servingplan.llamacpp.gguf_model import TINY_OVERRIDES, make_gguf, synthetic_tokenizer


def need_sources():
    require_llamacpp((build.source_dir() / "convert_hf_to_gguf.py").is_file(), f"llama.cpp sources absent ({build.source_dir()}): run `make llamacpp`")


def test_the_synthetic_tokenizer_has_exactly_the_model_vocabulary():
    tok = synthetic_tokenizer(512)
    assert len(tok) == 512 and tok.eos_token_id == 511
    text = "hello,world!"
    assert tok.decode(tok.encode(text)) == text
    # every token but the end-of-text one decodes to whole characters: llama-server never holds one back
    assert all(tok.decode([i]).isascii() and tok.decode([i]).isprintable() for i in range(511))
    big = synthetic_tokenizer(50257)
    assert len(big) == 50257 and all(big.decode([i]).isascii() for i in range(0, 50256, 97))
    with pytest.raises(ValueError):
        synthetic_tokenizer(60)


def test_the_tiny_model_converts_to_a_gguf_llama_cpp_reads(tmp_path):
    need_sources()
    out = make_gguf(tmp_path / "tiny.gguf", seed=0, tiny=True, work_dir=tmp_path)
    sys.path.insert(0, str(build.source_dir() / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.pop(0)
    reader = GGUFReader(out)

    def value(key):
        field = reader.fields[key]
        return field.parts[field.data[0]].tolist()

    assert bytes(value("general.architecture")) == b"gpt2"
    assert value("gpt2.block_count") == [TINY_OVERRIDES["n_layer"]]
    assert value("gpt2.context_length") == [TINY_OVERRIDES["n_positions"]]   # the n_ctx workaround
    assert value("gpt2.embedding_length") == [TINY_OVERRIDES["n_embd"]]
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == TINY_OVERRIDES["vocab_size"]
    assert bytes(value("tokenizer.ggml.pre")) == b"gpt-2"
    assert any(t.name == "token_embd.weight" for t in reader.tensors)
