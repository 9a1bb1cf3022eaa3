"""Wrapping and unwrapping programs: the core under ``create-cudawrap`` and ``cudawrap unwrap``.

Never prints, never exits: every refusal is a CudawrapError naming the path. The checks
before a wrap are in wrapcheck.py, the atomic replacing of a name in shimlinks.py,
unwrapping in unwrap.py, doctor's repairs of interrupted or outdated wraps in repairs.py.

The promise is that a wrapped name never stops being runnable, so no step removes or
renames the name itself; it is only ever *replaced* with ``rename``:

create ``/d/x`` (entry written first with phase "wrapping"):
  1. hard-link ``/d/x`` to ``/d/CUDAWRAP_x`` (same directory, so same file system);
  2. if dpkg ships ``/d/x``: ``dpkg-divert --no-rename --add`` (see divert.py for why not --rename);
  3. make the symlink ``/d/.cudawrap-tmp-x`` -> shim and rename it over ``/d/x``;
  4. entry phase "wrapped".
unwrap (entry phase "unwrapping" first):
  1. hard-link ``/d/CUDAWRAP_x`` to ``/d/.cudawrap-tmp-x`` and rename that over ``/d/x``;
  2. ``dpkg-divert --rename --remove`` (both names are one inode, so it just unlinks
     CUDAWRAP_x), or unlink ``/d/CUDAWRAP_x`` ourselves when there is no diversion;
  3. drop the entry.

Every intermediate state is an entry in phase "wrapping"/"unwrapping" plus a link path
that is the original program, the same inode as CUDAWRAP_x, or the shim link: each runs
the program, and :func:`repairs.finish` completes the operation from any of them. A stray
``.cudawrap-tmp-x`` is always a second name of something that still exists elsewhere.

A name that is a symlink to a program (``/usr/bin/recon -> /opt/recon-2.1/bin/recon``) is
wrapped by moving *the symlink itself* to ``CUDAWRAP_recon``: the target stays untouched
(other names may lead to it, and it may live on another file system), a relative link
still resolves because it stays in the same directory, and unwrap puts back the very
same symlink.
"""
from __future__ import annotations

import getpass
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from .. import __version__
from ..base import audit
from ..base.safepath import unsafe_reason
from ..errors import CudawrapError, StateError, UsageError
from ..paths import Layout
from ..policy import registry
from ..policy.registry import WRAPPED, WRAPPING, Entry, Registry
from .divert import Dpkg
from .inspect_wraps import canonical, facts_of, same_file, stamp_of, symlink_chain
from .shimlinks import remove_own_shim, replace_with_shim_link
from .wrapcheck import Candidate, check_wrap, trusted_names

log = logging.getLogger(__name__)

SAVED_SUFFIX = ".cudawrap-saved"


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def invoking_user() -> str:
    """Who asked: the sudo caller when run through sudo, else this process's user."""
    return os.environ.get("SUDO_USER") or getpass.getuser()


def failure_reason(exc: BaseException) -> str:
    """What went wrong, in words, for a one-line error: a CudawrapError's message, an OSError's
    strerror, else the exception's type."""
    if isinstance(exc, CudawrapError):
        return exc.message
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return type(exc).__name__


def refresh_launch_cache(layout: Layout) -> None:
    """Rebuild the shim's policy cache after the registry changed.

    Best effort: a stale cache is only slower (the shim sees its signature no longer
    matches and parses the files itself), never wrong, so no wrap fails over it.
    """
    try:
        from ..policy.effective import write_cache
    except ImportError:
        return
    try:
        write_cache(os.fspath(layout.root))
    except (OSError, CudawrapError) as exc:
        log.warning("the launch cache was not rebuilt (%s); wrapped programs start a little slower "
                    "until 'cudawrap sync'", failure_reason(exc))


def require_installed(layout: Layout) -> None:
    """Raise StateError unless LAYOUT has a shim to point links at and a state directory."""
    shim = os.fspath(layout.shim)
    if not (os.path.isfile(shim) and os.access(shim, os.X_OK)):
        raise StateError(f"the cudawrap shim {shim} is missing or not executable; "
                         "run install.sh (or 'cudawrap doctor') first")
    if not os.path.isdir(layout.state_dir):
        raise StateError(f"{layout.state_dir} does not exist; run install.sh first")


# --- create ------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    path: str
    error: CudawrapError


@dataclass(frozen=True)
class WrapOutcome:
    wrapped: Tuple[Entry, ...]
    failed: Tuple[Failure, ...]
    warnings: Tuple[str, ...] = ()


def unsafe_dir(entry: Entry) -> Optional[str]:
    """Why ENTRY's directory is no longer safe for root to act in (made before wrapping
    refused such places, or handed to a user since), or None."""
    return unsafe_reason(os.path.dirname(entry.link))


def wrap_one(layout: Layout, cand: Candidate, policy: Mapping[str, Any], dpkg: Dpkg, user: str) -> Entry:
    """Wrap CAND (see the module doc for the steps). The caller holds the registry lock.

    On failure every step is undone and StateError says nothing was changed; if undoing
    fails too, the "wrapping" entry stays for `cudawrap doctor --repair`.
    """
    try:
        facts = facts_of(cand.link)
    except OSError as exc:
        raise StateError(f"{cand.link}: cannot read it: {exc.strerror}") from None
    entry = Entry(
        link=cand.link, real=cand.real, sha256=facts.sha256, mode=facts.mode, uid=facts.uid,
        gid=facts.gid, symlink=cand.symlink, package=cand.package, diversion=cand.diversion,
        policy=policy, wrapped_by=user, wrapped_at=utc_now(), cudawrap_version=__version__,
        phase=WRAPPING,
    )
    try:
        registry.update(layout, lambda reg: reg.put(entry))
    except CudawrapError as exc:
        raise StateError(f"{cand.link}: could not wrap it: {exc.message}; nothing was changed") from None
    undo: List[Callable[[], None]] = []

    def unlink_real() -> None:
        if same_file(cand.link, cand.real):  # never remove anything but our second name
            os.unlink(cand.real)

    try:
        os.link(cand.link, cand.real, follow_symlinks=False)
        undo.append(unlink_real)
        if cand.diversion is not None:
            dpkg.add(cand.diversion)
            undo.append(lambda: dpkg.remove(cand.diversion, rename=False))  # type: ignore[arg-type]
        undo.append(lambda: remove_own_shim(layout, cand.link))
        replace_with_shim_link(layout, cand.link)
    except BaseException as exc:
        try:
            for step in reversed(undo):
                step()
            registry.update(layout, lambda reg: reg.drop(cand.link))
        except BaseException as again:
            raise StateError(
                f"{cand.link}: wrapping failed ({failure_reason(exc)}) and so did undoing it "
                f"({failure_reason(again)}); the program still runs; run 'cudawrap doctor --repair' to finish"
            ) from exc
        if not isinstance(exc, Exception):
            raise
        raise StateError(f"{cand.link}: could not wrap it: {failure_reason(exc)}; nothing was changed") from exc
    done = entry.replace(phase=WRAPPED, stat=stamp_of(os.stat(cand.real)))
    try:
        registry.update(layout, lambda reg: reg.put(done))
    except CudawrapError as exc:
        raise StateError(f"{cand.link}: wrapped, but recording that failed ({exc.message}); "
                         "run 'cudawrap doctor --repair' to record it") from None
    log.info("wrapped %s (real program %s, sha256 %s, policy %s, diverted: %s) by %s",
             done.link, done.real, done.sha256, dict(done.policy), done.diverted, user)
    audit.log("wrap", program=done.link, real=done.real, sha256=done.sha256, by=user,
              diversion=done.diversion or "none")
    return done


def _check_all(layout: Layout, paths: Sequence[str], reg: Registry, dpkg: Dpkg,
               force: bool) -> Tuple[List[Candidate], List[Failure]]:
    """The PATHS that pass check_wrap against REG, and the failures of the others."""
    good: List[Candidate] = []
    bad: List[Failure] = []
    seen = set()
    for path in paths:
        try:
            cand = check_wrap(layout, path, reg, dpkg, force)
            if cand.link in seen:
                raise UsageError(f"{cand.link}: given twice")
            seen.add(cand.link)
            good.append(cand)
        except CudawrapError as exc:
            bad.append(Failure(path, exc))
    # A symlink to another program of this same command would end up pointing at the
    # shim (see check_wrap); wrapping its target alone covers it.
    targets = {canonical(c.link): c.link for c in good}
    for cand in [c for c in good if c.symlink is not None]:
        through = [targets[p] for p in symlink_chain(cand.link)[1:] if p in targets]
        if through:
            good.remove(cand)
            bad.append(Failure(cand.link, StateError(
                f"{cand.link}: it is a symlink to {through[0]}, which this command wraps; "
                f"wrapping {through[0]} covers it, so leave {cand.link} out")))
    return good, bad


def wrap_programs(
    layout: Layout,
    paths: Sequence[str],
    policy: Mapping[str, Any],
    *,
    dpkg: Optional[Dpkg] = None,
    user: Optional[str] = None,
    force: bool = False,
) -> WrapOutcome:
    """Wrap each of PATHS with POLICY (raw, already validated).

    Every path is checked before any is touched: if one fails the checks, nothing at all
    is changed and the outcome lists the failures. Then each is wrapped under the lock,
    checked again there (another admin may have been quicker); one that fails then is
    reported and the others still go ahead.
    """
    dpkg = Dpkg.from_environment() if dpkg is None else dpkg
    user = invoking_user() if user is None else user
    require_installed(layout)
    # First without the lock: a refusal must leave every file alone, the lock file included.
    _, bad = _check_all(layout, paths, registry.load(layout), dpkg, force)
    if bad:
        return WrapOutcome((), tuple(bad))
    wrapped: List[Entry] = []
    failed: List[Failure] = []
    with registry.lock(layout):
        good, failed = _check_all(layout, paths, registry.load(layout), dpkg, force)
        for cand in good:
            try:
                wrapped.append(wrap_one(layout, cand, policy, dpkg, user))
            except CudawrapError as exc:
                failed.append(Failure(cand.link, exc))
        if wrapped:
            refresh_launch_cache(layout)
    done = [c for c in good if any(e.link == c.link for e in wrapped)]
    return WrapOutcome(tuple(wrapped), tuple(failed), _warnings(done))


def _warnings(done: Sequence[Candidate]) -> Tuple[str, ...]:
    """What the admin should know of the programs just wrapped (DONE), one line each."""
    return tuple(
        f"warning: {c.link} belongs to the RPM package {c.rpm}: an update of {c.rpm} silently unwraps it; "
        f"run 'create-cudawrap --force {c.link}' again after every update"
        for c in done if c.rpm is not None) + tuple(
        f"warning: {c.link} is owned by {c.owner}, who can still change what it runs (its contents), "
        f"though not rename or replace it: only {trusted_names()} can write in {os.path.dirname(c.link)}"
        for c in done if c.owner is not None) + tuple(
        f"note: {c.link} has no #! line, so each run runs it with /bin/sh, as a shell runs such a script; "
        "give it a #! line (such as #!/bin/bash) if it needs another interpreter"
        for c in done if runs_with_sh(c.real))


def runs_with_sh(path: str) -> bool:
    """Whether the kernel cannot run PATH itself (neither #! nor ELF) and the shim then runs
    it with /bin/sh (launch.run_with_sh): text without a #! line."""
    from ..launch import is_script_text

    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return not head.startswith((b"#!", b"\x7fELF")) and is_script_text(path)
