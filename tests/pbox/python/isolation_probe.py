"""Isolation probes, run INSIDE a sandbox by test_isolation.py (uploaded, then run with python3).

Usage: python3 isolation_probe.py CONFIG_JSON  ->  prints one JSON object on stdout:
    {probe_name: {"blocked": bool, "detail": str}, ...}

"blocked" is the probe's own verdict: the attempt failed. Some probes also need the host's word
(did the listener see a connection, did the datagram arrive); the test adds that. The script
uses only the standard library and raw system calls through ctypes, so that it runs on any
image with python3 and on any runtime.
"""

import ctypes
import errno
import hashlib
import json
import os
import platform
import socket
import struct
import sys
import time

CFG = json.loads(sys.argv[1])
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long

# System call numbers (the probe must work without headers).
NR = {
    "x86_64": {"init_module": 175, "finit_module": 313, "ptrace": 101, "keyctl": 250,
               "add_key": 248, "perf_event_open": 298, "userfaultfd": 323, "bpf": 321,
               "io_uring_setup": 425, "unshare": 272, "setns": 308, "clone": 56,
               "fsopen": 430, "open_tree": 428, "process_vm_readv": 310,
               "open_by_handle_at": 304, "kexec_load": 246, "chroot": 161, "pivot_root": 155},
    "aarch64": {"init_module": 105, "finit_module": 273, "ptrace": 117, "keyctl": 219,
                "add_key": 217, "perf_event_open": 241, "userfaultfd": 282, "bpf": 280,
                "io_uring_setup": 425, "unshare": 97, "setns": 268, "clone": 220,
                "fsopen": 430, "open_tree": 428, "process_vm_readv": 270,
                "open_by_handle_at": 265, "kexec_load": 104, "chroot": 51, "pivot_root": 41},
}[platform.machine()]

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
SIGCHLD = 17


def sys_call(name, *args):
    """Raw system call; returns (result, errno name or "")."""
    ctypes.set_errno(0)
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    r = LIBC.syscall(ctypes.c_long(NR[name]), *conv)
    e = ctypes.get_errno()
    return r, (errno.errorcode.get(e, str(e)) if r < 0 else "")


def libc_call(fn, *args):
    ctypes.set_errno(0)
    r = fn(*args)
    e = ctypes.get_errno()
    return r, (errno.errorcode.get(e, str(e)) if r < 0 else "")


def oserr(e):
    return errno.errorcode.get(e.errno, str(e.errno)) if isinstance(e, OSError) else repr(e)


RESULTS = {}


def probe(name):
    def wrap(fn):
        try:
            blocked, detail = fn()
        except Exception as e:  # a probe that crashes proves nothing: reported, not blocked
            blocked, detail = False, f"probe error: {e!r}"
        RESULTS[name] = {"blocked": bool(blocked), "detail": str(detail)[:300]}
        return fn
    return wrap


def try_read(path):
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16), ""
    except OSError as e:
        return None, oserr(e)


@probe("read_host_files")
def _():
    leaks, seen = [], []
    for path, secret in CFG["canaries"].items():
        for variant in (path, "/proc/1/root" + path, "/proc/self/root/../../.." + path,
                        "/proc/1/cwd/../../.." + path):
            data, err = try_read(variant)
            if data is not None and secret.encode() in data:
                leaks.append(variant)
            seen.append(f"{variant}:{err or 'read(no secret)'}")
    for path in CFG["host_dirs"]:
        try:
            names = os.listdir(path)
            if set(names) & set(CFG["host_dir_markers"].get(path, [])):
                leaks.append(f"listdir {path}")
        except OSError:
            pass
    data, err = try_read("/etc/shadow")
    if data is not None and CFG["host_shadow_sha256"] and \
            hashlib.sha256(data).hexdigest() == CFG["host_shadow_sha256"]:
        leaks.append("/etc/shadow is the host's")
    return not leaks, ("LEAKED " + ", ".join(leaks)) if leaks else "; ".join(seen[:4]) + " ..."


@probe("init_fds_via_proc")
def _():
    # pbox-init (PID 1) holds the agent's stderr and its channel: reopening them through
    # /proc/1/fd would give a sandbox the agent's log.
    opened = []
    for fd in range(0, 8):
        for mode in ("rb", "ab"):
            try:
                with open(f"/proc/1/fd/{fd}", mode):
                    opened.append(f"{fd}:{mode}")
            except OSError:
                pass
    # Listing /proc/1/fd shows fd numbers only (the directory belongs to uid 0); where they
    # lead must stay hidden.
    for link in [f"fd/{fd}" for fd in range(0, 8)] + ["exe", "cwd", "root"]:
        try:
            opened.append(f"readlink /proc/1/{link} = {os.readlink(f'/proc/1/{link}')}")
        except OSError:
            pass
    for f in ("exe", "environ", "mem"):
        data, _ = try_read(f"/proc/1/{f}")
        # Under gVisor /proc/1 is the holder, which shares pbox-init's memory; pbox-init
        # overwrote its environment strings with NUL bytes, which is all environ may show.
        if data and (f != "environ" or data.strip(b"\0")):
            opened.append(f"/proc/1/{f}")
    return not opened, ("opened " + ", ".join(opened)) if opened else "EACCES on /proc/1/fd/*"


def open_for_write(paths):
    """Opening for writing is already the breach: nothing is written, so that a hole found
    here cannot harm the host."""
    opened, errs = [], []
    for path in paths:
        try:
            os.close(os.open(path, os.O_WRONLY))
            opened.append(path)
        except OSError as e:
            errs.append(f"{path}:{oserr(e)}")
    return not opened, ("OPENED FOR WRITE " + ", ".join(opened)) if opened else "; ".join(errs)


@probe("write_proc_sys")
def _():
    return open_for_write(["/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches",
                           "/proc/sys/kernel/modprobe", "/proc/sys/net/ipv4/ip_forward",
                           "/proc/sysrq-trigger", "/proc/sys/fs/file-max"])


@probe("write_sys")
def _():
    return open_for_write(["/sys/kernel/uevent_helper", "/sys/fs/cgroup/memory.max",
                           "/sys/power/state", "/sys/class/net/lo/mtu", "/sys/kernel/mm/ksm/run"])


@probe("mount")
def _():
    os.makedirs("/tmp/probe-mnt", exist_ok=True)
    done, errs = [], []
    for src, fstype in (("tmpfs", b"tmpfs"), ("sysfs", b"sysfs"), ("proc", b"proc"),
                        ("cgroup2", b"cgroup2"), ("/", None)):
        flags = 4096 if fstype is None else 0  # MS_BIND for "/"
        r, e = libc_call(LIBC.mount, src.encode(), b"/tmp/probe-mnt", fstype, flags, None)
        (done if r == 0 else errs).append(f"{src}:{e}")
    r, e = sys_call("fsopen", b"tmpfs", 0)
    (done if r >= 0 else errs).append(f"fsopen:{e}")
    r, e = sys_call("open_tree", -100, b"/", 1)
    (done if r >= 0 else errs).append(f"open_tree:{e}")
    return not done, ("MOUNTED " + ", ".join(done)) if done else "; ".join(errs)


@probe("unshare_then_mount")
def _():
    r, e = sys_call("unshare", CLONE_NEWNS)
    if r == 0:
        r2, e2 = libc_call(LIBC.mount, b"tmpfs", b"/tmp/probe-mnt", b"tmpfs", 0, None)
        return r2 != 0, f"unshare(NEWNS) ok, mount:{e2 or 'ok'}"
    return True, f"unshare(CLONE_NEWNS):{e}"


@probe("unshare_newuser")
def _():
    errs = []
    for flags in (CLONE_NEWUSER, CLONE_NEWUSER | CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID):
        r, e = sys_call("unshare", flags)
        if r == 0:
            return False, f"unshare({flags:#x}) succeeded"
        errs.append(f"unshare({flags:#x}):{e}")
    # clone(CLONE_NEWUSER) without CLONE_VM behaves like fork when it succeeds.
    r, e = sys_call("clone", CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
    if r == 0:
        os._exit(0)
    if r > 0:
        os.waitpid(r, 0)
        return False, "clone(CLONE_NEWUSER) succeeded"
    errs.append(f"clone(NEWUSER):{e}")
    return True, "; ".join(errs)


@probe("setns")
def _():
    try:
        fd = os.open("/proc/1/ns/mnt", os.O_RDONLY)
    except OSError as e:
        return True, f"open /proc/1/ns/mnt:{oserr(e)}"
    r, e = sys_call("setns", fd, 0)
    os.close(fd)
    return r != 0, f"setns:{e or 'ok'}"


@probe("load_module")
def _():
    buf = ctypes.create_string_buffer(64)
    r1, e1 = sys_call("init_module", buf, 64, b"")
    fd = os.open("/dev/null", os.O_RDONLY)
    r2, e2 = sys_call("finit_module", fd, b"", 0)
    os.close(fd)
    r3, e3 = sys_call("kexec_load", 0, 0, 0, 0)
    ok = r1 < 0 and r2 < 0 and r3 < 0
    return ok, f"init_module:{e1} finit_module:{e2} kexec_load:{e3}"


@probe("ptrace")
def _():
    PTRACE_ATTACH, PTRACE_DETACH = 16, 17
    attached, errs = [], []
    targets = [1, CFG["agent_host_pid"], CFG["host_self_pid"]]
    mine = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    # Every pid not in this sandbox up to 4096: none may be reachable.
    targets += [p for p in range(2, 4096) if p not in mine]
    for pid in targets:
        r, e = sys_call("ptrace", PTRACE_ATTACH, pid, 0, 0)
        if r == 0:
            attached.append(pid)
            sys_call("ptrace", PTRACE_DETACH, pid, 0, 0)
        elif pid in targets[:3]:
            errs.append(f"{pid}:{e}")
    # process_vm_readv of PID 1
    local = (ctypes.c_char * 16)()
    iov_l = struct.pack("QQ", ctypes.addressof(local), 16)
    iov_r = struct.pack("QQ", 0x400000, 16)
    r, e = sys_call("process_vm_readv", 1, ctypes.c_char_p(iov_l), 1, ctypes.c_char_p(iov_r),
                    1, 0)
    if r > 0:
        attached.append("process_vm_readv(1)")
    errs.append(f"process_vm_readv(1):{e}")
    return not attached, (f"ATTACHED {attached}" if attached else "; ".join(errs))


@probe("signal_outside")
def _():
    hit = []
    for pid in (CFG["agent_host_pid"], CFG["host_self_pid"]):
        if str(pid) in os.listdir("/proc"):
            continue  # the same number names a sandbox process here
        try:
            os.kill(pid, 0)
            hit.append(pid)
        except OSError as e:
            pass
    if not CFG.get("try_kill_init", True):
        # gVisor: a same-uid SIGKILL does end PID 1 and with it the sandbox (and this probe
        # run); test_isolation.py checks that case on its own.
        return not hit, (f"reached {hit}" if hit else "ESRCH for host pids") + \
            "; SIGKILL of pid 1 not tried here"
    try:
        os.kill(1, 9)  # PID 1 of a pid namespace ignores SIGKILL from inside
        time.sleep(0.1)
        alive = os.path.exists("/proc/1")
    except OSError:
        alive = True
    if not alive:
        hit.append("SIGKILL pid 1")
    return not hit, f"reached {hit}" if hit else "ESRCH for host pids; pid 1 survives SIGKILL"


@probe("raw_sockets")
def _():
    opened, errs = [], []
    for fam, typ, proto, name in ((socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP,
                                   "inet raw"),
                                  (socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6,
                                   "inet6 raw"),
                                  (socket.AF_PACKET, socket.SOCK_RAW, 0x0300, "packet raw"),
                                  (socket.AF_PACKET, socket.SOCK_DGRAM, 0x0300, "packet dgram")):
        try:
            socket.socket(fam, typ, proto).close()
            opened.append(name)
        except OSError as e:
            errs.append(f"{name}:{oserr(e)}")
    return not opened, ("OPENED " + ", ".join(opened)) if opened else "; ".join(errs)


def tcp_try(host, port, family=socket.AF_INET):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect((host, port))
        s.sendall(b"escaped")
        return True, "connected"
    except OSError as e:
        return False, oserr(e) if not isinstance(e, socket.timeout) else "timeout"
    finally:
        s.close()


@probe("net_interfaces")
def _():
    names = [n for _, n in socket.if_nameindex()]
    return names == ["lo"], f"interfaces {names}"


@probe("tcp_host_loopback")
def _():
    ok, why = tcp_try("127.0.0.1", CFG["host_tcp_port"])
    return not ok, f"127.0.0.1:{CFG['host_tcp_port']}:{why}"


@probe("udp_host_loopback")
def _():
    # A datagram to our own loopback "succeeds" locally: the host side reports if it arrived.
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.sendto(CFG["nonce"].encode(), ("127.0.0.1", CFG["host_udp_port"]))
        return True, "sent (host checks arrival)"
    except OSError as e:
        return True, oserr(e)
    finally:
        s.close()


@probe("tcp_non_loopback")
def _():
    res = []
    reached = False
    for host in CFG["host_addresses"] + ["1.1.1.1", "8.8.8.8", "10.0.0.1"]:
        ok, why = tcp_try(host, CFG["host_tcp_port"] if host in CFG["host_addresses"] else 53)
        reached |= ok
        res.append(f"{host}:{why}")
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for host in CFG["host_addresses"]:
        try:
            s.sendto(CFG["nonce"].encode(), (host, CFG["host_udp_port"]))
            res.append(f"udp {host}:sent")
        except OSError as e:
            res.append(f"udp {host}:{oserr(e)}")
    s.close()
    return not reached, "; ".join(res)


@probe("agent_tcp_port")
def _():
    ok, why = tcp_try("127.0.0.1", CFG["agent_tcp_port"])
    return not ok, f"127.0.0.1:{CFG['agent_tcp_port']}:{why}"


@probe("agent_unix_socket")
def _():
    reached, res = [], []
    for path in (CFG["agent_socket"], "/proc/1/root" + CFG["agent_socket"], "/run/pbox/pbox.sock"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            reached.append(path)
        except OSError as e:
            res.append(f"{path}:{oserr(e)}")
        finally:
            s.close()
    return not reached, ("CONNECTED " + ", ".join(reached)) if reached else "; ".join(res)


@probe("host_abstract_unix")
def _():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("\0" + CFG["abstract_name"])
        return False, "connected"
    except OSError as e:
        return True, oserr(e)
    finally:
        s.close()


@probe("cpuset_escape")
def _():
    allowed = set(CFG["allowed_cpus"])
    try:
        os.sched_setaffinity(0, set(range(CFG["host_cpus"])))
        set_result = "setaffinity(all):ok"
    except OSError as e:
        set_result = f"setaffinity(all):{oserr(e)}"
    got = os.sched_getaffinity(0)
    ran_on = set()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        with open("/proc/self/stat") as f:
            ran_on.add(int(f.read().rsplit(")", 1)[1].split()[36]))
    escaped = (got - allowed) | (ran_on - allowed)
    return not escaped, f"{set_result}; affinity {sorted(got)}; ran on {sorted(ran_on)}; " \
                        f"allowed {sorted(allowed)}"


@probe("cgroup_limits")
def _():
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if " - cgroup" in line:
                found.append(line.split()[4])
    wrote = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                 "/sys/fs/cgroup/pids.max", "/sys/fs/cgroup/cgroup.procs"):
        try:
            os.close(os.open(path, os.O_WRONLY))
            wrote.append(path)
        except OSError:
            pass
    bad = found + wrote
    with open("/proc/self/cgroup") as f:
        cg = f.read().replace("\n", " | ")
    return not bad, (f"cgroupfs visible/written: {bad}" if bad else
                     f"no cgroupfs mounted; /proc/self/cgroup = {cg[:120]}")


@probe("other_sandboxes")
def _():
    marker = CFG["other_marker"]
    seen = []
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    for p in pids:
        if int(p) == os.getpid():
            continue  # this probe's own argv carries the marker
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    seen.append(f"process {p}")
        except OSError:
            pass
    for root in ("/tmp", "/var/tmp", "/dev/shm", "/workspace", "/run", "/"):
        try:
            if any(marker in n for n in os.listdir(root)):
                seen.append(f"file in {root}")
        except OSError:
            pass
    return not seen, (f"SAW {seen}" if seen else f"{len(pids)} pids visible, no marker")


@probe("host_processes")
def _():
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    names = []
    for p in pids:
        try:
            with open(f"/proc/{p}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    bad = [n for n in names if n in ("pboxd", "systemd", "sshd", "init", "ninja", "cc1plus")]
    return not bad and len(pids) < 50, f"{len(pids)} pids: {sorted(set(names))[:10]}"


@probe("keyctl")
def _():
    KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION = 0, -3
    r1, e1 = sys_call("keyctl", KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION, 1)
    r2, e2 = sys_call("add_key", b"user", b"probe", b"x", 1, -3)
    return r1 < 0 and r2 < 0, f"keyctl:{e1} add_key:{e2}"


@probe("perf_event_open")
def _():
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("II", attr, 0, 1, 128)  # PERF_TYPE_SOFTWARE, size
    r, e = sys_call("perf_event_open", attr, 0, -1, -1, 0)
    if r >= 0:
        os.close(r)
    return r < 0, f"perf_event_open:{e}"


@probe("userfaultfd")
def _():
    r, e = sys_call("userfaultfd", 0)
    if r >= 0:
        os.close(r)
    return r < 0, f"userfaultfd:{e}"


@probe("bpf_io_uring")
def _():
    attr = ctypes.create_string_buffer(128)
    r1, e1 = sys_call("bpf", 0, attr, 128)
    params = ctypes.create_string_buffer(120)
    r2, e2 = sys_call("io_uring_setup", 1, params)
    for r in (r1, r2):
        if r >= 0:
            os.close(r)
    return r1 < 0 and r2 < 0, f"bpf:{e1} io_uring_setup:{e2}"


@probe("mknod_devices")
def _():
    made = []
    for name, mode, dev in (("sda", 0o60600, os.makedev(8, 0)),
                            ("mem", 0o20600, os.makedev(1, 1)),
                            ("kmsg", 0o20600, os.makedev(1, 11))):
        try:
            os.mknod(f"/tmp/probe-{name}", mode, dev)
            made.append(name)
        except OSError:
            pass
    readable = []
    for path in ("/proc/kcore", "/proc/kmsg", "/dev/mem", "/dev/kmsg"):
        data, _ = try_read(path)
        if data:
            readable.append(path)
    bad = made + readable
    return not bad, f"made/read {bad}" if bad else "mknod EPERM; kcore/kmsg unreadable"


@probe("chroot_escape")
def _():
    os.makedirs("/tmp/probe-jail", exist_ok=True)
    r, e = sys_call("chroot", b"/tmp/probe-jail")
    r2, e2 = sys_call("pivot_root", b"/tmp", b"/tmp/probe-jail")
    h = (ctypes.c_char * 136)()
    r3, e3 = sys_call("open_by_handle_at", -100, h, 0)
    return r < 0 and r2 < 0 and r3 < 0, f"chroot:{e} pivot_root:{e2} open_by_handle_at:{e3}"


@probe("capabilities")
def _():
    caps = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")):
                k, v = line.split(":")
                caps[k] = int(v.strip(), 16)
    return all(v == 0 for v in caps.values()), " ".join(f"{k}={v:x}" for k, v in caps.items())


json.dump(RESULTS, sys.stdout)
