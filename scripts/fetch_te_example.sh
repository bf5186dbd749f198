#!/usr/bin/env bash
# Copy Transformer Engine's te_mixtral example (docs/examples/te_mixtral/: its Python files and
# requirements.txt) out of a local TE git repository into DEST, for `python3 -m benchmarks.te_example`.
# Nothing is downloaded: the source is a clone you already have, so the copy can be made
# anywhere and carried to a machine without network.
#
# Usage:  scripts/fetch_te_example.sh TE_REPO [DEST] [REV]
#   TE_REPO  a TransformerEngine checkout or bare git directory
#            (e.g. from `git clone https://github.com/NVIDIA/TransformerEngine`)
#   DEST     where the files go (default .peers/te_mixtral_example, which git ignores)
#   REV      the commit, tag or branch to take them from (default HEAD)
#
# DEST/COMMIT records the commit the files came from; te_example.py puts it in its results.
set -euo pipefail

TE_REPO=${1:?usage: scripts/fetch_te_example.sh TE_REPO [DEST] [REV]}
DEST=${2:-.peers/te_mixtral_example}
REV=${3:-HEAD}
EXAMPLE=docs/examples/te_mixtral

commit=$(git -C "$TE_REPO" rev-parse --verify "$REV^{commit}")
files=$(git -C "$TE_REPO" ls-tree --name-only "$commit" "$EXAMPLE/" | grep -E '\.(py|txt)$' || true)
if [ -z "$files" ]; then
    echo "fetch_te_example: error: $TE_REPO has no $EXAMPLE at $commit" >&2
    exit 1
fi

mkdir -p "$DEST"
for path in $files; do
    git -C "$TE_REPO" show "$commit:$path" > "$DEST/$(basename "$path")"
done
echo "$commit" > "$DEST/COMMIT"
echo "copied $(echo "$files" | wc -l) files of $EXAMPLE at $commit into $DEST"
