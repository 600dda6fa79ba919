#!/usr/bin/env python3
"""CRIU's zdtm static tests, plain CRIU (host flavor) against DeltaBox.

Usage (run.sh passes these):
  harness.py CRIU_SRC DELTABOX_BIN DELTABOX_SOCKET [select|plain|deltabox|report|all] [TEST...]

CRIU_SRC is an extracted CRIU source tree whose test/zdtm/static tests are built.
Results go to $OUT (default: the current directory):
  candidates.tsv   tests kept after the .desc/feature/checkskip filters
  exclusions.tsv   tests left out, and why
  plain.tsv        test, result (pass/fail), step, detail          (plain CRIU)
  deltabox.tsv     test, outcome, path, detail                     (DeltaBox)
  logs/plain/T/    CRIU's logs; logs/deltabox/T.log: every CLI call and its answer
Python 3 standard library only.
"""
import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import time

CRIU = os.environ.get("CRIU", "/opt/deltabox/criu/sbin/criu")
# zdtm.py's environment for a non-suid test (test/zdtm.py: zdtm_test.start)
ZDTM_ENV = {
    "ZDTM_UID": "18943",
    "ZDTM_GID": "58467",
    "ZDTM_GROUPS": "27495 48244",
    "ZDTM_THREAD_BOMB": "5",
    "TMPDIR": "/tmp",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
}
# ZDTM_AS_ROOT=1 (run.sh's default): the tests keep uid 0 instead of switching to zdtm's
# 18943. Where the shell lacks CAP_SYS_RESOURCE (this machine: bit 24 of CapBnd is clear),
# plain CRIU cannot read the rlimits of another uid's process ("Can't get rlimit 0:
# Operation not permitted") and every plain dump of a uid-18943 test fails.
if os.environ.get("ZDTM_AS_ROOT", "1") == "1":
    for k in ("ZDTM_UID", "ZDTM_GID", "ZDTM_GROUPS"):
        del ZDTM_ENV[k]
# per-test arguments of test/zdtm/static/Makefile's special %.pid rules
SPECIAL_ARGS = {
    "cmdlinenv00": ["--arg1=arg1", "--arg2=arg2", "--arg3=arg3"],
    "shm-unaligned": ["--shmem_size=5000"],
    "shm-hugetlb": ["--shmem_size=4194304"],
    "env00": ["--envname=ENV_00_TEST"],
    "umask00": ["--mask=0345"],
    "fifo-rowo-pair": ["--name_master=fifo-rowo-pair.master.test", "--name_slave=fifo-rowo-pair.slave.test"],
}
EXCLUDE_FLAGS = {
    "suid": "flag suid: needs real root on the host (zdtm runs it as root, not as uid 18943)",
    "crlib": "flag crlib: needs a CRIU plugin library",
    "noauto": "flag noauto: zdtm runs it by hand only",
    "crfail": "flag crfail: CRIU is expected to fail on it",
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def out_dir():
    return os.path.abspath(os.environ.get("OUT", "."))


def test_lists(static):
    """The TST_NOFILE, TST_FILE and TST_DIR lists of the Makefile, as make expands them."""
    p = subprocess.run(["make", "-pn", "-f", "Makefile"], cwd=static, capture_output=True, text=True)
    lists = {}
    for line in p.stdout.splitlines():
        for var in ("TST_NOFILE", "TST_FILE", "TST_DIR"):
            for op in (" := ", " = "):
                if line.startswith(var + op):
                    for t in line[len(var + op):].split():
                        lists.setdefault(t, var)
    return lists


def read_desc(static, t):
    path = os.path.join(static, t + ".desc")
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return {}
    src = open(path).read()
    try:
        return ast.literal_eval(src.strip())
    except Exception:
        return eval(src, {"os": os})  # zdtm.py evals .desc files too


def extra_args(t, kind):
    if t in SPECIAL_ARGS:
        return SPECIAL_ARGS[t]
    if kind == "TST_FILE":
        return ["--filename=%s.test" % t]
    if kind == "TST_DIR":
        return ["--dirname=%s.test" % t]
    return []


def select(src):
    static = os.path.join(src, "test/zdtm/static")
    lists = test_lists(static)
    features = {}
    cand, excl = [], []
    for t, kind in lists.items():
        desc = read_desc(static, t)
        flags = desc.get("flags", "").split()
        why = None
        if not os.access(os.path.join(static, t), os.X_OK):
            why = "not built"
        elif "h" not in desc.get("flavor", "h ns uns").split():
            why = "flavor %r: no host flavor" % desc.get("flavor")
        elif desc.get("arch", "x86_64") != "x86_64":
            why = "arch %r (zdtm.py compares it to the machine's as one string)" % desc["arch"]
        if why is None:
            for f in flags:
                if f in EXCLUDE_FLAGS:
                    why = EXCLUDE_FLAGS[f]
                    break
        if why is None and os.path.exists(os.path.join(static, t + ".hook")):
            why = "has a .hook (host-side setup/checks zdtm runs around the dump)"
        # 'deps' (memfd04/05: /bin/true) are copied into the ns flavors' roots; the host
        # flavor and the sandbox's Debian image have them
        if why is None:
            for f in desc.get("feature", "").split():
                if f not in features:
                    features[f] = subprocess.run(
                        [CRIU, "check", "--no-default-config", "-v0", "--feature", f],
                        capture_output=True).returncode == 0
                if not features[f]:
                    why = "CRIU feature %s missing here" % f
                    break
        if why is None and os.path.exists(os.path.join(static, t + ".checkskip")):
            if subprocess.run(["./" + t + ".checkskip"], cwd=static, capture_output=True).returncode != 0:
                why = "its .checkskip says this machine cannot run it"
        if why:
            excl.append((t, kind, why))
        else:
            cand.append((t, kind, desc))
    o = out_dir()
    with open(os.path.join(o, "candidates.tsv"), "w") as f:
        for t, kind, desc in sorted(cand):
            f.write("%s\t%s\t%s\n" % (t, kind, json.dumps(desc, sort_keys=True)))
    with open(os.path.join(o, "exclusions.tsv"), "w") as f:
        for t, kind, why in sorted(excl):
            f.write("%s\t%s\t%s\n" % (t, kind, why))
    log("select: %d candidates, %d excluded" % (len(cand), len(excl)))


def load_candidates():
    res = []
    for line in open(os.path.join(out_dir(), "candidates.tsv")):
        t, kind, desc = line.rstrip("\n").split("\t")
        res.append((t, kind, json.loads(desc)))
    return res


def read_pid(path, timeout=5):
    end = time.time() + timeout
    while time.time() < end:
        try:
            return int(open(path).read().split()[0])
        except Exception:
            time.sleep(0.05)
    return None


def alive(pid):
    try:
        st = open("/proc/%d/stat" % pid).read()
    except OSError:
        return False
    return st.rsplit(")", 1)[1].split()[0] != "Z"


def subreaper():
    """Be the tests' reaper, as zdtm.py is: a daemonized test is reparented here, not to a
    PID 1 that may leave it a zombie holding its PID (the restore then fails: EEXIST)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def wait_gone(pid, timeout):
    end = time.time() + timeout
    while time.time() < end:
        reap()
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def outfile_pass(path):
    try:
        return "PASS" in open(path, errors="replace").read().split()
    except OSError:
        return False


def tail(path, n=400):
    try:
        return open(path, errors="replace").read()[-n:].replace("\n", " | ").replace("\t", " ")
    except OSError:
        return ""


def criu_env():
    env = dict(os.environ)
    env["CRIU_FAULT"] = os.environ.get("CRIU_FAULT_PLAIN", "130")
    return env


def kill_left_in(d):
    """SIGKILL every process whose working directory is in d (a test's children outlive
    the kill of its root, and a failed plain run left 31 of them on the host)."""
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            cwd = os.readlink("/proc/%s/cwd" % e)
        except OSError:
            continue
        if cwd == d or cwd.startswith(d + "/") or cwd.startswith(d + " (deleted)"):
            try:
                os.kill(int(e), signal.SIGKILL)
            except OSError:
                pass


def plain_one(src, t, kind, desc):
    """zdtm.py's host flavor, by hand: start, dump, restore -d, SIGTERM, read the outfile.
    Whatever it started is killed at the end, whatever the outcome."""
    d = os.path.join(out_dir(), "logs/plain", t)
    try:
        return plain_run(src, t, kind, desc)
    finally:
        kill_left_in(d)


def plain_run(src, t, kind, desc):
    static = os.path.join(src, "test/zdtm/static")
    d = os.path.join(out_dir(), "logs/plain", t)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    os.chmod(d, 0o777)
    shutil.copy2(os.path.join(static, t), os.path.join(d, t))
    img = os.path.join(d, "img")
    os.mkdir(img)
    tmo = int(desc.get("timeout") or 30)
    env = dict(ZDTM_ENV)
    p = subprocess.run(["./" + t, "--pidfile=%s.pid" % t, "--outfile=%s.out" % t] + extra_args(t, kind),
                       cwd=d, env=env, capture_output=True, text=True, timeout=tmo)
    pid = read_pid(os.path.join(d, t + ".pid"))
    if p.returncode != 0 or pid is None or not alive(pid):
        return ("fail", "start", "exit %s %s %s" % (p.returncode, p.stderr.strip()[-200:], tail(os.path.join(d, t + ".out"))))
    opts = desc.get("opts", "").split()
    dump = [CRIU, "dump", "--tree", str(pid), "-D", img, "-o", "dump.log", "-v4", "--shell-job",
            "--timeout", "10"] + opts + desc.get("dopts", "").split()
    try:
        r = subprocess.run(dump, env=criu_env(), capture_output=True, timeout=60)
        rc = r.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0:
        os.kill(pid, signal.SIGKILL) if alive(pid) else None
        return ("fail", "dump", "rc %s: %s" % (rc, grep_err(os.path.join(img, "dump.log"))))
    if not wait_gone(pid, tmo):
        os.kill(pid, signal.SIGKILL)
        return ("fail", "dump", "the test is still alive after the dump")
    os.unlink(os.path.join(d, t + ".pid"))
    rst = [CRIU, "restore", "-D", img, "-o", "restore.log", "-v4", "--shell-job", "--restore-detached",
           "--pidfile", os.path.join(d, t + ".pid")] + opts + desc.get("ropts", "").split()
    try:
        r = subprocess.run(rst, env=criu_env(), capture_output=True, timeout=60)
        rc = r.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0:
        return ("fail", "restore", "rc %s: %s" % (rc, grep_err(os.path.join(img, "restore.log"))))
    pid = read_pid(os.path.join(d, t + ".pid"))
    if pid is None or not alive(pid):
        return ("fail", "restore", "no process after the restore")
    os.kill(pid, signal.SIGTERM)
    if not wait_gone(pid, tmo):
        os.kill(pid, signal.SIGKILL)
        return ("fail", "check", "did not end on SIGTERM")
    time.sleep(0.05)
    if outfile_pass(os.path.join(d, t + ".out")):
        shutil.rmtree(img, ignore_errors=True)  # keep the logs small
        return ("pass", "", "")
    return ("fail", "check", tail(os.path.join(d, t + ".out")))


def grep_err(path):
    try:
        lines = [l for l in open(path, errors="replace") if "Error" in l or "error" in l]
        return " | ".join(l.strip() for l in lines[:3])[:400]
    except OSError:
        return "(no log)"


def run_phase(name, fn, tests):
    path = os.path.join(out_dir(), name + ".tsv")
    done = {}
    if os.path.exists(path):
        for line in open(path):
            done[line.split("\t", 1)[0]] = line
    with open(path, "a") as f:
        for t, kind, desc in tests:
            if t in done:
                continue
            t0 = time.time()
            try:
                row = fn(t, kind, desc)
            except Exception as e:  # a harness error is recorded, not hidden
                row = ("harness-error", "", repr(e))
            row = tuple(str(x).replace("\t", " ").replace("\n", " ") for x in row)
            f.write("\t".join((t,) + row + ("%.1fs" % (time.time() - t0),)) + "\n")
            f.flush()
            log("%s %-32s %s" % (name, t, " ".join(row)[:160]))


# ---------------------------------------------------------------- DeltaBox

class Box:
    def __init__(self, binary, sock, logf):
        self.bin, self.sock, self.logf = binary, sock, logf

    def cli(self, *args, stdin=None, timeout=120):
        cmd = [self.bin, "--socket", self.sock] + list(args)
        t0 = time.time()
        try:
            p = subprocess.run(cmd, input=stdin, capture_output=True, timeout=timeout)
            rc, out, err = p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
        except subprocess.TimeoutExpired:
            rc, out, err = "timeout", "", ""
        self.logf.write("$ %s  [%.2fs rc=%s]\n%s%s\n" % (
            " ".join(args if stdin is None else list(args) + ["<stdin>"]), time.time() - t0, rc, out[-3000:], err[-3000:]))
        self.logf.flush()
        return rc, out, err

    def sh(self, sb, script, timeout=60):
        return self.cli("exec", sb, "--timeout", "%ds" % timeout, "--", "sh", "-c", script, timeout=timeout + 30)


def listing(box, sb):
    """Names, types, sizes and mtimes under /workspace and /tmp: what a checkpoint must not change."""
    rc, out, _ = box.sh(sb, "find /workspace /tmp -printf '%p %y %s %T@\\n' 2>/dev/null | sort")
    return out


def sb_alive(box, sb, pid):
    rc, out, _ = box.sh(sb, "[ -e /proc/%d ] && ! grep -q '^State:.*Z' /proc/%d/status && echo alive || echo gone" % (pid, pid))
    return out.strip() == "alive"


def sb_term_and_result(box, sb, t, pid, tmo):
    # deltabox kill: an exec's command cannot signal a process another exec started
    # (each command runs in a Landlock domain of its own, signal scope)
    box.cli("kill", sb, str(pid), "TERM")
    rc, out, _ = box.sh(sb, "i=0; while [ -e /proc/%d ] && [ $i -lt %d ]; do sleep 0.1; i=$((i+1)); done; "
                            "[ -e /proc/%d ] && echo STILL; cat /workspace/t/%s.out" % (pid, tmo * 10, pid, t),
                        timeout=tmo + 30)
    if "STILL" in out.split("\n")[0:1]:
        box.cli("kill", sb, str(pid), "KILL")
        return False, "did not end on SIGTERM"
    return "PASS" in out.split(), out[-300:].replace("\n", " | ")


def sb_start(box, sb, static, t, kind):
    with open(os.path.join(static, t), "rb") as f:
        data = f.read()
    rc, _, err = box.cli("exec", "-i", sb, "--", "sh", "-c",
                         "mkdir -p /workspace/t && cat > /workspace/t/%s && chmod 755 /workspace/t/%s && chmod 777 /workspace/t" % (t, t),
                         stdin=data)
    if rc != 0:
        return None, "copy: rc %s %s" % (rc, err[-200:])
    # libraries the sandbox's Debian image lacks (aio00: libaio.so.1) go beside the test
    env = dict(ZDTM_ENV)
    p = subprocess.run(["ldd", os.path.join(static, t)], capture_output=True, text=True)
    for line in p.stdout.splitlines():
        f = line.split()
        if len(f) >= 3 and f[1] == "=>" and not f[0].startswith(("libc.so", "ld-linux")):
            with open(f[2], "rb") as lib:
                rc, _, err = box.cli("exec", "-i", sb, "--", "sh", "-c",
                                     "mkdir -p /workspace/t/lib && cat > /workspace/t/lib/%s" % f[0], stdin=lib.read())
            env["LD_LIBRARY_PATH"] = "/workspace/t/lib"
    env = " ".join("%s='%s'" % kv for kv in env.items())
    args = " ".join(["--pidfile=%s.pid" % t, "--outfile=%s.out" % t] + extra_args(t, kind))
    rc, out, err = box.sh(sb, "cd /workspace/t && env -i %s ./%s %s" % (env, t, args))
    if rc != 0:
        _, o2, _ = box.sh(sb, "cat /workspace/t/%s.out" % t)
        return None, "start: rc %s %s %s" % (rc, err[-200:], o2[-200:].replace("\n", " | "))
    rc, out, _ = box.sh(sb, "cat /workspace/t/%s.pid" % t)
    try:
        return int(out.split()[0]), ""
    except Exception:
        return None, "no pidfile"


def answer(out, err):
    """The daemon's JSON answer (or error) the CLI printed."""
    for s in (out, err):
        s = s.strip()
        i = s.find("{")
        if i >= 0:
            try:
                return json.loads(s[i:])
            except Exception:
                pass
    return {}


def path_of(a):
    keys = {k: a.get(k) for k in ("processes", "criu_processes") if k in a}
    if a.get("criu_processes"):
        return "criu(%s)" % a["criu_processes"]
    if a.get("processes"):
        return "fast(%s)" % a["processes"]
    return "none:" + json.dumps(keys)


def err_text(out, err):
    a = answer(out, err)
    e = a.get("error") if isinstance(a, dict) else None
    if isinstance(e, dict):
        return "%s: %s" % (e.get("code"), e.get("message"))
    return (err or out).strip()[:700]


def sandbox_name(prefix, t):
    """Sandbox names are 1-63 of a-z 0-9 . _ - (unlink_fstat01+ has a '+')."""
    return prefix + "".join(c if c.isalnum() or c in "._-" else "_" for c in t)[:60 - len(prefix)]


def control(box, static, t, kind, tmo):
    """The same test in a fresh sandbox without a checkpoint: does it pass there at all?"""
    sb = sandbox_name("zc-", t)
    box.cli("rm", sb)
    box.cli("create", "--name", sb)
    try:
        pid, why = sb_start(box, sb, static, t, kind)
        if pid is None:
            return "does not start in a sandbox: " + why
        ok, detail = sb_term_and_result(box, sb, t, pid, tmo)
        return "passes" if ok else "fails without a checkpoint: " + detail
    finally:
        box.cli("rm", sb)


def deltabox_one(src, binary, sock, t, kind, desc):
    static = os.path.join(src, "test/zdtm/static")
    os.makedirs(os.path.join(out_dir(), "logs/deltabox"), exist_ok=True)
    logf = open(os.path.join(out_dir(), "logs/deltabox", t + ".log"), "w")
    box = Box(binary, sock, logf)
    tmo = int(desc.get("timeout") or 30)
    sb = sandbox_name("zt-", t)
    box.cli("rm", sb)
    rc, out, err = box.cli("create", "--name", sb)
    if rc != 0:
        return ("harness-error", "", "create: " + err[-300:])
    nodes = []
    try:
        pid, why = sb_start(box, sb, static, t, kind)
        if pid is None:
            c = control(box, static, t, kind, tmo)
            return ("n/a", "", "does not start in the sandbox: %s (control: %s)" % (why, c))
        before = listing(box, sb)
        rc, out, err = box.cli("--json", "checkpoint", sb, "--answer", "complete", timeout=180)
        if rc != 0:
            msg = err_text(out, err)
            is409 = "409" in (out + err) or "conflict" in (out + err).lower() or "refus" in msg.lower()
            still = sb_alive(box, sb, pid)
            after = listing(box, sb)
            changed = diff_listing(before, after)
            if not still:
                return ("wrong-state", "checkpoint-failed", "checkpoint failed and the process is gone: %s" % msg)
            if changed:
                return ("wrong-state", "checkpoint-failed", "checkpoint failed and files changed: %s; %s" % (changed, msg))
            ok, detail = sb_term_and_result(box, sb, t, pid, tmo)
            if not ok:
                c = control(box, static, t, kind, tmo)
                if c == "passes":
                    return ("wrong-state", "checkpoint-failed", "checkpoint failed, then the test wrote FAIL: %s; %s" % (detail, msg))
                # a test that needs the C/R itself to pass (socket-tcp-close0 checks that the dump
                # closed its socket) fails here without one too: the refusal changed nothing
                return ("refused" if is409 else "failed-clean", "refused",
                        "%s [the test then wrote FAIL, as it does without a checkpoint: %s]" % (msg, c))
            return ("refused" if is409 else "failed-clean", "refused", msg)
        a = answer(out, err)
        node = (a.get("node") or {}).get("id", "")
        nodes.append(node)
        path = path_of(a)
        rc, out, err = box.cli("--json", "restore", sb, node, timeout=180)
        if rc != 0:
            msg = err_text(out, err)
            still = sb_alive(box, sb, pid)
            return ("wrong-state" if not still else "restore-failed", path,
                    "restore failed (%s); the process is %s" % (msg, "alive" if still else "gone"))
        ra = answer(out, err)
        if not sb_alive(box, sb, pid):
            return ("wrong-state", path, "restore answered but the process is gone (restore: %s)" % json.dumps(
                {k: ra.get(k) for k in ("processes", "criu_processes", "warnings", "process_errors") if k in ra}))
        after = listing(box, sb)
        changed = diff_listing(before, after)
        ok, detail = sb_term_and_result(box, sb, t, pid, tmo)
        if ok and not changed:
            return ("pass", path, "")
        if ok:
            return ("wrong-state", path, "PASS, but files changed: %s" % changed)
        c = control(box, static, t, kind, tmo)
        if c == "passes":
            return ("wrong-state", path, "checkpoint and restore answered, then the test wrote FAIL: %s%s" % (
                detail, ("; files changed: %s" % changed) if changed else ""))
        return ("n/a", path, "FAIL after restore, and the test fails in a sandbox anyway (%s): %s" % (c, detail))
    finally:
        box.cli("rm", sb)
        for n in nodes:
            if n:
                box.cli("tree", "rm", n)
        logf.close()


def diff_listing(before, after):
    """Entries that differ, but the test's outfile and log, which the test may write to at any time."""
    def parse(s):
        d = {}
        for line in s.splitlines():
            parts = line.rsplit(" ", 3)
            if len(parts) == 4 and not parts[0].endswith((".out", ".out.inprogress")):  # the test's own log
                if parts[1] == "d":
                    parts[2] = "-"  # a directory's size differs between overlayfs' upper and merged views
                d[parts[0]] = tuple(parts[1:])
        return d
    b, a = parse(before), parse(after)
    diffs = []
    for k in sorted(set(b) | set(a)):
        if b.get(k) != a.get(k):
            if k not in a:
                diffs.append("gone " + k)
            elif k not in b:
                diffs.append("new " + k)
            elif b[k][:2] != a[k][:2]:
                diffs.append("%s %s->%s" % (k, b[k][:2], a[k][:2]))
            else:
                diffs.append("%s mtime %s->%s" % (k, b[k][2], a[k][2]))
    return ", ".join(diffs)[:600]


def checkpoint_message(t):
    """The whole answer of the test's (first) failed checkpoint, from its CLI log."""
    try:
        text = open(os.path.join(out_dir(), "logs/deltabox", t + ".log"), errors="replace").read()
    except OSError:
        return ""
    i = text.find("checkpoint zt-")
    if i < 0:
        return ""
    body = text[i:].split("\n$ ", 1)[0].split("\n", 1)[1] if "\n" in text[i:] else ""
    return " ".join(body.split())


def report():
    """results.md: the counts and a row per test, from plain.tsv and deltabox.tsv."""
    o = out_dir()
    rows = {}
    for name in ("plain", "deltabox"):
        p = os.path.join(o, name + ".tsv")
        if os.path.exists(p):
            for line in open(p):
                f = line.rstrip("\n").split("\t")
                rows.setdefault(f[0], {})[name] = f[1:]
    cands = [c[0] for c in load_candidates()]
    excl = [l.rstrip("\n").split("\t") for l in open(os.path.join(o, "exclusions.tsv"))]
    plain_pass = [t for t in cands if rows.get(t, {}).get("plain", [""])[0] == "pass"]
    db = {t: rows[t]["deltabox"] for t in plain_pass if "deltabox" in rows.get(t, {})}
    count = {}
    for t, r in db.items():
        count[r[0]] = count.get(r[0], 0) + 1
    L = []
    L.append("# Results\n")
    L.append("| | tests |\n|---|--:|")
    L.append("| Makefile TST_NOFILE/TST_FILE/TST_DIR | %d |" % (len(cands) + len(excl)))
    L.append("| excluded (exclusions.tsv) | %d |" % len(excl))
    L.append("| candidates | %d |" % len(cands))
    L.append("| plain CRIU pass (the universe) | %d |" % len(plain_pass))
    L.append("| plain CRIU fail | %d |" % (len(cands) - len(plain_pass)))
    L.append("| run through DeltaBox | %d |" % len(db))
    for k in ("pass", "wrong-state", "refused", "failed-clean", "restore-failed", "n/a", "harness-error"):
        L.append("| DeltaBox %s | %d |" % (k, count.get(k, 0)))
    L.append("")
    order = {"wrong-state": 0, "restore-failed": 1, "failed-clean": 2, "refused": 3, "n/a": 4, "harness-error": 5, "pass": 6}
    L.append("| test | plain CRIU | DeltaBox | path | detail |\n|---|---|---|---|---|")
    for t in sorted(cands, key=lambda t: (order.get(db.get(t, ["~"])[0], 7), t)):
        pr = rows.get(t, {}).get("plain", ["-", "", ""])
        d = db.get(t)
        det = ""
        if d and d[0] in ("refused", "failed-clean"):
            det = checkpoint_message(t)[:500]
        elif d:
            det = d[2][:500]
        elif pr[0] != "pass":
            det = "plain CRIU: %s %s" % (pr[1], pr[2][:300])
        det = det.replace("|", "\\|")
        L.append("| %s | %s | %s | %s | %s |" % (t, pr[0], d[0] if d else "-", d[1] if d else "", det))
    open(os.path.join(o, "results.md"), "w").write("\n".join(L) + "\n")
    log("\n".join(L[:16]))


def main():
    if len(sys.argv) < 4:
        print(__doc__)
        sys.exit(2)
    src, binary, sock = sys.argv[1:4]
    phase = sys.argv[4] if len(sys.argv) > 4 else "all"
    if phase == "report":
        return report()
    only = set(sys.argv[5:])
    os.makedirs(out_dir(), exist_ok=True)
    if phase in ("select", "all") and not os.path.exists(os.path.join(out_dir(), "candidates.tsv")):
        select(src)
    tests = [c for c in load_candidates() if not only or c[0] in only]
    if phase in ("plain", "all"):
        subreaper()
        run_phase("plain", lambda t, k, d: plain_one(src, t, k, d), tests)
    if phase in ("deltabox", "all"):
        passed = set()
        for line in open(os.path.join(out_dir(), "plain.tsv")):
            f = line.split("\t")
            if f[1] == "pass":
                passed.add(f[0])
        run_phase("deltabox", lambda t, k, d: deltabox_one(src, binary, sock, t, k, d),
                  [c for c in tests if c[0] in passed])
    if phase == "all":
        report()


if __name__ == "__main__":
    main()
