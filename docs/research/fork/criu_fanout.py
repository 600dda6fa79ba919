#!/usr/bin/env python3
"""The durable path beside forkns: the same 50 MB python, dumped once by CRIU and
restored into N fresh PID namespaces (each with PID 2 = the dumped PID, its own
mount namespace and FIFOs), one after the other; time until each answers.
Run as root: python3 criu_fanout.py N [lazy]"""
import os, select, subprocess, sys, time, shutil, re

CRIU = "/opt/deltabox/criu/sbin/criu"
D = "/tmp/forkspike"
IMG = "/dev/shm/forkspike-img"
PY = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkns.c")).read()
PY = re.search(r'static const char \*PY =\n(.*?);\n', PY, re.S).group(1)
PY = "".join(eval(l.strip().replace('" TOP "', D)) for l in PY.splitlines())

def fifos(d):
    os.makedirs(d, exist_ok=True)
    fds = []
    for n in ("in", "out"):
        p = os.path.join(d, n)
        if os.path.exists(p): os.unlink(p)
        os.mkfifo(p, 0o666)
        fds.append(os.open(p, os.O_RDWR))
    return fds

def ask(fds, msg, timeout=30):
    os.write(fds[0], msg.encode() + b"\n")
    r, _, _ = select.select([fds[1]], [], [], timeout)
    if not r: raise TimeoutError(msg)
    return os.read(fds[1], 256).decode()

def hostpid_of(init_pid, nspid):
    for p in os.listdir("/proc"):
        if not p.isdigit(): continue
        try:
            st = open(f"/proc/{p}/status").read()
            if os.readlink(f"/proc/{p}/ns/pid") != os.readlink(f"/proc/{init_pid}/ns/pid"): continue
        except OSError: continue
        m = re.search(r"NSpid:\s+(\d+)\s+(\d+)", st)
        if m and int(m.group(2)) == nspid: return int(p)

STARTED = []

def main():
    n = int(sys.argv[1]); lazy = len(sys.argv) > 2 and sys.argv[2] == "lazy"
    os.makedirs(f"{D}/io", exist_ok=True)
    src = fifos(f"{D}/src")
    shutil.rmtree(IMG, ignore_errors=True); os.makedirs(IMG)
    holder = subprocess.Popen(["unshare", "-p", "-f", "-m", "sh", "-c",
        f"mount --make-rprivate /; mount -t proc proc /proc; mount --bind {D}/src {D}/io; "
        f"echo 99 > /proc/sys/kernel/ns_last_pid; setsid /usr/bin/python3 -c \"$PY\" </dev/null >/dev/null 2>&1 & exec sleep 100000"], env={**os.environ, "PY": PY})
    a = ask(src, "hello")
    STARTED.append(holder)
    print("source:", a.strip())
    pypid = a.split()[0].split("=")[1]
    init = int(subprocess.check_output(["pgrep", "-P", str(holder.pid)]).split()[0])
    t = time.monotonic()
    subprocess.run(["nsenter", "-t", str(init), "-p", "-m", CRIU, "dump", "-t", pypid, "-D", IMG,
                    "--leave-running", "-o", "dump.log", "-v2"], check=True)
    print(f"criu dump --leave-running: {(time.monotonic()-t)*1e3:.0f} ms; image",
          subprocess.check_output(["du", "-sh", IMG]).split()[0].decode())
    procs, per = [], []
    t0 = time.monotonic()
    for i in range(n):
        fds = fifos(f"{D}/c{i}")
        ti = time.monotonic()
        extra = ""
        if lazy:
            extra = "--lazy-pages"
        p = subprocess.Popen(["unshare", "-p", "-f", "-m", "sh", "-c",
            f"mount --make-rprivate /; mount -t proc proc /proc; mount --bind {D}/c{i} {D}/io; "
            + (f"{CRIU} lazy-pages -D {IMG} -o lazy{i}.log & " if lazy else "")
            + f"{CRIU} restore -D {IMG} -d -o restore{i}.log {extra} && exec sleep 100000"])
        procs.append(p)
        STARTED.append(p)
        a = ask(fds, f"criu-{i}")
        per.append((time.monotonic() - ti) * 1e3)
        print(f"restore {i}: answered after {per[-1]:.1f} ms (at {(time.monotonic()-t0)*1e3:.0f} ms): {a.strip()}")
    total = (time.monotonic() - t0) * 1e3
    print(f"CRIU FANOUT n={n}{' lazy' if lazy else ''}: all answered in {total:.0f} ms "
          f"({total/n:.1f} ms/branch; p50 {sorted(per)[n//2]:.1f} ms)")
    # each unshare's child is its namespace's PID 1: killing it ends the namespace


def cleanup():
    # each unshare's child is its namespace's PID 1: killing it ends the namespace
    for p in STARTED:
        for c in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split():
            os.kill(int(c), 9)
        p.kill()

try:
    main()
finally:
    cleanup()
