#!/usr/bin/env bash
# Apply verl-oar's upstream patch series to a copy of the installed verl, or re-export it.
#
#   upstream/apply.sh [DEST]               copy the installed verl (package + the tests its wheel ships)
#                                          into DEST (default: a new temp dir), commit it as the base
#                                          (tag verl-<version>-wheel), apply upstream/verl-<version>/*.patch
#                                          with `git am`, print DEST. Exits non-zero, naming the patch,
#                                          when one does not apply.
#   upstream/apply.sh --regenerate DEST    re-export the series from DEST's commits since the base tag
#                                          into upstream/verl-<version of DEST's base>/ (after a rebase,
#                                          an edit with `git rebase -i`, or a new commit in DEST).
#
# Environment: PYTHON (default: python) is the interpreter whose verl is copied; SERIES overrides
# the series folder (default: upstream/verl-<installed version>, falling back to the newest series
# when the installed version has none, which is how a rebase onto a newer verl starts).
# See docs/upstream.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
GIT=(git -c user.name=verl-oar -c user.email=verl-oar@users.noreply.github.com -c commit.gpgsign=false)

if [[ "${1:-}" == "--regenerate" ]]; then
    DEST="${2:?usage: upstream/apply.sh --regenerate DEST}"
    base="$(git -C "$DEST" tag --list 'verl-*-wheel' | head -n1)"
    [[ -n "$base" ]] || { echo "apply.sh: $DEST has no verl-<version>-wheel tag (not made by apply.sh)" >&2; exit 2; }
    version="${base#verl-}"; version="${version%-wheel}"
    out="${SERIES:-$HERE/verl-$version}"
    mkdir -p "$out"
    rm -f "$out"/*.patch
    git -C "$DEST" format-patch -q --zero-commit --no-signature -o "$out" "$base..HEAD"
    echo "apply.sh: wrote $(ls "$out"/*.patch | wc -l) patches to $out"
    exit 0
fi

DEST="${1:-$(mktemp -d -t verl-upstream-XXXXXX)}"
mkdir -p "$DEST"
[[ -z "$(ls -A "$DEST")" ]] || { echo "apply.sh: $DEST is not empty" >&2; exit 2; }

# Copy verl's files as its wheel's RECORD lists them (verl/... and tests/...), without importing verl
# (importing it would load plugins such as verl-oar itself).
version="$("$PYTHON" - "$DEST" <<'EOF'
import csv, importlib.metadata as md, os, shutil, sys
dest = sys.argv[1]
dist = md.distribution("verl")
copied = 0
for row in csv.reader(dist.read_text("RECORD").splitlines()):
    path = row[0]
    if not path.startswith(("verl/", "tests/")) or "__pycache__" in path:
        continue
    src = dist.locate_file(path)
    os.makedirs(os.path.join(dest, os.path.dirname(path)), exist_ok=True)
    shutil.copy2(src, os.path.join(dest, path))
    copied += 1
if copied == 0:
    sys.exit("apply.sh: the installed verl's RECORD lists no verl/ files")
print(dist.version)
EOF
)"

series="${SERIES:-$HERE/verl-$version}"
if [[ ! -d "$series" ]]; then
    series="$(ls -d "$HERE"/verl-*/ 2>/dev/null | sort -V | tail -n1)"
    series="${series%/}"
    [[ -n "$series" ]] || { echo "apply.sh: no series under $HERE" >&2; exit 2; }
    echo "apply.sh: no series for verl $version; trying $(basename "$series") (rebase)" >&2
fi

cd "$DEST"
"${GIT[@]}" init -q
"${GIT[@]}" add -A
"${GIT[@]}" commit -q -m "verl $version wheel"
"${GIT[@]}" tag "verl-$version-wheel"
for patch in "$series"/*.patch; do
    if ! "${GIT[@]}" am -q --keep-non-patch --keep-cr "$patch" >/dev/null 2>"$DEST/.git/am-error"; then
        echo "apply.sh: $(basename "$patch") does not apply to verl $version:" >&2
        cat "$DEST/.git/am-error" >&2
        echo "apply.sh: resolve in $DEST (git am --show-current-patch; fix; git add; git am --continue)," >&2
        echo "apply.sh: then: upstream/apply.sh --regenerate $DEST" >&2
        exit 1
    fi
done
echo "$DEST"
