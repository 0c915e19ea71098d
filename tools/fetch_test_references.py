#!/usr/bin/env python3
"""Fetch the reference implementations the tests compare against that pip cannot install.

fouroversix 1.0.5 (the "Four Over Six" paper's package, arXiv 2512.02010) builds CUDA
extensions when installed, which a CPU machine cannot do; its PyTorch reference of NVFP4 4/6
is plain torch. This downloads the release's source archive from PyPI (pinned by SHA-256) and
keeps the three modules that reference needs, plus its licence, under
<venv>/test-references/fouroversix-1.0.5/. tests/quantization/test_nvfp4_variants.py loads
them from there. `make install` runs this; run it again by hand if the folder is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import sys
import tarfile
import time
import urllib.request

RELEASE = "fouroversix-1.0.5"
URL = ("https://files.pythonhosted.org/packages/a3/59/c19cfaa27bb3f91d12844c7ccc5380dbe352312f4"
       "f81e0621f008cead5df/fouroversix-1.0.5.tar.gz")
SHA256 = "51ab69c8c09e63d7575213f446f56bcbc9c36011ddca4c5d7b923710e1e6cb00"
MEMBERS = ("LICENSE.md", "src/fouroversix/utils.py", "src/fouroversix/quantize/utils.py",
           "src/fouroversix/quantize/pytorch/reference.py")


def default_destination() -> str:
    return os.path.join(sys.prefix, "test-references")


def fetch(destination: str, attempts: int = 3) -> str:
    """The folder holding the release's kept files (downloaded unless already there)."""
    root = os.path.join(destination, RELEASE)
    if all(os.path.isfile(os.path.join(root, m)) for m in MEMBERS):
        return root
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(URL, timeout=120) as response:
                data = response.read()
            break
        except OSError as error:
            if attempt == attempts:
                raise SystemExit(f"error: could not download {URL}: {error}")
            time.sleep(5 * attempt)
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"error: {URL} has SHA-256 {digest}, expected {SHA256}")
    partial = root + ".partial"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for member in MEMBERS:
            source = archive.extractfile(f"{RELEASE}/{member}")
            target = os.path.join(partial, member)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as fh:
                fh.write(source.read())
    if os.path.isdir(root):
        import shutil
        shutil.rmtree(root)
    os.replace(partial, root)        # all files or none: a crash leaves only the .partial
    return root


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--destination", default=default_destination(),
                        help="Folder to keep the references in (default: "
                             "<the running Python's prefix>/test-references).")
    args = parser.parse_args(argv)
    print(f"test references in {fetch(args.destination)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
