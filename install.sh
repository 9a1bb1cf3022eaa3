#!/usr/bin/env bash
# install.sh: install, upgrade or remove cudawrap.
#
#   sudo ./install.sh                      system install (root /)
#   ./install.sh --prefix DIR              everything under DIR, no root needed
#   sudo ./install.sh --uninstall [--unwrap-all | --keep-wraps] [--purge]
#
# This half makes a private virtual environment and pip-installs the package into it;
# `python -m cudawrap.cli.installer` (cudawrap/cli/installer.py) does the rest from there,
# recording what it creates in a manifest so --uninstall removes exactly that.
# Locations mirror cudawrap/locations.py (tests/test_install.py checks they agree).
set -euo pipefail
umask 022

PROG=install.sh
MIN_PYTHON=3.9
EX_USAGE=64 EX_NOINPUT=66 EX_UNAVAILABLE=69 EX_SOFTWARE=70 EX_CANTCREAT=73 EX_NOPERM=77

# Nothing from the caller's environment may steer Python or pip into another place.
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP PYTHONUSERBASE PYTHONSAFEPATH CUDAWRAP_ROOT \
      PIP_USER PIP_TARGET PIP_PREFIX PIP_ROOT PIP_EDITABLE PIP_REQUIRE_VIRTUALENV
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

step() { printf '==> %s\n' "$*"; }
warn() { printf '%s: warning: %s\n' "$PROG" "$*" >&2; }
die() {
    local code=$1
    shift
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit "$code"
}

usage() {
    cat <<'EOF'
Usage: ./install.sh [--prefix DIR] [--service | --no-service] [--python PATH] [--wheelhouse DIR] [--with-plot]
       ./install.sh --uninstall [--unwrap-all | --keep-wraps] [--purge] [--prefix DIR]

Install cudawrap from this source directory, or upgrade an existing install in place
(wrapped programs keep working, the shim is refreshed, the config file is kept).

  --prefix DIR      install everything under DIR instead of / (no root needed);
                    the commands are then DIR/usr/local/bin/cudawrap and create-cudawrap
  --service         run the cudawrap service, the install's only arbiter (the default
                    of a root install; a --prefix install runs daemonless without it)
  --no-service      run daemonless: each run decides for itself (an upgrade keeps the
                    way an install runs; `cudawrap way` switches it)
  --python PATH     the Python (3.9 or newer) for cudawrap's private virtual
                    environment (default: python3 on PATH if every user can run
                    it, else /usr/bin/python3; the first step line says which)
  --wheelhouse DIR  install offline from the wheels in DIR (pip --no-index --find-links);
                    DIR needs cudawrap's dependencies and setuptools
  --with-plot       also install matplotlib, for `cudawrap usage --plot FILE.png`
  --uninstall       remove what install.sh installed; refused while programs are wrapped;
                    the state (registry, ledger, usage history in var/lib/cudawrap)
                    is kept for a later install, as dpkg's remove keeps it
  --purge           with --uninstall: remove the state and an edited config too
                    (also after an --uninstall that kept them)
  --unwrap-all      with --uninstall: run `cudawrap unwrap --all` first
  --keep-wraps      with --uninstall, to move to the Debian package: keep the wrapped
                    programs, the registry, the config and the leases for it (they
                    cannot start until `apt-get install ./cudawrap_VERSION_ARCH.deb`)
  -h, --help        show this help

Exit codes: 0 done (also when no NVIDIA driver was found: that is a warning),
64 bad option, 65 programs still wrapped, 66 nothing to uninstall or no such file,
69 no suitable Python (or no venv module), 70 the installed package is incomplete
(or too old for --keep-wraps), 73 cannot write there, 74 a file could not be written
or removed, 75 a `cudawrap monitor --daemon` did not stop, 77 not root,
1 pip or venv creation failed; other codes are those of `cudawrap sync` or `cudawrap unwrap`.
EOF
}

need_value() { # OPTION COUNT VALUE
    if [ "$2" -lt 2 ] || [ -z "$3" ]; then
        die $EX_USAGE "$1 needs a value (see ./install.sh --help)"
    fi
}

prefix="" python="" wheelhouse="" action=install unwrap_all=0 keep_wraps=0 purge=0 prefix_given=0 extras="" way=""
while [ $# -gt 0 ]; do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --prefix) need_value "$1" $# "${2-}"; prefix=$2; prefix_given=1; shift 2 ;;
        --prefix=*) prefix=${1#*=}; prefix_given=1; need_value --prefix 2 "$prefix"; shift ;;
        --python) need_value "$1" $# "${2-}"; python=$2; shift 2 ;;
        --python=*) python=${1#*=}; need_value --python 2 "$python"; shift ;;
        --wheelhouse) need_value "$1" $# "${2-}"; wheelhouse=$2; shift 2 ;;
        --wheelhouse=*) wheelhouse=${1#*=}; need_value --wheelhouse 2 "$wheelhouse"; shift ;;
        --with-plot) extras="[plot]"; shift ;;
        --service) [ "$way" != daemonless ] || die $EX_USAGE "--service and --no-service exclude each other"; way=service; shift ;;
        --no-service) [ "$way" != service ] || die $EX_USAGE "--service and --no-service exclude each other"; way=daemonless; shift ;;
        --uninstall) action=uninstall; shift ;;
        --unwrap-all) unwrap_all=1; shift ;;
        --keep-wraps) keep_wraps=1; shift ;;
        --purge) purge=1; shift ;;
        -*) die $EX_USAGE "unknown option '$1' (see ./install.sh --help)" ;;
        *) die $EX_USAGE "unexpected argument '$1' (see ./install.sh --help)" ;;
    esac
done
for flag in unwrap_all keep_wraps purge; do
    if [ "${!flag}" = 1 ] && [ "$action" != uninstall ]; then
        die $EX_USAGE "--${flag/_/-} goes with --uninstall (see ./install.sh --help)"
    fi
done
if [ "$unwrap_all" = 1 ] && [ "$keep_wraps" = 1 ]; then
    die $EX_USAGE "--unwrap-all and --keep-wraps exclude each other: unwrap the programs, or keep them for the Debian package"
fi
if [ "$purge" = 1 ] && [ "$keep_wraps" = 1 ]; then
    die $EX_USAGE "--purge and --keep-wraps exclude each other: --keep-wraps keeps the state for the Debian package"
fi
if [ "$action" = uninstall ] && { [ -n "$python" ] || [ -n "$wheelhouse" ] || [ -n "$way" ]; }; then
    die $EX_USAGE "--python, --wheelhouse, --service and --no-service are for installing, not with --uninstall"
fi

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)

# ---- where -------------------------------------------------------------------------------
if [ "$prefix_given" = 1 ]; then
    case $prefix in *$'\n'*) die $EX_USAGE "--prefix: a directory name with a newline is not supported" ;; esac
    case $prefix in /*) ;; *) prefix="$PWD/$prefix" ;; esac
    root=$(realpath -ms -- "$prefix")
else
    root=/
    if [ "$(id -u)" -ne 0 ]; then
        die $EX_NOPERM "a system install needs root: run 'sudo ./install.sh', or install into a directory of yours with './install.sh --prefix DIR'"
    fi
fi
base=${root%/}
venv=$base/opt/cudawrap/venv
bindir=$base/usr/local/bin
vpy=$venv/bin/python

# ---- uninstall ---------------------------------------------------------------------------
if [ "$action" = uninstall ]; then
    if [ ! -x "$vpy" ] && [ "$purge" = 1 ] && [ -d "$base/var/lib/cudawrap" ]; then
        # What an earlier --uninstall kept (as dpkg --purge does after a remove).
        step "purging what the uninstall of cudawrap kept in $root"
        rm -rf -- "$base/var/lib/cudawrap"
        step "removed $base/var/lib/cudawrap/"
        if [ -f "$base/etc/cudawrap/config.toml" ]; then
            rm -f -- "$base/etc/cudawrap/config.toml"
            step "removed $base/etc/cudawrap/config.toml"
        fi
        for dir in "$base/var/lib" "$base/var" "$base/etc/cudawrap" "$base/etc"; do
            [ "$root" = / ] && [ "$dir" != /etc/cudawrap ] && continue  # the system's own directories
            rmdir -- "$dir" 2>/dev/null || true
        done
        [ "$root" = / ] || rmdir -- "$root" 2>/dev/null || true
        exit 0
    fi
    if [ ! -x "$vpy" ]; then
        die $EX_NOINPUT "cudawrap is not installed in $root (no $vpy)"
    fi
    step "uninstalling cudawrap from $root"
    args=(uninstall --root "$root")
    # The installed package's own code does the uninstall; one from before the package was
    # grouped into layers has it at cudawrap.installation.
    installer=cudawrap.cli.installer
    "$vpy" -I -c "import $installer" 2>/dev/null || installer=cudawrap.installation
    [ "$unwrap_all" = 1 ] && args+=(--unwrap-all)
    if [ "$keep_wraps" = 1 ]; then
        # The installed package's own code does the uninstall: one from before --keep-wraps
        # would refuse the switch only after its usage text.
        case $("$vpy" -I -m "$installer" uninstall --help 2>/dev/null || true) in
            *--keep-wraps*) ;;
            *) die $EX_SOFTWARE "the cudawrap installed in $root predates --keep-wraps: upgrade it first ('sudo ./install.sh' from this source), then run this again" ;;
        esac
        args+=(--keep-wraps)
    fi
    if [ "$purge" = 1 ]; then
        # An installed package from before --purge removes the state whatever it is told.
        case $("$vpy" -I -m "$installer" uninstall --help 2>/dev/null || true) in
            *--purge*) args+=(--purge) ;;
        esac
    fi
    cd /  # the venv is about to go away; do not sit in it
    "$vpy" -I -m "$installer" "${args[@]}"
    exit 0
fi

# ---- checks: nothing is changed before all of them pass ----------------------------------
[ -f "$SRC/pyproject.toml" ] || die $EX_NOINPUT "$SRC has no pyproject.toml: run install.sh from a cudawrap source directory"
if [ -n "$wheelhouse" ]; then
    case $wheelhouse in /*) ;; *) wheelhouse="$PWD/$wheelhouse" ;; esac
    [ -d "$wheelhouse" ] || die $EX_NOINPUT "--wheelhouse $wheelhouse: no such directory"
fi

# The nearest existing ancestor of each directory we need must be a directory we may write.
for target in "$venv" "$bindir" "$base/etc" "$base/var/lib" "$base/run"; do
    anc=$target
    while [ ! -e "$anc" ] && [ ! -L "$anc" ]; do anc=$(dirname -- "$anc"); done
    if [ ! -d "$anc" ]; then
        die $EX_CANTCREAT "cannot install into $root: $anc is not a directory"
    fi
    if [ ! -w "$anc" ] || [ ! -x "$anc" ]; then
        if [ "$root" = / ]; then
            die $EX_CANTCREAT "cannot write to $anc (read-only file system?)"
        fi
        die $EX_CANTCREAT "cannot install into $root: $anc is not writable by $(id -un); choose a directory of yours with --prefix"
    fi
done
for name in cudawrap create-cudawrap; do
    link=$bindir/$name
    if [ -e "$link" ] || [ -L "$link" ]; then
        if [ ! -L "$link" ] || [ "$(readlink -- "$link")" != "$venv/bin/$name" ]; then
            die $EX_CANTCREAT "$link exists and is not cudawrap's link to $venv/bin/$name: move it aside, then run install.sh again"
        fi
    fi
done

# The interpreter: every user's wrapped programs start with it, so it must be one they can
# run. --python is taken as given; otherwise python3 on PATH if it qualifies, else the
# system's /usr/bin/python3 (root's PATH often has a private build first: pyenv, conda).
SYSTEM_PYTHON=/usr/bin/python3

probe() { # PY: a Python $MIN_PYTHON+ with venv? Sets ver, pyreal and blocked; else why.
    local py=$1 major minor
    why="" blocked="" pyreal=""
    # The version test is written so that even Python 2 can run it and answer.
    ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || ver=""
    if ! [[ $ver =~ ^[0-9]+\.[0-9]+$ ]]; then
        why="$py does not run as a Python interpreter"
        return 1
    fi
    major=${ver%%.*} minor=${ver#*.}
    if [ "$major" -lt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -lt 9 ]; }; then
        why="$py is Python $ver; cudawrap needs $MIN_PYTHON or newer"
        return 1
    fi
    # The real interpreter, not a pyenv shim or an alias that may point elsewhere tomorrow.
    if ! pyreal=$("$py" -c 'import os, sys; print(os.path.realpath(sys.executable or sys.argv[0]))' 2>/dev/null) ||
        [ -z "$pyreal" ]; then
        why="$py does not run as a Python interpreter"
        return 1
    fi
    if ! "$pyreal" -I -c 'import venv, ensurepip' 2>/dev/null; then
        if [ -r /etc/debian_version ]; then
            why="$pyreal (Python $ver) has no venv/ensurepip module: install python3-venv (apt-get install python3-venv, or python$ver-venv)"
        else
            why="$pyreal (Python $ver) has no venv/ensurepip module: install your distribution's venv support for Python $ver"
        fi
        return 1
    fi
    # The first directory on the way to it (or the file) that other users may not enter.
    blocked=$("$pyreal" -I -c '
import os, stat, sys
path = sys.argv[1]
while True:
    if not os.stat(path).st_mode & stat.S_IXOTH:
        print(path)
        break
    if path == "/":
        break
    path = os.path.dirname(path)
' "$pyreal")
}

closed() { # why other users cannot run $pyreal, from probe's $blocked
    printf '%s cannot be run by other users (%s is not open to them)' "$pyreal" "$blocked"
}

joined() { # ITEM...: the items separated by "; "
    [ $# -gt 0 ] || return 0
    local out=$1
    shift
    for item in "$@"; do out+="; $item"; done
    printf '%s' "$out"
}

if [ -n "$python" ]; then
    py=$python
    if [ "${py#*/}" = "$py" ]; then
        py=$(command -v -- "$python" || true)
        [ -n "$py" ] || die $EX_UNAVAILABLE "--python $python: not found on PATH"
    fi
    [ -e "$py" ] || die $EX_UNAVAILABLE "--python $python: no such file"
    probe "$py" || die $EX_UNAVAILABLE "$why; name another Python with --python PATH"
    if [ -n "$blocked" ]; then
        if [ "$root" = / ]; then
            die $EX_UNAVAILABLE "$(closed), but every user runs wrapped programs with it: name a system Python with --python, e.g. --python $SYSTEM_PYTHON"
        fi
        warn "$(closed): only you can run the programs wrapped in $root"
    fi
    chosen="$pyreal (Python $ver, from --python)"
else
    # Candidates in order; the first every user can run wins. Failing that, a prefix
    # install (often one person's) takes the first that works at all, and says so.
    reasons=() fallback="" chosen=""
    path_py=$(command -v python3 || true)
    [ -n "$path_py" ] || reasons+=("no python3 on PATH")
    # sudo's stock PATH finds the system's python3 itself: one candidate then, not none (the
    # same path twice was skipped twice as "tried already").
    candidates=()
    [ -z "$path_py" ] || candidates+=("$path_py")
    if [ -n "$path_py" ] && [ "$path_py" -ef "$SYSTEM_PYTHON" ]; then
        :  # the same file as python3 on PATH: tried once, above
    elif [ -e "$SYSTEM_PYTHON" ]; then
        candidates+=("$SYSTEM_PYTHON")
    else
        reasons+=("no $SYSTEM_PYTHON")
    fi
    for py in ${candidates[@]+"${candidates[@]}"}; do
        if ! probe "$py"; then
            reasons+=("$why")
            continue
        fi
        if [ -n "$blocked" ]; then
            reasons+=("$(closed)")
            [ -n "$fallback" ] || fallback=$py
            continue
        fi
        chosen="$pyreal (Python $ver"
        if [ "$py" = "$path_py" ]; then chosen+=", python3 on PATH)"; else chosen+=", the system's $SYSTEM_PYTHON)"; fi
        break
    done
    if [ -z "$chosen" ] && [ -n "$fallback" ] && [ "$root" != / ]; then
        probe "$fallback"
        warn "$(closed): only you can run the programs wrapped in $root; name a Python everyone can run with --python PATH to share them"
        chosen="$pyreal (Python $ver; no Python every user can run was found)"
    fi
    if [ -z "$chosen" ]; then
        die $EX_UNAVAILABLE "no Python $MIN_PYTHON or newer with venv that every user can run ($(joined "${reasons[@]}")): install one (Debian/Ubuntu: apt-get install python3 python3-venv; RHEL family: dnf install python3), or name one with --python PATH"
    fi
    if [ ${#reasons[@]} -gt 0 ]; then
        chosen+=", because $(joined "${reasons[@]}")"
    fi
fi
step "Python: $chosen"

# ---- the virtual environment -------------------------------------------------------------
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cudawrap-install.XXXXXX")
trap 'rm -rf -- "$tmp"' EXIT

created=()  # directories made here, for the manifest (and for a rollback)
fresh=0
rollback() {
    [ "$fresh" = 1 ] || return 0
    rm -rf -- "$venv"
    local i
    for ((i = ${#created[@]} - 1; i >= 0; i--)); do rmdir -- "${created[i]}" 2>/dev/null || true; done
}

if [ -x "$vpy" ] && [ "$("$vpy" -I -c 'import os, sys; print(os.path.realpath(sys.executable))' 2>/dev/null)" = "$pyreal" ]; then
    step "upgrading in place: the virtual environment $venv (Python $ver) is kept"
else
    anc=$(dirname -- "$venv")  # the venv itself is recorded as a whole tree
    while [ ! -e "$anc" ] && [ ! -L "$anc" ]; do created=("$anc" ${created[@]+"${created[@]}"}); anc=$(dirname -- "$anc"); done
    if [ -e "$venv" ]; then
        step "recreating the virtual environment $venv with $pyreal (Python $ver)"
        clear=(--clear)
    else
        step "creating the virtual environment $venv with $pyreal (Python $ver)"
        fresh=1
        clear=()
    fi
    if ! "$pyreal" -I -m venv ${clear[@]+"${clear[@]}"} -- "$venv" >"$tmp/venv.log" 2>&1; then
        tail -n 8 "$tmp/venv.log" | sed 's/^/    venv: /' >&2
        rollback
        die 1 "$pyreal -m venv $venv failed (its last lines are above)"
    fi
    # Never mind the pip the venv came with: it only has to read wheels and a pyproject.toml.
fi

# pip builds in a copy, so the source directory may be read-only and is never changed.
mkdir "$tmp/src"
set +e
tar -C "$SRC" -cf - --warning=no-file-changed --exclude=./.git --exclude=./.venv --exclude=./build \
    --exclude=./dist --exclude='*.egg-info' --exclude=__pycache__ --exclude=./.pytest_cache \
    --exclude=./.whl --exclude=./tests --exclude=./bench/results . | tar -C "$tmp/src" -xf -
copied=("${PIPESTATUS[@]}")
set -e
if [ "${copied[0]}" -gt 1 ] || [ "${copied[1]}" -ne 0 ]; then  # GNU tar: 1 = a file changed meanwhile
    rollback
    die 1 "cannot copy the source $SRC to $tmp/src for pip (see tar's message above)"
fi

# Built once, as a wheel: pip installs from it, and it is kept for users to pip-install into
# their own environments (`import cudawrap; cudawrap.acquire()` from their venv or conda
# env). Installing the source directory instead would build it a second time.
index_args=()
if [ -n "$wheelhouse" ]; then
    index_args=(--no-index --find-links "$wheelhouse")
    step "installing cudawrap from $SRC with pip, offline from $wheelhouse"
else
    step "installing cudawrap from $SRC with pip"
fi
pip_failed() { # LOG: its last lines, the rollback, and one line saying what to check
    { grep -v '^WARNING: Location .* is ignored' "$1" || true; } | tail -n 12 | sed 's/^/    pip: /' >&2
    rollback
    if [ -n "$wheelhouse" ]; then
        die 1 "pip could not install cudawrap into $venv (its last lines are above): does $wheelhouse hold every dependency and setuptools?"
    fi
    die 1 "pip could not install cudawrap into $venv (its last lines are above): check access to the package index, or install offline with --wheelhouse DIR"
}
(cd "$tmp" && "$vpy" -I -m pip wheel -q --no-deps ${index_args[@]+"${index_args[@]}"} -w "$tmp/wheel" "$tmp/src") \
    >"$tmp/pip.log" 2>&1 || pip_failed "$tmp/pip.log"
wheel=$(ls "$tmp"/wheel/cudawrap-*.whl 2>/dev/null | head -n 1)
[ -n "$wheel" ] || { echo "pip wheel left no cudawrap-*.whl in $tmp/wheel" >>"$tmp/pip.log"; pip_failed "$tmp/pip.log"; }
# The dependencies (and a cudawrap of another version), then this very build: an upgrade
# in place keeps the version number, which alone would count as installed already.
(cd "$tmp" && "$vpy" -I -m pip install --upgrade --no-warn-script-location ${index_args[@]+"${index_args[@]}"} \
    "$wheel$extras" && "$vpy" -I -m pip install --force-reinstall --no-deps --no-warn-script-location "$wheel") \
    >>"$tmp/pip.log" 2>&1 || pip_failed "$tmp/pip.log"
if ! (cd "$tmp" && "$vpy" -I -c 'import cudawrap.cli.installer, cudawrap.launch, cudawrap.install.shimfile as s; s.shim_template()') 2>"$tmp/check.log"; then
    rollback
    die $EX_SOFTWARE "the package pip installed is incomplete ($(tail -n 1 "$tmp/check.log")): the source's packaging is broken"
fi
wheel_args=(--wheel "$wheel")

# Which build this is, for `cudawrap --version` and doctor: the checkout's commit (git is
# asked once, here), and the day of the install.
build="installed $(date -u +%Y-%m-%d)"
if [ -e "$SRC/.git" ] && command -v git >/dev/null 2>&1 &&
    commit=$(git -c safe.directory="$SRC" -C "$SRC" rev-parse --short=12 HEAD 2>/dev/null); then
    if [ -n "$(git -c safe.directory="$SRC" -C "$SRC" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
        commit+=" with uncommitted changes"
    fi
    build="commit $commit, $build"
fi

# ---- the rest, from the installed package -------------------------------------------------
created_args=()
for dir in ${created[@]+"${created[@]}"}; do created_args+=(--created "$dir"); done
way_args=()
[ -z "$way" ] || way_args=(--way "$way")
(cd "$tmp" && "$vpy" -I -m cudawrap.cli.installer install --root "$root" --python "$vpy" --source "$SRC" --build "$build" \
    ${created_args[@]+"${created_args[@]}"} ${wheel_args[@]+"${wheel_args[@]}"} ${way_args[@]+"${way_args[@]}"}) || exit $?

step "cudawrap sync: a lease file for every GPU and MIG instance"
set +e
CUDAWRAP_ROOT=$root "$venv/bin/cudawrap" sync
rc=$?
set -e
case $rc in
    0) ;;
    69) warn "no NVIDIA driver or NVML library here: wrapped programs run as the no_driver setting says; run 'cudawrap sync' once the driver is loaded" ;;
    *) die $rc "installed, but 'cudawrap sync' failed (exit $rc, see above): fix that, then run 'cudawrap sync'" ;;
esac

# Said here once, not by every admin command: many containers run no syslog.
audit=$("$vpy" -I -c 'from cudawrap.base.audit import channel_problem; print(channel_problem() or "")') || audit=""
[ -z "$audit" ] || warn "$audit; grants and ends of leases are still recorded in the ledger ('cudawrap usage'), and 'cudawrap doctor' reports it"

# The service where the install runs it and no unit does (systemd does not run here, or a
# --prefix install): started now, after sync made the lease files; at boot the admin starts it.
if [ "$(cat "$base/var/lib/cudawrap/way" 2>/dev/null)" = service ] &&
    ! { [ "$root" = / ] && [ -d /run/systemd/system ]; } &&
    ! "$vpy" -I -c 'import sys; from cudawrap.base.daemon import running; sys.exit(running(sys.argv[1]) is None)' \
        "$base/run/cudawrap/service.lock"; then
    step "starting the cudawrap service: 'cudawrap serve --daemon' (start it so after every boot, after 'cudawrap sync')"
    CUDAWRAP_ROOT=$root "$venv/bin/cudawrap" serve --daemon ||
        warn "the service did not start: runs of other users wait for it; see $base/run/cudawrap/service.log"
fi

# Enabled by the step above only when [sharing] mode = "mps"; its daemons need the lease files.
if [ "$root" = / ] && [ -d /run/systemd/system ] && systemctl --quiet is-enabled cudawrap-mps.service 2>/dev/null; then
    step "starting cudawrap-mps.service: an MPS control daemon for each shared device"
    systemctl start cudawrap-mps.service || warn "cudawrap-mps.service did not start: see 'systemctl status cudawrap-mps'"
fi

if [ "$root" = / ]; then
    step "done: wrap a program with 'sudo create-cudawrap /path/to/program'; 'cudawrap doctor' checks the install"
else
    case ":$PATH:" in *":$bindir:"*) on_path="" ;; *) on_path=" ($bindir is not on your PATH)" ;; esac
    step "done: wrap a program with '$bindir/create-cudawrap /path/to/program'$on_path"
fi
