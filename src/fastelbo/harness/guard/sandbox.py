"""What a candidate's worker may reach: no reference data, no harness memory, no orphans.

The reference's inputs and outputs live in two places only: the reference cache
(refcache.default_root(), or the check's cache directory) and the harness's private directory
(`private_root()`: every worker's scratch directory, and a check's own reference entries when
its seed is secret). A candidate's worker is confined at birth, before any thread or candidate
code exists, with the strongest protection this OS offers (`plan()` decides, `enter()` applies):

1. **landlock** (Linux >= 5.13, any user): the worker may read every file except those in the
   two directories and in the sessions' root, its own session's directory excepted
   (`sessions_root()`: what agents' Sessions were sent; rules on the rest of the tree, taken at
   its birth; directory listings stay readable everywhere), write only its own scratch directory
   ($TMPDIR), /dev/shm and the
   compile caches of its own candidate (torch extensions, Triton, Inductor, CUDA's: never the
   user's, which unconfined processes read, nor another candidate's; narrow_builds), not its
   candidate's folder,
   open only the device files a GPU job needs, and may not ptrace (read the memory of) or,
   from ABI 6, signal any process outside its domain: the check's process and the reference's
   worker included. It then gives up every capability (a root worker keeps its uid, not
   root's powers: _drop_capabilities).
2. **user** (running as root without Landlock): the worker drops to an unprivileged user
   (`nobody`) before any candidate code; the cache and private directories are mode 0700,
   root's. Used only where everything the worker must import is readable by that user.
3. **none**: neither is available. The report says so: a candidate could then read what the
   harness writes (with a secret seed, a per-check directory, removed at its end).

Every worker, confined or not, is a child subreaper (PR_SET_CHILD_SUBREAPER): a process the
candidate starts stays its descendant even in a new session or as a daemon, and
`process_tree.kill_tree()` ends them all with the worker. The one clone flag that would escape
it, CLONE_PARENT, is refused by a seccomp filter (seccomp.py; x86-64 and arm64), as are changes
to another process's CPU affinity, scheduling, priority and limits. Linux only; elsewhere
`plan()` reports "none".
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
import stat
import sys
import tempfile
from pathlib import Path

from . import seccomp

ENV = "FASTELBO_SANDBOX"  # "0": no confinement (the report says so); tests use it to compare
BUILDS_ENV = "FASTELBO_CANDIDATE_BUILDS"  # where candidates' compile caches live (candidate_builds)

# prctl options
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
# landlock syscalls (x86-64 and arm64 share these numbers) and flags
_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446
_CREATE_VERSION = 1
_RULE_PATH_BENEATH = 1
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_REMOVE_DIR, _REMOVE_FILE, _MAKE_CHAR, _MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
_MAKE_REG, _MAKE_SOCK, _MAKE_FIFO, _MAKE_BLOCK = 1 << 8, 1 << 9, 1 << 10, 1 << 11
_MAKE_SYM, _REFER, _TRUNCATE = 1 << 12, 1 << 13, 1 << 14
_SCOPE_SIGNAL = 1 << 1
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE  # what a rule on a file may hold
_READ = _EXECUTE | _READ_FILE | _READ_DIR
# Device files a GPU job opens read-write; every other device (a raw disk, /dev/mem) is denied.
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_DEVICE_PREFIXES = ("nvidia", "dri")


def private_root() -> Path:
    """The harness's own directory (mode 0700): worker scratch dirs, private reference data."""
    root = Path(tempfile.gettempdir()) / f"fastelbo-harness-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)
    return root


def sessions_root() -> Path:
    """Where every Session keeps the sources it is sent (mode 0711: its sessions' directories
    are reached by name, not listed). A candidate's worker reads only its own session's
    directory here (for_candidates): until 2026-12-05 sessions lived in the temp dir, and a
    candidate could read, and run, what other agents' sessions had been sent."""
    root = Path(tempfile.gettempdir()) / f"fastelbo-sessions-{os.getuid()}"
    root.mkdir(mode=0o711, exist_ok=True)
    os.chmod(root, 0o711)
    return root


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none (or it is disabled)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        abi = libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(abi), 0)


def plan(secrets: list[str | Path], reads: list[str | Path] = (),
         allow: list[str] = ()) -> dict:
    """The confinement for a candidate's worker: {"kind": landlock|user|none, "deny": [...],
    "note", ...}, equal for equal secrets and `allow` (a pool's spares serve any check with
    the same). `secrets`: directories it must not read (the cache, the private root, the
    sessions' root); `reads`: files it must read (its candidate, the problem), checked for the
    "user" kind; `allow`: directories inside a secret it may read all the same (its own
    session's), under Landlock. The note ends with what keeps the candidate's processes inside
    its worker's tree."""
    spec = _plan(secrets, reads)
    if spec["kind"] == "landlock":
        spec["allow"] = sorted(allow)
    why = seccomp.unavailable()
    tree = ("its processes: a subreaper's tree, CLONE_PARENT refused, no other process's CPUs, "
            "priority or limits (seccomp)" if why is None
            else f"its processes: a subreaper's tree (no seccomp filter: {why})")
    return {**spec, "note": f"{spec['note']}; {tree}"}


def _plan(secrets: list[str | Path], reads: list[str | Path]) -> dict:
    paths = {Path(p).resolve() for p in secrets}
    deny = sorted(str(p) for p in paths if not any(q in p.parents for q in paths))
    if os.environ.get(ENV) == "0":
        return {"kind": "none", "deny": deny, "note": f"confinement turned off ({ENV}=0)"}
    abi = landlock_abi()
    if abi:
        return {"kind": "landlock", "abi": abi, "deny": deny,
                "note": f"Landlock ABI {abi}: reference data and harness memory sealed"}
    if os.geteuid() == 0:
        import pwd
        try:
            user = pwd.getpwnam("nobody")
        except KeyError:
            user = None
        blocked = _unreadable_for_others([*sys.path, sys.prefix, *reads]) if user else ["no user"]
        if user and not blocked:
            return {"kind": "user", "deny": deny, "uid": user.pw_uid, "gid": user.pw_gid,
                    "note": "worker runs as nobody; reference data is root's, mode 0700"}
        return {"kind": "none", "deny": deny,
                "note": f"no Landlock, and user nobody cannot read {blocked[0]}"}
    return {"kind": "none", "deny": deny,
            "note": "no Landlock here: a candidate could read the reference's data"}


def for_candidates(root: str | Path | None = None, reads=(),
                   session: str | Path | None = None) -> dict:
    """A candidate's worker's confinement: it may read neither the reference cache (`root`,
    and the user's default one), nor the harness's private directory, nor the sessions' root
    but for one session's directory: `session`, else the one of the Session whose job this
    thread runs (session_scope), else none. Never one derived from `reads` (the files it must
    read, for the "user" kind's check): until 2026-12-05 a candidate's path inside another
    session's directory opened that directory to the worker. The same for every check of a
    Session (whose spares are born with it) and for compile and bench."""
    from ..refcache import default_root
    sessions = sessions_root()
    return plan([root or default_root(), default_root(), private_root(), sessions],
                reads=reads, allow=_own_session(sessions, session or _session.get()))


_session: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "fastelbo_session", default=None)


@contextlib.contextmanager
def session_scope(directory: str | Path):
    """While inside, the candidates' confinement made in this thread (for_candidates) reads
    `directory`, a Session's own, in the sessions' root: the session runs its jobs so."""
    token = _session.set(Path(directory))
    try:
        yield
    finally:
        _session.reset(token)


def _own_session(sessions: Path, session: str | Path | None) -> list[str]:
    """[`session`] when it is a directory directly in `sessions` (the sessions' root), else []."""
    if session is None:
        return []
    path = Path(session).resolve()
    return [str(path)] if path.parent == sessions.resolve() else []


def _unreadable_for_others(paths) -> list[str]:
    """Paths that exist and that a user outside owner and group could not reach."""
    bad = []
    for p in paths:
        if not p or not os.path.exists(p):
            continue
        p = Path(p).resolve()
        for d in [*reversed(p.parents), p]:
            mode = os.stat(d).st_mode
            need = stat.S_IXOTH if d.is_dir() else stat.S_IROTH
            if not mode & need:
                bad.append(str(d))
                break
    return bad


def enter(spec: dict | None, scratch: Path) -> None:
    """In a new worker, before any thread or candidate code: become a subreaper that nothing
    it starts can leave (seccomp.py), then apply `spec` (from plan(); None: no confinement).
    OSError when it cannot be applied: the worker must not run the candidate unconfined when
    confinement was promised."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    _prctl(libc, _PR_SET_CHILD_SUBREAPER, 1)
    seccomp.forbid_escapes()
    # the builds root as this process names it now, before TMPDIR moves to the scratch dir
    _entered.update(spec=spec, scratch=str(scratch), builds=str(candidate_builds()))
    if spec is not None:  # a candidate's worker, confined or not
        _first_for_the_oom_killer()
    if not spec or spec.get("kind") == "none":
        return
    caches = _compile_caches(scratch)
    if spec["kind"] == "user":
        os.chown(scratch, spec["uid"], spec["gid"])
        for d in caches:
            os.chown(d, spec["uid"], spec["gid"])
        _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1)
        os.setgroups([])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
        return
    _landlock(libc, spec, scratch, caches)
    _drop_capabilities(libc)


def _first_for_the_oom_killer() -> None:
    """Make this worker, and all it starts, the OOM killer's first choice (oom_score_adj 1000):
    a candidate that takes the host's memory is killed, not the harness's process (a server
    with other agents' sessions), the reference's worker or a baseline. Written while a root
    worker still holds CAP_SYS_RESOURCE, it also becomes the floor the process may not go
    below without it, so the candidate cannot take it back; any user may raise its own."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass  # no /proc: nothing to prefer


_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_CAP_VERSION_3 = 0x20080522


def _drop_capabilities(libc) -> None:
    """Give up every capability for good: the bounding set (where this process may: root),
    the ambient set, and the effective, permitted and inheritable sets (no_new_privs, set
    by then, keeps an exec from regaining any). A Landlock worker keeps its user, and as root
    it kept root's powers, which Landlock does not cover: on 2026-12-05 a root candidate
    loaded eBPF uprobes on libc's write (bpf, perf_event_open), read the reference worker's
    cache entries as that worker wrote them, and passed its check computing nothing. Without
    capabilities root is an ordinary user that owns root's files."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):  # EPERM without CAP_SETPCAP: nothing to drop there
        libc.prctl(_PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0)
    libc.prctl(_PR_CAP_AMBIENT, ctypes.c_ulong(_PR_CAP_AMBIENT_CLEAR_ALL), 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)  # this process
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable}: all zero
    if libc.capset(ctypes.byref(header), ctypes.byref(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")


_entered: dict = {}  # this worker's: spec, scratch, builds root (enter); narrowed (its dir)


def narrow_builds(digest: str) -> None:
    """Before a candidate is imported in a confined worker: its compile caches become a
    directory of its own under candidate_builds(), named by `digest` (the sha256 of the very
    bytes it will run: loader.import_candidate), and (under
    Landlock) a second ruleset lets the worker write nowhere else there (as `nobody`, every
    candidate is the same user: the directory is its own by name only). On 2026-12-05 a
    candidate built another's extension name from its own source in the shared caches, and that
    other candidate, wrong, then passed its check with the first one's code (a right one can
    be made to fail as easily). Layers of Landlock only narrow, and a worker runs one candidate,
    so this is done once. The directory is named by the whole digest: two sources that share
    its first 64 bits (about 2^32 hashes a side) would share a directory."""
    spec = _entered.get("spec")
    if not spec or spec.get("kind") == "none" or _entered.get("narrowed"):
        return
    base = Path(_entered["builds"]) / digest
    base.mkdir(mode=0o700, exist_ok=True)
    for var, name in _CACHE_VARS.items():
        path = base / name
        path.mkdir(exist_ok=True)
        os.environ[var] = str(path)
    _entered["narrowed"] = str(base)
    if spec["kind"] == "landlock":
        _landlock_writes(ctypes.CDLL(None, use_errno=True), spec["abi"],
                         [_entered["scratch"], base])


def _prctl(libc, option: int, value: int) -> None:
    if libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


# The compile caches a candidate may write, by environment variable: their directory names
_CACHE_VARS = {"TORCH_EXTENSIONS_DIR": "torch_extensions", "TRITON_CACHE_DIR": "triton",
               "TORCHINDUCTOR_CACHE_DIR": "inductor", "CUDA_CACHE_PATH": "nv",
               "PYTORCH_KERNEL_CACHE_PATH": "torch_kernels"}


def candidate_builds() -> Path:
    """The compile caches of candidates (BUILDS_ENV, else a directory of the temp dir): theirs
    alone, never read by the harness's other processes or by the user's."""
    return Path(os.environ.get(BUILDS_ENV)
                or Path(tempfile.gettempdir()) / f"fastelbo-candidate-builds-{os.getuid()}")


def nearly_full(path: str | Path) -> bool:
    """Whether the file system holding `path` has less than a twentieth of its space free
    (False where that cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * 20 < st.f_blocks


def forget_builds(digest: str, filling: str | Path) -> bool:
    """Remove the build directory of the candidate whose source hashes to `digest` (narrow_builds
    named it) where it is on the file system of `filling` and that is nearly full: what the
    candidate wrote there outlives its worker (a disk filled so, and not freed, would starve
    the reference it ran beside, and the one run after it alone). Its next worker builds again.
    Whether it was removed."""
    import shutil
    path = candidate_builds() / digest
    try:
        same = os.stat(path).st_dev == os.stat(filling).st_dev
    except OSError:
        return False
    if same and nearly_full(filling) and len(digest) == 64 and digest.isalnum():
        shutil.rmtree(path, ignore_errors=True)
        return True
    return False


def _compile_caches(scratch: Path) -> list[Path]:
    """Where a confined candidate may build: the candidates' root (candidate_builds()), in
    which narrow_builds gives each candidate a directory of its own before its import (its
    checks share it: a rebuilt extension costs minutes), and until then the root's own torch
    extension, Triton, Inductor, torch JIT kernel and CUDA caches, set in the environment.
    Never the user's own caches: those are read by processes no confinement holds (the
    torch.compile baseline's worker, the user's), and Inductor, for one, never rewrites a
    module it finds there, so on 2026-12-05 a candidate that appended code to the baseline's
    compiled modules ran it, unconfined, in the next bench's baseline worker.
    """
    base = candidate_builds()
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = [base]  # the whole root: narrow_builds makes a directory of the candidate's there
    for var, name in _CACHE_VARS.items():
        path = base / name
        path.mkdir(exist_ok=True)
        os.environ[var] = str(path)
        out.append(path)
    os.environ["TMPDIR"] = str(scratch)
    tempfile.tempdir = str(scratch)
    return out


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _writes(abi: int) -> int:
    """Every right that changes the file system, as far as Landlock ABI `abi` handles them."""
    return (_WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE_CHAR | _MAKE_DIR | _MAKE_REG
            | _MAKE_SOCK | _MAKE_FIFO | _MAKE_BLOCK | _MAKE_SYM
            | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0))


def _device_files() -> list[str]:
    """The device files a GPU job opens (_DEVICES, _DEVICE_PREFIXES), as /dev holds them now."""
    return [e.path for e in os.scandir("/dev")
            if e.name in _DEVICES or e.name.startswith(_DEVICE_PREFIXES)]


def _landlock(libc, spec: dict, scratch: Path, caches: list[Path]) -> None:
    abi = spec["abi"]
    handled = _EXECUTE | _READ_FILE | _READ_DIR | _writes(abi)
    fd = _ruleset(libc, abi, handled, _SCOPE_SIGNAL if abi >= 6 else 0)
    try:
        def allow(path, rights: int) -> None:
            _add_rule(libc, fd, path, rights, handled)

        everything = handled
        deny = [Path(d) for d in spec["deny"]]
        special = [Path("/dev"), Path("/proc")]
        allow("/", _READ_DIR)  # names everywhere (imports list directories), contents not
        for path in _complement(Path("/"), deny + special):
            allow(path, _READ)
        allow("/proc", _READ)  # other processes' memory stays behind Landlock's ptrace scope
        allow(f"/proc/{os.getpid()}", everything)  # its own: the CUDA driver writes there
        allow("/dev/shm", everything)
        for path in _device_files():
            allow(path, _READ | _WRITE_FILE)
        for d in [scratch, *caches]:
            allow(d, everything)
        for d in spec.get("allow", ()):  # its own session's sources, inside a denied root
            allow(d, _READ)
        _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1)
        _restrict(libc, fd)
    finally:
        os.close(fd)


def _ruleset(libc, abi: int, handled: int, scoped: int) -> int:
    """A new Landlock ruleset's descriptor, handling `handled` (and `scoped`, ABI 6+)."""
    attr = _RulesetAttr(handled, 0, scoped)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    fd = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
    return fd


def _restrict(libc, fd: int) -> None:
    if libc.syscall(_SYS_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")


def _landlock_writes(libc, abi: int, writable: list) -> None:
    """A further Landlock layer on writes only: this process may then write (create, remove,
    link, truncate) only under `writable`, /dev/shm, its own /proc entry and the device files a
    GPU needs; reads are left to the first layer."""
    writes = _writes(abi)
    fd = _ruleset(libc, abi, writes, 0)
    try:
        for path in [*writable, "/dev/shm", f"/proc/{os.getpid()}", *_device_files()]:
            _add_rule(libc, fd, path, writes, writes)
        _restrict(libc, fd)
    finally:
        os.close(fd)


def _add_rule(libc, fd: int, path, rights: int, handled: int) -> None:
    """Grant `rights` (of those `handled`) beneath `path` (a file: its file rights only)."""
    try:
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # vanished meanwhile, or unreadable: nothing to grant
    try:
        if not stat.S_ISDIR(os.fstat(pfd).st_mode):
            rights &= _FILE_RIGHTS
        rule = _PathBeneath(rights & handled, pfd)
        if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(_RULE_PATH_BENEATH),
                        ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_add_rule({path}): {os.strerror(err)}")
    finally:
        os.close(pfd)


def _complement(root: Path, deny: list[Path]) -> list[Path]:
    """Paths whose subtrees together hold everything under `root` except the `deny` paths
    (entries that exist now: a file created later beside a denied path stays unreadable)."""
    if any(root == d for d in deny):
        return []
    if not any(root in d.parents for d in deny):
        return [root]
    out = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    for entry in entries:
        p = Path(entry.path)
        if entry.is_symlink():
            continue  # its target is reached (or denied) where it really is
        out += _complement(p, deny)
    return out
