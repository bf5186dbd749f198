#!/usr/bin/env bash
# Unpack the files of axolotl's wheel that benchmarks/axolotl_peer.py imports into DEST, to be
# carried to a GPU machine without network: its ScatterMoE-LoRA kernels (the whole
# scattermoe_lora folder, as shipped), the bitsandbytes expert quantisation and PEFT patch of
# its QLoRA (monkeypatch/moe_quant.py), the few modules these import (utils/logging.py,
# distributed.py, nf4.py, the package __init__ files above them) and the dist-info, for the
# version. Left out on purpose: the __init__.py of integrations/kernels/, which loads axolotl's
# plugin and config classes (pydantic, addict, ...), and that of its libs/; without them those
# folders import as namespace packages. No file is changed. About 1.2 MB.
#
# Usage:  scripts/fetch_axolotl.sh [WHEEL] [DEST]
#   WHEEL  axolotl's wheel (default: pip download --no-deps axolotl==0.21.0 into a temporary folder)
#   DEST   where the files go (default .peers/axolotl, which git ignores); must not exist yet
set -euo pipefail

VERSION=0.21.0
WHEEL=${1:-}
DEST=${2:-.peers/axolotl}
FILES=(
    'axolotl/__init__.py'
    'axolotl/integrations/__init__.py'
    'axolotl/integrations/kernels/libs/scattermoe_lora/*'
    'axolotl/monkeypatch/__init__.py'
    'axolotl/monkeypatch/moe_quant.py'
    'axolotl/utils/__init__.py'
    'axolotl/utils/distributed.py'
    'axolotl/utils/logging.py'
    'axolotl/utils/nf4.py'
    "axolotl-$VERSION.dist-info/*"
)

if [ -e "$DEST" ]; then
    echo "fetch_axolotl: error: $DEST exists; remove it first to make a fresh copy" >&2
    exit 1
fi
if [ -z "$WHEEL" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    # A pure-Python wheel; it asks for Python >= 3.12, which the GPU image has (not every host does).
    python3 -m pip download --quiet --no-deps --python-version 3.12 --dest "$tmp" "axolotl==$VERSION"
    WHEEL="$tmp/axolotl-$VERSION-py3-none-any.whl"
fi
mkdir -p "$(dirname "$DEST")"
unzip -q "$WHEEL" "${FILES[@]}" -d "$DEST"
echo "unpacked $(find "$DEST" -type f | wc -l) files of $(basename "$WHEEL") into $DEST ($(du -sh "$DEST" | cut -f1))"
