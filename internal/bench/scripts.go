package bench

// The workload is three small Python programs, run unchanged inside the sandbox (by
// exec) and on the host (for the copy baselines), so that both sides hold the same
// files: same seed, same bytes (checked with checksumPy). Python's random.Random is
// deterministic for a given seed and version (the image and the host both have 3.11
// here; the checksums are compared and a mismatch is reported, not hidden).

// genPy ROOT SEED MB SMALL LARGE writes a workspace of MB MiB: up to SMALL small text
// files (64 B to 4 KiB, at most half of the bytes) in 1000 nested directories, and
// LARGE large files of random bytes holding the rest. It writes .bench/meta.json (what
// changePy needs) and .bench/marker, and prints the meta as JSON.
const genPy = `
import json, os, random, sys
root, seed, mb, nsmall, nlarge = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rng = random.Random(seed)
total = mb << 20
def small_path(i):
    return "src/d%02d/s%02d/f%05d.txt" % (i % 40, (i // 40) % 25, i)
made = set()
def mkdirs(p):
    d = os.path.dirname(p)
    if d not in made:
        os.makedirs(d, exist_ok=True)
        made.add(d)
def text(size):
    return rng.randbytes((size + 1) // 2).hex()[:size].encode()
small = n = 0
for i in range(nsmall):
    size = rng.randrange(64, 4096)
    if small + size > total // 2:
        break
    p = os.path.join(root, small_path(i))
    mkdirs(p)
    with open(p, "wb") as f:
        f.write(text(size))
    small += size
    n += 1
rest = max(0, total - small)
large = []
nlarge = max(1, nlarge)
per = rest // nlarge
for k in range(nlarge):
    size = per if k < nlarge - 1 else rest - per * (nlarge - 1)
    rel = "data/blob%d.bin" % k
    p = os.path.join(root, rel)
    mkdirs(p)
    left = size
    with open(p, "wb") as f:
        while left > 0:
            c = min(left, 8 << 20)
            f.write(rng.randbytes(c))
            left -= c
    large.append([rel, size])
meta = {"seed": seed, "small": n, "small_bytes": small, "large": large, "bytes": small + rest}
os.makedirs(os.path.join(root, ".bench"), exist_ok=True)
with open(os.path.join(root, ".bench", "meta.json"), "w") as f:
    json.dump(meta, f)
with open(os.path.join(root, ".bench", "marker"), "w") as f:
    f.write("base")
print(json.dumps(meta))
`

// changePy ROOT SEED ROUND N LARGE_EVERY LABEL changes N files of the workspace, as an
// agent's step would: 90% rewrite or append to existing small files, 5% delete (or
// recreate, if already deleted on this branch), 5% new files in new/rROUND/; every
// LARGE_EVERY rounds also 64 KiB overwritten inside one large file (a reflinked
// copy-up). It writes LABEL to .bench/marker (so a restore can be checked) and prints
// counts as JSON. ROUND must be unique within a run.
const changePy = `
import json, os, random, sys
root, seed, rnd, nchg, large_every, label = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
with open(os.path.join(root, ".bench", "meta.json")) as f:
    meta = json.load(f)
rng = random.Random(seed * 1000003 + rnd)
def small_path(i):
    return "src/d%02d/s%02d/f%05d.txt" % (i % 40, (i // 40) % 25, i)
def text(size):
    return rng.randbytes((size + 1) // 2).hex()[:size].encode()
n = meta["small"]
ncreate = max(1, nchg // 20)
ndelete = max(1, nchg // 20)
nmod = max(0, nchg - ncreate - ndelete)
picks = rng.sample(range(n), min(n, nmod + ndelete))
st = {"modified": 0, "appended": 0, "created": 0, "deleted": 0, "large": 0}
def write(p, mode, data):
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, mode) as f:
        f.write(data)
for i in picks[:nmod]:
    p = os.path.join(root, small_path(i))
    if os.path.exists(p) and rng.random() < 0.3:
        write(p, "ab", text(rng.randrange(16, 256)))
        st["appended"] += 1
    else:
        write(p, "wb", text(rng.randrange(64, 4096)))
        st["modified"] += 1
for i in picks[nmod:]:
    p = os.path.join(root, small_path(i))
    if os.path.exists(p):
        os.remove(p)
        st["deleted"] += 1
    else:
        write(p, "wb", text(rng.randrange(64, 4096)))
        st["created"] += 1
for k in range(ncreate):
    write(os.path.join(root, "new", "r%05d" % rnd, "f%d.txt" % k), "wb", text(rng.randrange(64, 4096)))
    st["created"] += 1
if large_every > 0 and rnd % large_every == 0 and meta["large"]:
    rel, size = meta["large"][rng.randrange(len(meta["large"]))]
    with open(os.path.join(root, rel), "r+b") as f:
        f.seek(rng.randrange(0, max(1, size - 65536)))
        f.write(rng.randbytes(65536))
    st["large"] = 1
with open(os.path.join(root, ".bench", "marker"), "w") as f:
    f.write(label)
st["files"] = st["modified"] + st["appended"] + st["created"] + st["deleted"] + st["large"]
print(json.dumps(st))
`

// checksumPy ROOT prints {"sha256","files","bytes"}: a digest of every file's relative
// path, size and content, in a fixed order.
const checksumPy = `
import hashlib, json, os, sys
root = sys.argv[1]
h = hashlib.sha256()
files = total = 0
for dp, dns, fns in os.walk(root):
    dns.sort()
    for fn in sorted(fns):
        p = os.path.join(dp, fn)
        fh = hashlib.sha256()
        with open(p, "rb") as f:
            while True:
                c = f.read(1 << 20)
                if not c:
                    break
                fh.update(c)
        size = os.path.getsize(p)
        h.update(("%s\0%d\0%s\n" % (os.path.relpath(p, root), size, fh.hexdigest())).encode())
        files += 1
        total += size
print(json.dumps({"sha256": h.hexdigest(), "files": files, "bytes": total}))
`
