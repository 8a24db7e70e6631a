"""The bundled SmolLM2 tokenizer, converted from its GGUF file, is the same on every supported transformers:
byte-level BPE with the file's special tokens (transformers 5.17's own conversion decodes a newline as 'Ċ' and
ends replies at <|im_start|>)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from polyrl.models.loading import BYTE_LEVEL_BPE, smollm2_tokenizer_dir


@pytest.fixture(scope="module")
def smollm2_tok():
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


def test_the_pipeline_is_byte_level_bpe(smollm2_tok):
    spec = json.loads(smollm2_tok.backend_tokenizer.to_str())
    assert {key: spec[key] for key in BYTE_LEVEL_BPE} == BYTE_LEVEL_BPE
    assert spec["model"]["type"] == "BPE" and not spec["model"]["byte_fallback"] and spec["model"]["unk_token"] is None


def test_special_tokens_are_the_files(smollm2_tok):
    # The GGUF's metadata: bos 1, eos 2, padding 2, unknown 0.
    assert (smollm2_tok.bos_token, smollm2_tok.bos_token_id) == ("<|im_start|>", 1)
    assert (smollm2_tok.eos_token, smollm2_tok.eos_token_id) == ("<|im_end|>", 2)
    assert (smollm2_tok.pad_token, smollm2_tok.pad_token_id) == ("<|im_end|>", 2)
    assert smollm2_tok.unk_token_id == 0


@pytest.mark.parametrize("text", ["What is 3 + 4?\nAnswer: 7", "  two  spaces, a tab\tand ünïcödé €", "-12"])
def test_text_round_trips(smollm2_tok, text):
    ids = smollm2_tok.encode(text, add_special_tokens=False)
    assert smollm2_tok.decode(ids) == text


def test_the_chat_template_ends_a_turn_with_the_end_token(smollm2_tok):
    rendered = smollm2_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n") and "hi<|im_end|>\n" in rendered
