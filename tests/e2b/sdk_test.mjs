// Drives a DeltaBox daemon through E2B's official SDK (the pinned `e2b` package), using
// only its public API, configured only by E2B's own environment variables
// (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY): the same script runs against E2B's
// cloud. tests/e2e/e2b_test.go runs it; each check prints "ok NAME" or throws.
// getHost's names (PORT-SANDBOXID.E2B_DOMAIN) need a wildcard DNS name for the daemon;
// against a daemon named by E2B_SANDBOX_URL, they are resolved to that daemon's address
// here instead, the one thing this script does that a user's would not.
import { Sandbox, CommandExitError, TimeoutError } from 'e2b'
import assert from 'node:assert/strict'
import http from 'node:http'
import https from 'node:https'

const step = async (name, fn) => {
  const t0 = performance.now()
  await fn()
  console.log(`ok ${name} ${(performance.now() - t0).toFixed(1)}ms`)
}

const sbx = await Sandbox.create()
console.log(`sandbox ${sbx.sandboxId}`)
try {
  await step('run', async () => {
    const r = await sbx.commands.run('echo hello; echo oops >&2; whoami; pwd')
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'hello\nuser\n/home/user\n')
    assert.equal(r.stderr, 'oops\n')
  })

  await step('streamed output', async () => {
    const seen = []
    const r = await sbx.commands.run('for i in 1 2 3; do echo line$i; sleep 0.2; done', {
      onStdout: (d) => seen.push([performance.now(), d]),
    })
    assert.equal(r.stdout, 'line1\nline2\nline3\n')
    assert.ok(seen.length >= 2, `want the lines as they come, got ${seen.length} chunks`)
    assert.ok(seen.at(-1)[0] - seen[0][0] > 250, 'the first line came with the last: not streamed')
  })

  await step('exit code', async () => {
    await assert.rejects(sbx.commands.run('echo bad >&2; exit 3'), (e) => {
      assert.ok(e instanceof CommandExitError, `want CommandExitError, got ${e}`)
      assert.equal(e.exitCode, 3)
      assert.equal(e.stderr, 'bad\n')
      return true
    })
  })

  await step('timeout', async () => {
    const t0 = performance.now()
    await assert.rejects(sbx.commands.run('sleep 30', { timeoutMs: 1000 }), (e) => {
      assert.ok(e instanceof TimeoutError, `want TimeoutError, got ${e}`)
      return true
    })
    assert.ok(performance.now() - t0 < 10000)
  })

  await step('background command', async () => {
    const h = await sbx.commands.run('echo started; sleep 60', { background: true, timeoutMs: 0 })
    const list = await sbx.commands.list()
    assert.ok(list.some((p) => p.pid === h.pid), `pid ${h.pid} not listed: ${JSON.stringify(list)}`)
    assert.equal(await h.kill(), true)
    await assert.rejects(h.wait(), CommandExitError)
    const after = await sbx.commands.list()
    assert.ok(!after.some((p) => p.pid === h.pid), 'killed command still listed')
  })

  await step('stdin', async () => {
    const h = await sbx.commands.run('read a; read b; echo "got $a $b"', { background: true, stdin: true })
    await sbx.commands.sendStdin(h.pid, 'one\n')
    await sbx.commands.sendStdin(h.pid, 'two\n')
    const r = await h.wait()
    assert.equal(r.stdout, 'got one two\n')
    const c = await sbx.commands.run('cat', { background: true, stdin: true })
    await sbx.commands.sendStdin(c.pid, 'to eof')
    await sbx.commands.closeStdin(c.pid)
    assert.equal((await c.wait()).stdout, 'to eof')
  })

  await step('connect to a running command', async () => {
    const h = await sbx.commands.run('sleep 0.5; echo late', { background: true })
    const c = await sbx.commands.connect(h.pid)
    assert.equal((await c.wait()).stdout, 'late\n')
  })

  await step('getHost', async () => {
    // A server started in the sandbox, reached at the address getHost gives, with the
    // sandbox's traffic token (E2B's header for sandboxes whose traffic is not public).
    await sbx.files.write('site/index.html', 'served from the sandbox')
    const srv = await sbx.commands.run('cd site && exec python3 -m http.server 8000', { background: true, timeoutMs: 0 })
    const host = sbx.getHost(8000)
    assert.equal(host, `8000-${sbx.sandboxId}.${process.env.E2B_DOMAIN || 'e2b.app'}`)
    const daemon = process.env.E2B_SANDBOX_URL ? new URL(process.env.E2B_SANDBOX_URL) : null
    const lookup = daemon && ((name, opts, cb) => (opts && opts.all ? cb(null, [{ address: daemon.hostname, family: 4 }]) : cb(null, daemon.hostname, 4)))
    const mod = daemon && daemon.protocol === 'http:' ? http : https
    const agent = new mod.Agent({ keepAlive: true, maxSockets: 1 })
    const get = (path, headers) => new Promise((resolve, reject) => {
      const req = mod.get(`${mod === http ? 'http' : 'https'}://${host}${path}`, { agent, lookup, headers }, (res) => {
        let body = ''
        res.on('data', (d) => (body += d))
        res.on('end', () => resolve({ status: res.statusCode, body, reused: req.reusedSocket }))
      })
      req.on('error', reject)
    })
    const token = sbx.trafficAccessToken ? { 'e2b-traffic-access-token': sbx.trafficAccessToken } : {}
    let r
    for (let i = 0; i < 100; i++) { // the server's start
      r = await get('/index.html', token)
      if (r.status === 200) break
      await new Promise((ok) => setTimeout(ok, 100))
    }
    assert.equal(r.status, 200, `GET via getHost: ${r.status} ${r.body}`)
    assert.equal(r.body, 'served from the sandbox')
    r = await get('/index.html', token)
    assert.equal(r.body, 'served from the sandbox')
    assert.equal(r.reused, true, 'the second request did not reuse the kept-alive connection')
    if (sbx.trafficAccessToken) {
      assert.equal((await get('/index.html', {})).status, 403)
    }
    agent.destroy()
    await srv.kill()
  })

  await step('files write/read', async () => {
    const info = await sbx.files.write('notes/a.txt', 'hello file')
    assert.equal(info.path, '/home/user/notes/a.txt')
    assert.equal(await sbx.files.read('/home/user/notes/a.txt'), 'hello file')
    const bytes = new Uint8Array([0, 1, 2, 255])
    await sbx.files.write('/tmp/bin', bytes.buffer)
    assert.deepEqual(await sbx.files.read('/tmp/bin', { format: 'bytes' }), bytes)
    const r = await sbx.commands.run('stat -c %U notes/a.txt; cat notes/a.txt')
    assert.equal(r.stdout, 'user\nhello file')
  })

  await step('files list/exists/rename/remove', async () => {
    await sbx.files.makeDir('d/e')
    await sbx.files.write('d/x.txt', 'x')
    const names = (await sbx.files.list('d')).map((e) => `${e.name}:${e.type}`).sort()
    assert.deepEqual(names, ['e:dir', 'x.txt:file'])
    const moved = await sbx.files.rename('d/x.txt', 'd/e/y.txt')
    assert.equal(moved.path, '/home/user/d/e/y.txt')
    assert.equal(await sbx.files.exists('d/x.txt'), false)
    assert.equal(await sbx.files.read('d/e/y.txt'), 'x')
    const st = await sbx.files.getInfo('d/e/y.txt')
    assert.equal(st.size, 1)
    assert.equal(st.owner, 'user')
    await sbx.files.remove('d')
    assert.equal(await sbx.files.exists('d'), false)
    await assert.rejects(sbx.files.read('nope.txt'))
  })

  await step('watch a directory', async () => {
    await sbx.files.makeDir('w')
    const events = []
    const h = await sbx.files.watchDir('w', (e) => events.push(`${e.type}:${e.name}`))
    await sbx.files.write('w/new.txt', 'x')
    await sbx.commands.run('sleep 0.5; echo more >> w/new.txt; sleep 0.5; rm w/new.txt; sleep 0.5')
    await h.stop()
    assert.deepEqual(events, ['create:new.txt', 'write:new.txt', 'remove:new.txt'])
  })

  await step('info and list', async () => {
    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.equal(info.state, 'running')
    const page = await Sandbox.list().nextItems()
    assert.ok(page.some((s) => s.sandboxId === sbx.sandboxId))
    assert.equal(await sbx.isRunning(), true)
    await sbx.setTimeout(120_000)
  })

  if (process.env.E2B_TEST_PAUSE !== '0') {
    await step('pause and resume', async () => {
      await sbx.files.write('state.txt', 'before pause')
      await sbx.commands.run('nohup python3 -c "import time\nx=[41]\nwhile True:\n  x[0]+=0\n  open(\'/tmp/alive\',\'w\').write(str(x[0]+1))\n  time.sleep(0.1)" >/dev/null 2>&1 &')
      await sbx.commands.run('sleep 0.5; cat /tmp/alive')
      assert.equal(await sbx.pause(), true)
      assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
      const back = await Sandbox.connect(sbx.sandboxId)
      assert.equal(await back.files.read('state.txt'), 'before pause')
      const r = await back.commands.run('rm -f /tmp/alive; sleep 0.5; cat /tmp/alive; pgrep -x python3 >/dev/null && echo running')
      assert.equal(r.stdout, '42running\n')
    })

    await step('snapshot and create from it', async () => {
      await sbx.files.write('snap.txt', 'in the snapshot')
      const snap = await sbx.createSnapshot()
      const child = await Sandbox.create(snap.snapshotId)
      try {
        assert.equal(await child.files.read('snap.txt'), 'in the snapshot')
        assert.equal((await child.commands.run('whoami')).stdout, 'user\n')
      } finally {
        await child.kill()
      }
    })

    await step('fork', async () => {
      // A process left running (detached, as an agent's server would be) comes along.
      const bg = await sbx.commands.run(`nohup python3 -c 'import time; time.sleep(1000)' >/dev/null 2>&1 & echo $!`)
      const pid = bg.stdout.trim()
      const [f] = await sbx.fork()
      assert.ok(!(f instanceof Error), `fork failed: ${f}`)
      try {
        assert.equal(await f.files.read('snap.txt'), 'in the snapshot')
        assert.notEqual(f.sandboxId, sbx.sandboxId)
        const cmd = await f.commands.run(`tr '\\0' ' ' < /proc/${pid}/cmdline`)
        assert.match(cmd.stdout, /time\.sleep\(1000\)/, `pid ${pid} in the fork: ${cmd.stdout}`)
      } finally {
        await f.kill()
      }
    })
  }
} finally {
  await step('kill', async () => {
    await sbx.kill()
    await assert.rejects(sbx.commands.run('true'))
    const page = await Sandbox.list().nextItems()
    assert.ok(!page.some((s) => s.sandboxId === sbx.sandboxId))
  })
}
console.log('all ok')
