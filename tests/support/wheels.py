"""Build a tiny pure-Python wheel on the spot, so package tests need no network."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def build_wheel(directory: Path, name: str, version: str, source: str) -> Path:
    """A valid ``name-version-py3-none-any.whl`` holding ``name/__init__.py``."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": source.encode(),
        f"{dist_info}/METADATA": (f"Metadata-Version: 2.1\nName: {name}\n"
                                  f"Version: {version}\n").encode(),
        f"{dist_info}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: nbfleet-tests\n"
                               b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
    return path
