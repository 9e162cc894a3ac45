"""Rootless agents for the pbox Python suites: pboxd run as an ordinary user.

    PBOX_TEST_ROOTLESS=1   every agent the suite starts runs as the user PBOX_TEST_USER
                           (default "pbox-rootless", created here if missing), in a cgroup
                           delegated to that user, with its state under a directory of its own

The test process stays root: it sets up what an administrator (or systemd's Delegate=yes)
would, then drops to the user only for pboxd itself (setpriv). The delegated cgroup is made at
the top of each hierarchy, as systemd makes a delegated unit's: on cgroup v2 one directory whose
cgroup.procs, cgroup.subtree_control and cgroup.threads belong to the user; on cgroup v1 one
directory per hierarchy with its tasks and cgroup.procs chowned (v1 has no other delegation).
"""

from __future__ import annotations

import grp
import itertools
import os
import pwd
import shutil
import subprocess
import time
from pathlib import Path
from typing import List, Optional

ROOTLESS: bool = os.environ.get("PBOX_TEST_ROOTLESS", "") not in ("", "0")
# $PBOX_TEST_OVERLAY: rootless agents get --overlay with it ("fuse": sandboxes' roots as
# fuse-overlayfs mounts, as on a kernel before 5.11).
OVERLAY: str = os.environ.get("PBOX_TEST_OVERLAY", "")
USER: str = os.environ.get("PBOX_TEST_USER", "pbox-rootless")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The v1 hierarchies pboxd uses (cpuacct beside cpu where they are separate mounts).
V1_HIERARCHIES = ("memory", "pids", "cpuset", "cpu", "cpuacct", "freezer")

_counter = itertools.count()


def ensure_user() -> pwd.struct_passwd:
    """The test user, created (a system user without home or shell) if it does not exist.
    ctest runs the root and rootless suites at once: a useradd that loses the race (the user
    exists, or /etc/passwd is locked) is retried until the user is there."""
    if shutil.which("useradd") is None:
        return _ensure_user_without_useradd()
    last = None
    for _ in range(50):
        try:
            return pwd.getpwnam(USER)
        except KeyError:
            pass
        last = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                               "/usr/sbin/nologin", "--user-group", USER],
                              capture_output=True, text=True)
        if last.returncode != 0:
            time.sleep(0.1)
    raise RuntimeError(f"useradd {USER}: {last.stderr if last else ''}")


def _ensure_user_without_useradd() -> pwd.struct_passwd:
    """A minimal root without the passwd package (a test VM's, say): the two lines useradd
    would write, with an id no one has."""
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pass
    taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    uid = next(i for i in range(990, 100, -1) if i not in taken)
    with open("/etc/group", "a") as f:
        f.write(f"{USER}:x:{uid}:\n")
    with open("/etc/passwd", "a") as f:
        f.write(f"{USER}:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin\n")
    return pwd.getpwnam(USER)


def cgroup_v2() -> bool:
    return (CGROUP_ROOT / "cgroup.controllers").exists()


class DelegatedCgroup:
    """A cgroup (one per hierarchy on v1) handed to the test user, removed by remove()."""

    def __init__(self, user: pwd.struct_passwd) -> None:
        self.user = user
        name = f"pbox-rootless-{os.getpid()}-{next(_counter)}"
        self.dirs: List[Path] = []
        if cgroup_v2():
            d = CGROUP_ROOT / name
            d.mkdir()
            self.dirs.append(d)
            # What systemd chowns for Delegate=yes.
            for f in ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):
                os.chown(d / f if f else d, user.pw_uid, user.pw_gid)
            return
        for h in V1_HIERARCHIES:
            base = CGROUP_ROOT / h
            if not base.is_dir() or base.is_symlink():
                continue
            d = base / name
            d.mkdir()
            self.dirs.append(d)
            if h == "cpuset":
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (d / f).write_text((base / f).read_text())
            for f in ("", "tasks", "cgroup.procs"):
                os.chown(d / f if f else d, user.pw_uid, user.pw_gid)

    def enter(self) -> None:
        """Moves the calling process in (a preexec_fn: still root, before it drops). On v2,
        once an agent has moved itself into the leaf "agent" and enabled controllers for its
        children, the delegated directory may hold no process: a restart or a reaper starts
        in that leaf, as it would from the shell the first agent moved there."""
        for d in self.dirs:
            leaf = d / "agent"
            target = leaf if cgroup_v2() and (leaf / "cgroup.procs").exists() else d
            with open(target / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

    def remove(self) -> List[str]:
        """Removes the delegated directories, deepest first; returns those that would not go
        (something still in them)."""
        left = []
        for d in self.dirs:
            subdirs = sorted((p for p in d.rglob("*") if p.is_dir()),
                             key=lambda p: len(p.parts), reverse=True)
            for p in subdirs + [d]:
                for _ in range(100):
                    try:
                        p.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.02)
                else:
                    left.append(str(p))
        return left


_dev_fuse_mode: Optional[int] = None


def open_dev_fuse() -> None:
    """fuse-overlayfs as the test user needs /dev/fuse read-write, as most distributions make it
    (mode 0666); this machine's is 0600. Opened to everyone until the test process exits, then
    put back as it was."""
    global _dev_fuse_mode
    mode = os.stat("/dev/fuse").st_mode & 0o7777
    if mode & 0o006 == 0o006 or _dev_fuse_mode is not None:
        return
    import atexit

    _dev_fuse_mode = mode
    os.chmod("/dev/fuse", mode | 0o666)
    atexit.register(os.chmod, "/dev/fuse", mode)


def owned_tempdir(user: pwd.struct_passwd) -> Path:
    """A short directory under /tmp that belongs to the user (unix socket paths are short)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="pbr-", dir="/tmp"))
    os.chown(d, user.pw_uid, user.pw_gid)
    return d


def as_user(user: pwd.struct_passwd, argv: List[str]) -> List[str]:
    """argv run as the user, with no supplementary groups (setpriv execs: the pid is kept)."""
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    return [setpriv, f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
            "--"] + argv


def chown_tree(path: Path, user: Optional[pwd.struct_passwd]) -> None:
    """Gives `path` (a file the test wrote for the agent, e.g. a token) to the user."""
    if user is not None:
        os.chown(path, user.pw_uid, user.pw_gid)
