"""common/generation.py: which replies the token cap cut, from the decoder's own end tokens; the static
decoder's reproducible attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.data import token_ids
from common.fast.decode_step import grouped_attention
from common.fast.static_decoder import decode
from common.generation import decoder_backends, decoder_for, replies_and_cuts
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


@pytest.mark.parametrize("nq, nkv", [(4, 2), (8, 8), (32, 8)])
def test_grouped_attention_equals_sdpa_with_gqa_and_a_padding_mask(nq, nkv):
    torch.manual_seed(0)
    B, L, hd = 3, 11, 16
    q, keys, values = torch.randn(B, nq, hd), torch.randn(B, nkv, L, hd), torch.randn(B, nkv, L, hd)
    bias = torch.zeros(B, 1, 1, L)
    bias[0, ..., :4] = bias[2, ..., 7:] = float("-inf")  # left padding, and slots not written yet
    want = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=bias, scale=hd ** -0.5,
                                          enable_gqa=True).reshape(B, nq * hd)
    got = grouped_attention(q, keys, values, bias, hd ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a masked slot is not read: garbage there changes nothing
    keys[0, ..., :4, :], values[2, ..., 7:, :] = 1e4, -1e4
    torch.testing.assert_close(grouped_attention(q, keys, values, bias, hd ** -0.5), got)


@pytest.mark.gpu
def test_greedy_static_decoding_repeats_itself_on_a_gpu(smol_model):
    """cuDNN's SDPA kernel, which torch picks for the decode step's attention on a GPU, gave SmolLM2 other greedy
    replies on each call (30 of 32 differed between repeats in 4-bit without an adapter, bench/decode_determinism.py);
    the reproducible step must not. (The tiny model's head size of 16 repeats itself either way.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(smol_model, dtype=torch.bfloat16).cuda().eval()
    tok = AutoTokenizer.from_pretrained(smol_model)
    ids = [token_ids(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)) for p in PROMPTS * 8]
    runs = [decode(model, ids, 128, eos_ids(model, tok), tok.pad_token_id, temperature=0.0) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_the_manifest_records_the_static_decoders_attention_and_not_generates(fp32_tiny):
    model, _ = fp32_tiny
    assert decoder_backends(model, True, "bf16") == {"decoder": "static", "decoder_weights": "bf16_copies",
                                                     "decoder_attention": "grouped_matmuls"}
    assert decoder_backends(model, True, "bf16", reproducible=False)["decoder_attention"] == "sdpa"  # GRPO's rollouts
    assert decoder_backends(model, False, "bf16") == {"decoder": "hf_generate"}
