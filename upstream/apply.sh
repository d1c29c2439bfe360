#!/usr/bin/env bash
# Apply verl-oar's upstream pull requests to a copy of verl, or re-export them.
#
# A series folder (upstream/verl-<version>/) holds one folder per pull request, NN-<name>/, with the PR's
# `git format-patch` patches, its description PR.md and, when it builds on another PR, a file BASE naming
# that PR. NN is the order in which the whole set applies.
#
#   upstream/apply.sh [DEST] [--prs NAME,...] [--verl-src DIR]
#       Copy verl into DEST (default: a new temp dir; it must be empty): the installed verl's package and
#       the tests its wheel ships, or with --verl-src a verl source tree (a directory with verl/ and
#       tests/, e.g. a checkout of verl's repository). Commit it as the base (tag verl-<version>-wheel, or
#       verl-<version>-src), then:
#       - for each selected PR, a branch pr/<name> = its base (the base tag, or pr/<BASE>) + its patches;
#       - the checked-out branch (HEAD) = the base + every selected PR's patches, in NN order.
#       --prs selects PRs by name (with or without the NN- prefix); a PR's BASE is pulled in (said on
#       stderr). Default: all. Prints DEST. Exits non-zero naming the PR and patch that does not apply.
#   upstream/apply.sh --regenerate DEST [--prs NAME,...]
#       Re-export each PR (default: each with a pr/<name> branch in DEST) from its branch: the commits
#       since its base, into the series folder DEST was made from. Edit a PR on its branch (commit,
#       `git rebase -i`, resolve a conflict), then regenerate.
#   upstream/apply.sh --list [--verl-src DIR]
#       The series folder's PRs in order, with their bases and patch counts.
#
# Environment: PYTHON (default: python) is the interpreter whose verl is copied; SERIES overrides the
# series folder (default: upstream/verl-<version of the copied verl>, falling back to the newest
# upstream/verl-<number>* folder when there is none, which is how a rebase onto a newer verl starts).
# See docs/upstream.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
GIT=(git -c user.name=verl-oar -c user.email=verl-oar@users.noreply.github.com -c commit.gpgsign=false
     -c init.defaultBranch=main -c advice.detachedHead=false)

die() { echo "apply.sh: $*" >&2; exit 2; }

mode=apply DEST="" PRS="" VERL_SRC=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --regenerate) mode=regenerate ;;
        --list) mode=list ;;
        --prs) PRS="${2:?--prs needs a comma-separated list of PR names}"; shift ;;
        --prs=*) PRS="${1#--prs=}" ;;
        --verl-src) VERL_SRC="${2:?--verl-src needs a directory}"; shift ;;
        --verl-src=*) VERL_SRC="${1#--verl-src=}" ;;
        -h|--help) sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $1 (see upstream/apply.sh --help)" ;;
        *) [[ -z "$DEST" ]] || die "one DEST only (got $DEST and $1)"; DEST="$1" ;;
    esac
    shift
done

# The version of the verl that would be copied, without importing it (importing would load plugins).
verl_version() {
    if [[ -n "$VERL_SRC" ]]; then
        [[ -d "$VERL_SRC/verl" ]] || die "--verl-src $VERL_SRC has no verl/ folder"
        tr -d '[:space:]' < "$VERL_SRC/verl/version/version"
    else
        "$PYTHON" -c 'import importlib.metadata as md; print(md.version("verl"))'
    fi
}

pick_series() {  # $1 = verl version -> prints the series folder
    local series="${SERIES:-$HERE/verl-$1}"
    if [[ ! -d "$series" ]]; then
        series="$(ls -d "$HERE"/verl-[0-9]*/ 2>/dev/null | sort -V | tail -n1)"
        series="${series%/}"
        [[ -n "$series" ]] || die "no series under $HERE"
        echo "apply.sh: no series for verl $1; trying $(basename "$series") (rebase)" >&2
    fi
    echo "$series"
}

# PR folders of a series, in NN order: "NN-name" per line.
pr_dirs() { local d; for d in "$1"/[0-9][0-9]-*/; do [[ -d "$d" ]] && basename "$d"; done | sort; }
pr_name() { echo "${1#[0-9][0-9]-}"; }
pr_base() { [[ -f "$1/BASE" ]] && tr -d '[:space:]' < "$1/BASE" || true; }
find_pr() {  # $1 series, $2 name (with or without NN-) -> folder name, or nothing
    local d; for d in $(pr_dirs "$1"); do
        [[ "$d" == "$2" || "$(pr_name "$d")" == "$2" ]] && { echo "$d"; return; }
    done
}

# Selected PR folders (NN order), bases pulled in.
select_prs() {  # $1 series
    local series="$1" all d name base queue seen=" "
    all="$(pr_dirs "$series")"
    [[ -n "$all" ]] || die "$series has no NN-<name>/ pull-request folders"
    if [[ -z "$PRS" ]]; then queue=($all); else queue=(${PRS//,/ }); fi
    while [[ ${#queue[@]} -gt 0 ]]; do
        name="${queue[0]}"; queue=("${queue[@]:1}")
        d="$(find_pr "$series" "$name")"
        [[ -n "$d" ]] || die "no PR named '$name' in $series (there are: $(for x in $all; do printf '%s ' "$(pr_name "$x")"; done))"
        [[ "$seen" == *" $d "* ]] && continue
        seen+="$d "
        base="$(pr_base "$series/$d")"
        [[ -n "$base" ]] || continue
        [[ -n "$(find_pr "$series" "$base")" ]] || die "PR $d builds on '$base', which $series does not have"
        [[ "$(find_pr "$series" "$base")" < "$d" ]] || die "PR $d builds on $base, which must come first (a lower NN)"
        if [[ "$seen" != *" $(find_pr "$series" "$base") "* && ",$PRS," != *",$base,"* && ",$PRS," != *",$(find_pr "$series" "$base"),"* && -n "$PRS" ]]; then
            echo "apply.sh: $(pr_name "$d") builds on $base: applying $base too" >&2
        fi
        queue+=("$base")
    done
    for d in $seen; do echo "$d"; done | sort
}

if [[ "$mode" == list ]]; then
    series="$(pick_series "$(verl_version)")"
    echo "series: $series"
    for d in $(pr_dirs "$series"); do
        base="$(pr_base "$series/$d")"
        printf '%-24s %d patch(es)  base: %s\n' "$d" "$(ls "$series/$d"/*.patch | wc -l)" "${base:-verl}"
    done
    exit 0
fi

if [[ "$mode" == regenerate ]]; then
    [[ -n "$DEST" ]] || die "usage: upstream/apply.sh --regenerate DEST [--prs NAME,...]"
    basetag="$(git -C "$DEST" tag --list 'verl-*-wheel' 'verl-*-src' | head -n1)"
    [[ -n "$basetag" ]] || die "$DEST has no verl-<version>-wheel/-src tag (not made by apply.sh)"
    series="${SERIES:-$(cat "$DEST/.git/verl-oar-series" 2>/dev/null || true)}"
    [[ -d "$series" ]] || die "$DEST does not record its series folder; set SERIES=upstream/verl-<version>"
    if [[ -z "$PRS" ]]; then
        PRS="$(git -C "$DEST" for-each-ref --format='%(refname:lstrip=3)' refs/heads/pr/ | paste -sd, -)"
    fi
    for name in ${PRS//,/ }; do
        d="$(find_pr "$series" "$name")"
        [[ -n "$d" ]] || die "no PR named '$name' in $series (a new PR needs its NN-<name>/ folder first)"
        name="$(pr_name "$d")"
        git -C "$DEST" rev-parse -q --verify "refs/heads/pr/$name" >/dev/null || die "$DEST has no branch pr/$name"
        base="$(pr_base "$series/$d")"
        from="$basetag"; [[ -n "$base" ]] && from="pr/$base"
        rm -f "$series/$d"/*.patch
        git -C "$DEST" format-patch -q --zero-commit --no-signature -o "$series/$d" "$from..pr/$name"
        echo "apply.sh: $d: wrote $(ls "$series/$d"/*.patch 2>/dev/null | wc -l) patch(es) ($from..pr/$name)"
    done
    exit 0
fi

version="$(verl_version)"
series="$(pick_series "$version")"
selected="$(select_prs "$series")"
DEST="${DEST:-$(mktemp -d -t verl-upstream-XXXXXX)}"
mkdir -p "$DEST"
[[ -z "$(ls -A "$DEST")" ]] || die "$DEST is not empty"

if [[ -n "$VERL_SRC" ]]; then
    kind=src
    cp -a "$VERL_SRC/verl" "$DEST/verl"
    [[ -d "$VERL_SRC/tests" ]] && cp -a "$VERL_SRC/tests" "$DEST/tests"
    [[ -d "$VERL_SRC/docs" ]] && cp -a "$VERL_SRC/docs" "$DEST/docs"
    find "$DEST" -name __pycache__ -prune -exec rm -rf {} +
else
    kind=wheel
    # verl's files as its wheel's RECORD lists them (verl/... and tests/...)
    "$PYTHON" - "$DEST" <<'EOF'
import csv, importlib.metadata as md, os, shutil, sys
dest = sys.argv[1]
dist = md.distribution("verl")
copied = 0
for row in csv.reader(dist.read_text("RECORD").splitlines()):
    path = row[0]
    if not path.startswith(("verl/", "tests/")) or "__pycache__" in path:
        continue
    os.makedirs(os.path.join(dest, os.path.dirname(path)), exist_ok=True)
    shutil.copy2(dist.locate_file(path), os.path.join(dest, path))
    copied += 1
if copied == 0:
    sys.exit("apply.sh: the installed verl's RECORD lists no verl/ files")
EOF
fi

cd "$DEST"
basetag="verl-$version-$kind"
"${GIT[@]}" init -q
"${GIT[@]}" add -A
"${GIT[@]}" commit -q -m "verl $version ($kind)"
"${GIT[@]}" tag "$basetag"
echo "$series" > .git/verl-oar-series

am() {  # $1 PR folder; applies its patches on the current branch
    local patch
    for patch in "$series/$1"/*.patch; do
        if ! "${GIT[@]}" am -q -3 --keep-non-patch --keep-cr "$patch" >/dev/null 2>"$DEST/.git/am-error"; then
            echo "apply.sh: PR $1: $(basename "$patch") does not apply to verl $version ($2):" >&2
            cat "$DEST/.git/am-error" >&2
            echo "apply.sh: resolve in $DEST on branch $(git branch --show-current) (git am --show-current-patch;" >&2
            echo "apply.sh: fix; git add; git am --continue), then: upstream/apply.sh --regenerate $DEST --prs $(pr_name "$1")" >&2
            exit 1
        fi
    done
}

# one branch per PR, on its base
for d in $selected; do
    base="$(pr_base "$series/$d")"
    start="$basetag"; [[ -n "$base" ]] && start="pr/$base"
    "${GIT[@]}" checkout -q -b "pr/$(pr_name "$d")" "$start"
    am "$d" "on ${base:-the base}"
done
# the checked-out branch: every selected PR in order
"${GIT[@]}" checkout -q -B main "$basetag"
for d in $selected; do am "$d" "after the PRs before it"; done
echo "$DEST"
