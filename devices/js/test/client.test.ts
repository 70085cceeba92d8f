/**
 * The device's client side without a server: the HTTP client (src/http.ts) against a fake `fetch` (bearer token,
 * retries of 5xx and network errors with back-off, `Retry-After`, 4xx not retried, bounded reads, patience), the
 * state dir (src/state.ts, src/nodejs/fs.ts: atomic files, private modes, the model file), enrolment and token
 * rotation (src/enrol.ts), and the MQTT message checks (src/mqtt.ts).
 */
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';

import { Tokens, enrol, EnrolRefused } from '../src/enrol.js';
import { Http, HttpError, Unreachable } from '../src/http.js';
import type { Task } from '../src/messages.js';
import { parseEnrolment, parseTask } from '../src/messages.js';
import { Bell } from '../src/mqtt.js';
import { StateStore } from '../src/state.js';
import { DirStorage } from '../src/nodejs/fs.js';

type Handler = (url: string, init: RequestInit) => Response | Promise<Response>;

function fakeFetch(handlers: Handler[]): { fetch: typeof fetch; calls: { url: string; init: RequestInit }[] } {
  const calls: { url: string; init: RequestInit }[] = [];
  const f = (async (url: string, init: RequestInit) => {
    calls.push({ url, init });
    const h = handlers[Math.min(calls.length - 1, handlers.length - 1)]!;
    return h(url, init);
  }) as unknown as typeof fetch;
  return { fetch: f, calls };
}

const json = (status: number, body: unknown, headers: Record<string, string> = {}): Response =>
  new Response(JSON.stringify(body), { status, headers: { 'content-type': 'application/json', ...headers } });

const fast = { backoffS: [0.01, 0.02] as [number, number] };

test('http: bearer token, retries on 5xx and network errors, then the answer', async () => {
  const f = fakeFetch([
    () => json(502, { detail: 'bad gateway' }),
    () => { throw new TypeError('fetch failed'); },
    () => json(200, { ok: 1 }),
  ]);
  const http = new Http('http://server:1/', { fetch: f.fetch, ...fast });
  http.token = 'tok';
  assert.deepEqual(await http.getJson('/v1/x'), { ok: 1 });
  assert.equal(f.calls.length, 3);
  assert.equal(f.calls[0]!.url, 'http://server:1/v1/x');
  assert.equal((f.calls[0]!.init.headers as Record<string, string>)['authorization'], 'Bearer tok');
});

test('http: 4xx is the answer (not retried), with the server\'s detail; 422 issues joined', async () => {
  const f = fakeFetch([() => json(401, { detail: 'unknown token' })]);
  const http = new Http('http://s', { fetch: f.fetch, ...fast });
  http.token = 't';
  await assert.rejects(http.getJson('/v1/rounds/current/task'), (e: unknown) => e instanceof HttpError && e.status === 401 && e.detail === 'unknown token');
  assert.equal(f.calls.length, 1);
  const g = fakeFetch([() => json(422, { detail: [{ loc: ['body', 'n_samples'], msg: 'too small', type: 'x' }] })]);
  const h2 = new Http('http://s', { fetch: g.fetch, ...fast });
  h2.token = 't';
  await assert.rejects(h2.postJson('/v1/rounds/1/updates', {}), (e: unknown) => e instanceof HttpError && e.detail === 'body.n_samples: too small');
});

test('http: Retry-After is waited (503, 429); without it a 429 is the answer', async () => {
  const f = fakeFetch([() => json(503, { detail: 'exporting' }, { 'retry-after': '0' }), () => json(200, { card: true })]);
  const http = new Http('http://s', { fetch: f.fetch, ...fast });
  http.token = 't';
  assert.deepEqual(await http.getJson('/v1/federations/f/model'), { card: true });
  const g = fakeFetch([() => json(429, { detail: 'quota' })]);
  const h2 = new Http('http://s', { fetch: g.fetch, ...fast });
  h2.token = 't';
  await assert.rejects(h2.call('PUT', '/v1/blobs/x', { body: new Uint8Array(3) }), (e: unknown) => e instanceof HttpError && e.status === 429);
  assert.equal((g.calls[0]!.init.headers as Record<string, string>)['content-type'], 'application/octet-stream');
});

test('http: answers over the bound are refused, by Content-Length or while streaming', async () => {
  const big = new Uint8Array(5000);
  const f = fakeFetch([() => new Response(big, { status: 200, headers: { 'content-length': '5000' } })]);
  const http = new Http('http://s', { fetch: f.fetch, ...fast });
  http.token = 't';
  await assert.rejects(http.call('GET', '/v1/blobs/x', { maxBytes: 4096 }), /bound of 4096/);
  const stream = new ReadableStream<Uint8Array>({
    start(c) {
      for (let i = 0; i < 10; i++) c.enqueue(new Uint8Array(1000));
      c.close();
    },
  });
  const g = fakeFetch([() => new Response(stream, { status: 200 })]);
  const h2 = new Http('http://s', { fetch: g.fetch, ...fast });
  h2.token = 't';
  await assert.rejects(h2.call('GET', '/v1/blobs/x', { maxBytes: 4096 }), /bound of 4096/);
  const ok = fakeFetch([() => new Response(new Uint8Array(4096), { status: 200 })]);
  const h3 = new Http('http://s', { fetch: ok.fetch, ...fast });
  h3.token = 't';
  assert.equal((await h3.call('GET', '/v1/blobs/x', { maxBytes: 4096 })).bytes.length, 4096);
});

test('http: an unreachable server is given up after the patience', async () => {
  const f = fakeFetch([() => { throw new TypeError('ECONNREFUSED'); }]);
  const http = new Http('http://s', { fetch: f.fetch, patienceS: 0.1, ...fast });
  http.token = 't';
  await assert.rejects(http.getJson('/healthz'), Unreachable);
  assert.ok(f.calls.length >= 3, String(f.calls.length));
});

const tmp = (): string => mkdtempSync(join(tmpdir(), 'pfl-js-'));

test('state dir: atomic writes, private files, the model file and the nonce kept', async () => {
  const dir = tmp();
  const store = new StateStore(new DirStorage(dir));
  let calls = 0;
  const rnd = (n: number): Uint8Array => { calls++; return new Uint8Array(n).fill(0xab); };
  const nonce = await store.nonce(rnd);
  assert.equal(nonce, 'ab'.repeat(16));
  assert.equal(await store.nonce(rnd), nonce);
  assert.equal(calls, 1, 'made once, read back after');
  assert.equal(statSync(join(dir, 'nonce.json')).mode & 0o777, 0o600);
  await store.saveToken({ token: 'x', expires: 10, issued: 2 });
  assert.equal(statSync(join(dir, 'token.json')).mode & 0o777, 0o600);
  await store.saveModel('model.bin', Uint8Array.of(1, 2, 3), { round: 4, metrics: [{ round: 3, accuracy: 0.5, loss: 1, n_test: 2 }] });
  const got = await store.loadModel('model.bin');
  assert.deepEqual([...got!.payload], [1, 2, 3]);
  assert.equal(got!.meta.round, 4);
  const p = await store.progress();
  assert.equal(p.round, 0);
  p.round = 2;
  await store.saveProgress(p);
  assert.equal((await store.progress()).round, 2);
  assert.deepEqual(readdirSync(dir).filter((f) => f.endsWith('.tmp')), [], 'no temp file left');
  await assert.rejects(new DirStorage(dir).write('../escape', new Uint8Array(1)), /outside/);
});

const ENROLMENT = {
  device_id: 'dev-1', token: 'tok-0', index: 2, federation: 'fed', config: { algorithm: 'fedper', seed: 5 }, density: 0.5, kp: 2,
  broker_url: 'mqtt://127.0.0.1:1883', mqtt_username: 'dev-1', mqtt_password: 'pw', round: 0, init_digest: 'a'.repeat(64),
  init_model: 'b'.repeat(64),
};

test('enrolment: the nonce is on disk before the request; the answer is kept; then the token rotates', async () => {
  const dir = tmp();
  const store = new StateStore(new DirStorage(dir));
  const f = fakeFetch([
    async (_url, init) => {
      const body = JSON.parse(String(init.body));
      assert.equal(body.nonce, (await store.readJson<{ nonce: string }>('nonce.json'))!.nonce, 'the nonce was stored first');
      assert.equal(body.enrol_secret, 's3cret-s3cret');
      assert.equal((init.headers as Record<string, string>)['authorization'], undefined);
      return json(201, ENROLMENT);
    },
    () => json(200, { device_id: 'dev-1', token: 'tok-1', expires: Date.now() / 1e3 + 1000 }),
  ]);
  const http = new Http('http://s', { fetch: f.fetch, ...fast });
  const cfg = { federation: 'fed', enrolSecret: 's3cret-s3cret', profile: 'phone-mid', name: 'js', index: 2, nSamples: null };
  const enr = await enrol(store, http, cfg, (n) => new Uint8Array(n).fill(1));
  assert.equal(enr.device_id, 'dev-1');
  assert.equal(statSync(join(dir, 'enrolment.json')).mode & 0o777, 0o600);
  const again = await enrol(store, http, cfg, (n) => new Uint8Array(n));
  assert.equal(again.token, 'tok-0');
  assert.equal(f.calls.length, 1, 'the kept enrolment is used, not a second one');
  const tokens = new Tokens(store, http);
  await tokens.load(enr);
  assert.equal(http.token, 'tok-0');
  assert.ok(await tokens.due(), 'the expiry is unknown after enrolling: rotate to learn it');
  await tokens.rotate('dev-1');
  assert.equal(http.token, 'tok-1');
  assert.equal((await store.token())!.token, 'tok-1');
  assert.ok(!(await tokens.due()));
  assert.ok(await tokens.due(Date.now() / 1e3 + 600), 'half of the lifetime gone');
  await assert.rejects(enrol(store, http, { ...cfg, federation: 'other' }, (n) => new Uint8Array(n)), EnrolRefused);
});

test('enrolment refusals stop the device', async () => {
  for (const status of [403, 409, 422]) {
    const store = new StateStore(new DirStorage(tmp()));
    const http = new Http('http://s', { fetch: fakeFetch([() => json(status, { detail: 'no' })]).fetch, ...fast });
    await assert.rejects(enrol(store, http, { federation: 'fed', enrolSecret: 'x'.repeat(8), profile: 'phone-mid', name: '', index: null, nSamples: null },
      (n) => new Uint8Array(n)), EnrolRefused);
  }
  // a field added after this release is left out, not refused (docs/protocol.md, "Versions")
  assert.ok(!('extra' in parseEnrolment({ ...ENROLMENT, extra: 1 })));
});

test('MQTT messages: only its own topics, valid, of its federation and not stale, ring the bell', () => {
  const rang: (Task | null)[] = [];
  const bell = new Bell({
    federation: 'fed', deviceId: 'dev-1', clientId: 'pfl-dev-1', brokerUrl: 'mqtt://x', username: 'dev-1', password: 'pw',
    connect: () => { throw new Error('not connected in this test'); },
    onBell: (hint, ann) => rang.push(hint ?? (ann ? null : null)),
    isStale: (t) => t.round < 3,
  });
  const enc = (v: unknown): Uint8Array => new TextEncoder().encode(typeof v === 'string' ? v : JSON.stringify(v));
  const task = { federation: 'fed', round: 3, algorithm: 'fedper', base: 'c'.repeat(64), neighbours: [], deadline: 1e9, final: false };
  bell.message('pfl/fed/device/dev-2/task', enc(task)); // another device's topic
  bell.message('pfl/fed/device/+/task', enc(task)); // not an exact topic
  bell.message('pfl/fed/device/dev-1/task', new Uint8Array()); // a cleared retained message
  bell.message('pfl/fed/device/dev-1/task', enc('{not json')); // not JSON
  bell.message('pfl/fed/device/dev-1/task', enc({ ...task, federation: 'other' })); // another federation
  bell.message('pfl/fed/device/dev-1/task', enc({ ...task, round: 2 })); // stale
  bell.message('pfl/fed/device/dev-1/task', new Uint8Array((1 << 20) + 1)); // too big
  bell.message('pfl/fed/device/dev-1/task', enc([0xff])); // not an object
  assert.equal(rang.length, 0);
  bell.message('pfl/fed/device/dev-1/task', enc({ ...task, extra: 1 })); // a field added since: ignored
  assert.equal(rang.length, 1);
  assert.equal(rang[0]!.round, 3);
  assert.ok(!('extra' in rang[0]!));
  bell.message('pfl/fed/round', enc({ federation: 'fed', round: 3, state: 'collecting', base: null, deadline: 1e9 }));
  bell.message('pfl/fed/round', enc({ federation: 'fed', round: 3, state: 'weird' }));
  assert.equal(rang.length, 2);
  bell.message('pfl/fed/device/dev-1/task', enc(task));
  assert.equal(rang.length, 3);
  assert.deepEqual(parseTask({ federation: 'f', round: 1, algorithm: 'fedper', deadline: 1 }).neighbours, []);
});
