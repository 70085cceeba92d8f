/**
 * The device's own key (docs/protocol.md, "Device keys"; issue 49): the messages and signatures equal the Python
 * definition's (pfl_edge/device_key.py; Ed25519 is deterministic, so a fixed key gives one signature: golden
 * vectors made there), the key and counter are kept private in the state dir, and every enrolment attempt is
 * signed afresh with the next counter (the server takes a counter once only).
 */
import assert from 'node:assert/strict';
import { webcrypto } from 'node:crypto';
import { mkdtempSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';

import { DeviceKey, enrolMessage, rotateMessage } from '../src/devicekey.js';
import { enrol, Tokens } from '../src/enrol.js';
import { Http } from '../src/http.js';
import { DirStorage } from '../src/nodejs/fs.js';
import { StateStore } from '../src/state.js';

const subtle = webcrypto.subtle;
const tmp = (): string => mkdtempSync(join(tmpdir(), 'pfl-key-'));
// from Python: k = '11' * 32; public_of(k), sign(k, enrol_message('fed', 'ab' * 16, public_of(k), 7)),
// sign(k, rotate_message('dev-1', 8))
const KEY = '11'.repeat(32);
const PUBLIC = 'd04ab232742bb4ab3a1368bd4615e4e6d0224ab71a016baf8520a332c9778737';
const ENROL_SIG = '4c3ac9594738ac308482ad25db127fe1aaaa9fa827029219a67ed45668dc98356d40fff16fd006692a08be5ec0a53b2b1b22e20ea7953ee840949db457fb4206';
const ROTATE_SIG = '869ab03549dd2c8dbae2f50568128c37ec8a0c07b61aa4e6cedb63060ff2ac7b73e42a68c21aa06fd112ba7846e8370e0779b7b5802f0dec82d39275f0326003';

test('signatures equal the Python definition for the same key, message and counter', async () => {
  const dir = tmp();
  writeFileSync(join(dir, 'device-key.json'), JSON.stringify({ key: KEY, public: PUBLIC, counter: 6 }));
  const key = await DeviceKey.load(new StateStore(new DirStorage(dir)), subtle);
  assert.equal(key.publicKey, PUBLIC);
  const p = await key.prove((c) => enrolMessage('fed', 'ab'.repeat(16), PUBLIC, c));
  assert.deepEqual(p, { counter: 7, signature: ENROL_SIG });
  assert.deepEqual(await key.prove((c) => rotateMessage('dev-1', c)), { counter: 8, signature: ROTATE_SIG });
  assert.equal(JSON.parse(readFileSync(join(dir, 'device-key.json'), 'utf8')).counter, 8);
});

test('a new key is made once, kept private, and its signatures verify', async () => {
  const dir = tmp();
  const store = new StateStore(new DirStorage(dir));
  const a = await DeviceKey.load(store, subtle);
  assert.equal(statSync(join(dir, 'device-key.json')).mode & 0o777, 0o600);
  const b = await DeviceKey.load(store, subtle);
  assert.equal(a.publicKey, b.publicKey);
  const msg = enrolMessage('f', '00'.repeat(16), a.publicKey, 1);
  const p = await b.prove(() => msg);
  const pub = await subtle.importKey('raw', Buffer.from(a.publicKey, 'hex'), { name: 'Ed25519' }, false, ['verify']);
  assert.ok(await subtle.verify({ name: 'Ed25519' }, pub, Buffer.from(p.signature, 'hex'), msg));
  msg[0] = (msg[0] ?? 0) ^ 1;
  assert.ok(!(await subtle.verify({ name: 'Ed25519' }, pub, Buffer.from(p.signature, 'hex'), msg)));
});

test('each enrolment attempt is signed with the next counter, and a rotation carries a proof', async () => {
  const dir = tmp();
  const store = new StateStore(new DirStorage(dir));
  const seen: Record<string, unknown>[] = [];
  const fetch = async (_url: string | URL | Request, init?: RequestInit): Promise<Response> => {
    const body = JSON.parse(String(init?.body ?? 'null')) as Record<string, unknown>;
    seen.push(body);
    if (seen.length === 1) return new Response('{"detail": "busy"}', { status: 503, headers: { 'retry-after': '0' } });
    if (String(_url).endsWith('/me/token')) {
      return Response.json({ device_id: 'dev-1', token: 'tok-1', expires: 2e9 });
    }
    return Response.json({
      device_id: 'dev-1', token: 'tok-0', index: 0, federation: 'f', config: {}, density: 0.5, kp: 2,
      broker_url: 'mqtt://h:1883', mqtt_username: 'dev-1', mqtt_password: 'pw', round: 0, init_digest: 'a'.repeat(64),
      mqtt_client_id: 'pfl-' + 'c'.repeat(32),
    }, { status: 201 });
  };
  const http = new Http('http://server.test', { fetch: fetch as typeof globalThis.fetch, backoffS: [0, 0] });
  const enr = await enrol(store, http, { federation: 'f', enrolSecret: 's'.repeat(16), profile: 'phone-mid', name: '',
    index: null, nSamples: null, subtle }, (n) => new Uint8Array(n).fill(7));
  assert.equal(enr.mqtt_client_id, 'pfl-' + 'c'.repeat(32));
  const proofs = seen.map((b) => b['proof'] as { counter: number; signature: string });
  assert.deepEqual(proofs.map((p) => p.counter), [1, 2]);
  assert.notEqual(proofs[0]!.signature, proofs[1]!.signature);
  const tokens = new Tokens(store, http, () => undefined, subtle);
  await tokens.load(enr);
  await tokens.rotate('dev-1');
  const rotation = seen[2]!['proof'] as { counter: number; signature: string };
  assert.equal(rotation.counter, 3);
  const pub = await subtle.importKey('raw', Buffer.from(String(seen[1]!['public_key']), 'hex'), { name: 'Ed25519' }, false, ['verify']);
  assert.ok(await subtle.verify({ name: 'Ed25519' }, pub, Buffer.from(rotation.signature, 'hex'), rotateMessage('dev-1', 3)));
});
