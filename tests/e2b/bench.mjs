// The latency E2B's SDK sees for create, a trivial command, pause, resume (connect) and
// fork against a DeltaBox daemon; `deltabox bench api` runs it beside the native API.
// Prints one JSON object: {"op": [milliseconds, ...], ...}.
import { Sandbox } from 'e2b'

const n = Number(process.env.BENCH_SAMPLES || 10)
const out = { create: [], command: [], pause: [], resume: [], fork: [], kill: [] }
const time = async (op, fn) => {
  const t0 = performance.now()
  const r = await fn()
  out[op].push(performance.now() - t0)
  return r
}
await (await Sandbox.create()).kill() // warm the connection pool
for (let i = 0; i < n; i++) {
  const sbx = await time('create', () => Sandbox.create())
  await time('command', () => sbx.commands.run('true'))
  await time('pause', () => sbx.pause())
  await time('resume', () => Sandbox.connect(sbx.sandboxId))
  const [f] = await time('fork', () => sbx.fork())
  if (f instanceof Error) throw f
  await f.kill()
  await time('kill', () => sbx.kill())
}
console.log(JSON.stringify(out))
