"""Paper text from a PDF, for papers that come without text (`--pdf PATH...`).

Uses pypdf (BSD-3-Clause, pure Python, no model download): it reads the text layer a PDF already
has. It does no OCR, so a scanned PDF without a text layer is refused rather than read as nothing.
"""
from __future__ import annotations

from pathlib import Path

from common.data import DataError


def read_pdf_text(path: str | Path) -> str:
    """The text of every page, pages separated by a blank line. A file that is not a PDF, an
    encrypted PDF, or one without extractable text raises DataError naming the path."""
    from pypdf import PdfReader  # imported here: only runs that read PDFs need it
    from pypdf.errors import PyPdfError

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with open(path, "rb") as f:
        if b"%PDF-" not in f.read(1024):  # the header may follow a few junk bytes
            raise DataError(f"{path}: not a PDF (no %PDF- header)")
    try:  # a broken file can fail anywhere inside pypdf: report it in one line
        reader = PdfReader(path)
        encrypted = reader.is_encrypted
        pages = [] if encrypted else [(page.extract_text() or "").strip() for page in reader.pages]
    except (PyPdfError, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as err:
        raise DataError(f"{path}: unreadable PDF ({type(err).__name__}: {str(err)[:80]})") from None
    if encrypted:
        raise DataError(f"{path}: encrypted PDF; decrypt it first (e.g. qpdf --decrypt)")
    text = "\n\n".join(p for p in pages if p)
    if not text.strip():
        raise DataError(f"{path}: no extractable text in {len(pages)} page(s) (a scan? OCR it first)")
    return text
