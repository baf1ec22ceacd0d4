#!/usr/bin/env bash
# Cut a model assembled from parts (python -m common.local_models KIND ...) into pieces that a GPU machine
# without network can take one per call (each call there carries at most 64 MiB, the project's tree included).
#   usage, from the project's root: bash scripts/pack_model.sh KIND [OUT] [PIECE_BYTES]
#   (OUT default model_payload/KIND, git-ignored; PIECE_BYTES default 42000000)
# Then send OUT/m0, OUT/m1, ... in order, one a call, running `bash OUT/mK/unpack.sh` there after each (the
# machine forgets /tmp when it is given back: send them back to back). The last one checks the sha256 of the
# whole and leaves it where `python -m common.local_models KIND --out DIR --parts $PARTS` (PARTS default
# /tmp/parts) builds the model offline.
set -euo pipefail
KIND=$1; OUT=${2:-model_payload/$KIND}; BYTES=${3:-42000000}
PY=${PY:-.venv/bin/python}
joined=$("$PY" -c "from pathlib import Path; from common.model_parts import assemble; print(assemble('$KIND', Path('.cache/parts')))")
name=$(basename "$joined"); sum=$(sha256sum "$joined" | cut -d' ' -f1)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
split -b "$BYTES" -d -a 2 "$joined" "$W/piece."
rm -rf "$OUT"; mkdir -p "$OUT"
n=$(ls "$W"/piece.* | wc -l); k=0
for f in $(ls "$W"/piece.* | sort); do
  mkdir -p "$OUT/m$k"; mv "$f" "$OUT/m$k/piece"; echo "$k $n $sum $KIND $name" > "$OUT/m$k/INDEX"
  cat > "$OUT/m$k/unpack.sh" <<'UNPACK'
#!/usr/bin/env bash
# Add this piece to the model file being rebuilt; the last piece checks the whole (sha256).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd); read -r k n sum kind name < "$D/INDEX"
dir=${PARTS:-/tmp/parts}/$kind; mkdir -p "$dir"; tmp="$dir/$name.partial"
[[ $k == 0 ]] && rm -f "$tmp" "$dir/$name.pieces"
have=$(cat "$dir/$name.pieces" 2>/dev/null || echo 0)
[[ $have == "$k" ]] || { echo "unpack: piece $k arrived, but $have pieces are here (the machine was given back? start again at m0)"; exit 3; }
cat "$D/piece" >> "$tmp" && echo $((k + 1)) > "$dir/$name.pieces" && echo "unpack: $kind piece $((k + 1)) of $n"
if (( k + 1 == n )); then
  [[ $(sha256sum "$tmp" | cut -d' ' -f1) == "$sum" ]] || { echo "unpack: $name sha256 differs"; rm -f "$tmp"; exit 3; }
  mv "$tmp" "$dir/$name" && rm -f "$dir/$name.pieces" && echo "unpack: $dir/$name whole (sha256 checked)"
fi
UNPACK
  k=$((k + 1))
done
du -sh "$OUT"/m* | tail -2; echo "$KIND: $n pieces in $OUT, sha256 $sum"
