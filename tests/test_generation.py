"""common/generation.py: which replies the token cap cut, from the decoder's own end tokens."""
from __future__ import annotations

import pytest
import torch

from common.data import token_ids
from common.fast.static_decoder import decode
from common.generation import decoder_for, replies_and_cuts
from common.model import eos_ids

PROMPTS = [[{"role": "user", "content": text}] for text in
           ("Tabs or spaces?", "Is vim better than emacs? Say why.", "Cats or dogs, and why?")]


@pytest.fixture(scope="module")
def fp32_tiny(tiny_model):
    """fp32, where the two decoders' tokens agree (bf16 can flip near-ties)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("static", [True, False], ids=["static", "hf_generate"])
def test_a_reply_that_writes_an_end_token_is_not_cut_and_one_the_cap_stops_is(fp32_tiny, static, monkeypatch):
    model, tok = fp32_tiny
    assert decoder_for(model, static) == ("static" if static else "hf_generate")
    ids = [token_ids(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)) for p in PROMPTS]
    plain = decode(model, ids, 8, eos_ids(model, tok), tok.pad_token_id, temperature=0.0)
    assert all(len(row) == 8 for row in plain)  # the tiny model writes no end token in 8: every reply is cut
    assert replies_and_cuts(model, tok, PROMPTS, 8, 2, static=static)[1] == [True] * 3
    # The second token of the first reply made an end token: that reply (and any other that writes it) ends there.
    end = plain[0][1]
    monkeypatch.setattr(model.generation_config, "eos_token_id", [*eos_ids(model, tok), end])
    replies, cut = replies_and_cuts(model, tok, PROMPTS, 8, 2, static=static)
    assert cut == [end not in row for row in plain] and cut[0] is False
    assert replies[0] == tok.decode(plain[0][:2], skip_special_tokens=True).strip()  # a word here, not special
