#!/usr/bin/env bash
# Fill DIR with the wheels the real-GPU kit needs to install cudawrap offline
# (install.sh --wheelhouse DIR): cudawrap's runtime dependencies, and setuptools to build
# cudawrap itself from this checkout. Run it where there is network; give the GPU machine's
# Python version (default: that of python3 here, or $PYTHON).
set -euo pipefail

usage() { echo "usage: $0 DIR [--python-version X.Y]" >&2; exit 64; }
[ $# -ge 1 ] || usage
dir=$1; shift
pyver=""
while [ $# -gt 0 ]; do
    case $1 in
        --python-version) [ $# -ge 2 ] || usage; pyver=$2; shift 2 ;;
        *) usage ;;
    esac
done
python=${PYTHON:-python3}
[ -n "$pyver" ] || pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case $pyver in
    3.[0-9] | 3.[0-9][0-9]) ;;
    *) echo "$0: --python-version $pyver: give 3.X, e.g. 3.12" >&2; exit 64 ;;
esac
deps=('nvidia-ml-py>=12.535' 'plumbum>=1.8' 'filelock>=3.12' 'setuptools>=61')
# tomli only before 3.11, which has tomllib.
if [ "${pyver#3.}" -lt 11 ]; then deps+=('tomli>=1.1'); fi
mkdir -p -- "$dir"
# Pure-Python wheels (py3-none-any) only: they serve whatever CPU the GPU machine has.
"$python" -m pip download -q --only-binary :all: --platform any --implementation py \
    --python-version "$pyver" -d "$dir" "${deps[@]}"
echo "wheels for Python $pyver in $dir:"
ls -1 -- "$dir"
