#!/usr/bin/env bash
# On the GPU machine: unpack the wheel parts staged by ../shared/gpu/stage-wheels (copied, one
# device call per part, into STAGE) and install them into SITE. Idempotent: a SITE that holds
# a finished install is left as it is.
# Usage: bash tools/gpu/install.sh STAGE SITE
set -euo pipefail
stage=${1:?stage folder (the parts)}
site=${2:?site folder (the install target)}
if [ -f "$site/.lockstep-installed" ]; then exit 0; fi
n=$(ls "$stage"/part.* 2>/dev/null | wc -l)
if [ "$n" = 0 ]; then echo "install.sh: no part.* in $stage (copy every staged part first)" >&2; exit 2; fi
work=$(mktemp -d)
cat $(ls "$stage"/part.* | sort) > "$work/w.tar"
tar -xf "$work/w.tar" -C "$work"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$work"/*.whl
rm -rf "$work"
touch "$site/.lockstep-installed"
echo "install.sh: $(ls "$site" | grep -c dist-info) distributions in $site (from $n parts)"
