/**
 * Token brokers (docs/protocol.md, "MQTT credentials"; docs/operations.md, "Clustered brokers"; issue 34): the
 * parsers take a JWT password (up to 4,096 characters) and `BrokerInfo.mqtt_password`; `tokenExpiry` reads a JWT's
 * `exp`; and `Bell` asks the server for a fresh token when the broker refuses it (CONNACK 4/5) and at nine tenths
 * of its life, with a fake clock, a fake MQTT client and the HTTP client against a fake `fetch`; then once with the
 * real mqtt.js against a tiny broker (mqtt-packet over TCP) that refuses an expired token.
 */
import assert from 'node:assert/strict';
import { EventEmitter } from 'node:events';
import { type AddressInfo, createServer, type Socket } from 'node:net';
import { test } from 'node:test';

import mqtt, { type IClientOptions, type MqttClient } from 'mqtt';
import * as mqttPacket from 'mqtt-packet';

import { Http } from '../src/http.js';
import { MessageError, parseBrokerInfo, parseEnrolment } from '../src/messages.js';
import { Bell, type Clock, decodeBase64Url, notAuthorised, refreshDelayMs, tokenExpiry, wantsFreshToken } from '../src/mqtt.js';

const b64url = (v: unknown): string => Buffer.from(JSON.stringify(v)).toString('base64url');

/** A JWT-shaped token (ES256 header, a payload with `exp`, a fake signature), padded to `length` characters. */
function jwt(exp: number, length = 0, extra: Record<string, unknown> = {}): string {
  const head = b64url({ alg: 'ES256', typ: 'JWT', kid: 'k1' });
  const sig = 'A'.repeat(86);
  let pad = '';
  for (;;) {
    const t = `${head}.${b64url({ sub: 'dev-1', aud: ['pfl'], exp, scope: ['pfl.configure:*/*'], pad, ...extra })}.${sig}`;
    if (t.length >= length) return t;
    pad += 'x'.repeat(Math.max(1, Math.floor(((length - t.length) * 3) / 4)));
  }
}

const ENROLMENT = {
  device_id: 'dev-1', token: 'tok-0', index: 2, federation: 'fed', config: { algorithm: 'fedper' }, density: 0.5, kp: 2,
  broker_url: 'mqtt://127.0.0.1:1883', mqtt_username: 'dev-1', mqtt_password: 'pw', round: 0, init_digest: 'a'.repeat(64),
};

test('parsers: a JWT of 1,300 (and 4,096) characters is a password; 4,097 is not; BrokerInfo.mqtt_password optional', () => {
  const long = jwt(2e9, 1300);
  assert.ok(long.length >= 1300 && long.length < 1400, String(long.length));
  assert.equal(parseEnrolment({ ...ENROLMENT, mqtt_password: long }).mqtt_password, long);
  assert.equal(parseEnrolment({ ...ENROLMENT, mqtt_password: 'p'.repeat(4096) }).mqtt_password.length, 4096);
  assert.throws(() => parseEnrolment({ ...ENROLMENT, mqtt_password: 'p'.repeat(4097) }), MessageError);
  assert.throws(() => parseEnrolment({ ...ENROLMENT, mqtt_password: null }), MessageError);
  assert.ok(!('extra' in parseEnrolment({ ...ENROLMENT, extra: 1 }))); // a field added since: left out

  assert.deepEqual(parseBrokerInfo({ broker_url: 'mqtt://b:1883' }), { broker_url: 'mqtt://b:1883', mqtt_password: null });
  assert.deepEqual(parseBrokerInfo({ broker_url: 'mqtt://b:1883', mqtt_password: null }), { broker_url: 'mqtt://b:1883', mqtt_password: null });
  assert.equal(parseBrokerInfo({ broker_url: 'mqtts://b:8883', mqtt_password: long }).mqtt_password, long);
  assert.equal(parseBrokerInfo({ broker_url: 'mqtt://b', mqtt_password: 'p'.repeat(4096) }).mqtt_password!.length, 4096);
  assert.throws(() => parseBrokerInfo({ broker_url: 'mqtt://b', mqtt_password: 'p'.repeat(4097) }), MessageError);
  assert.throws(() => parseBrokerInfo({ broker_url: 'mqtt://b', mqtt_password: 5 }), MessageError);
  assert.deepEqual(parseBrokerInfo({ broker_url: 'mqtt://b', mqtt_password: 'x', extra: 1 }), { broker_url: 'mqtt://b', mqtt_password: 'x' });
  assert.throws(() => parseBrokerInfo({ mqtt_password: 'x' }), /broker_url is missing/);
});

test('tokenExpiry: the exp of a JWT (read without verifying); null for a plain password or a token without exp', () => {
  assert.equal(tokenExpiry(jwt(1_700_000_123)), 1_700_000_123);
  assert.equal(tokenExpiry(jwt(1_700_000_123.5, 1300)), 1_700_000_123.5);
  assert.equal(tokenExpiry(jwt(5, 0, { name: 'é€😀>?~' })), 5, 'UTF-8 and base64url\'s - and _');
  assert.equal(tokenExpiry('pw'), null);
  assert.equal(tokenExpiry('Zx3-random_password-without-dots'), null);
  assert.equal(tokenExpiry('a.b'), null);
  assert.equal(tokenExpiry(`x.${b64url({ exp: 5 })}.y.z`), null, 'four parts');
  assert.equal(tokenExpiry(`x.${b64url({ sub: 'd' })}.y`), null, 'no exp');
  assert.equal(tokenExpiry(`x.${b64url({ exp: '5' })}.y`), null, 'exp not a number');
  assert.equal(tokenExpiry(`x.${b64url([5])}.y`), null, 'not an object');
  assert.equal(tokenExpiry('x.bm90IGpzb24.y'), null, 'not JSON');
  assert.equal(tokenExpiry('x.e30+/.y'), null, 'not base64url');
  assert.equal(tokenExpiry('x.A.y'), null, 'not base64 at all');
  assert.equal(tokenExpiry(`x.${Buffer.from('{"exp":7}').toString('base64')}.y`), 7, 'padding is let through');
  for (let n = 0; n < 40; n++) {
    const bytes = Uint8Array.from({ length: n }, (_, i) => (i * 97 + n * 31) & 0xff);
    assert.deepEqual(decodeBase64Url(Buffer.from(bytes).toString('base64url')), bytes, `${n} bytes`);
  }
});

test('a refusal as not authorised asks for a fresh token only when the password is a token', () => {
  const token = jwt(2e9);
  for (const code of [4, 5, 134, 135]) {
    assert.ok(notAuthorised(Object.assign(new Error('Connection refused: Not authorized'), { code })));
    assert.ok(wantsFreshToken(Object.assign(new Error('refused'), { code }), token));
    assert.ok(!wantsFreshToken(Object.assign(new Error('refused'), { code }), 'plain-password'), 'a plain password: nothing changes');
  }
  for (const code of [1, 2, 3, 128, 'ECONNREFUSED', undefined]) assert.ok(!wantsFreshToken(Object.assign(new Error('x'), { code }), token));
  assert.ok(!notAuthorised(null));
  assert.equal(refreshDelayMs('pw', 0), null);
  assert.equal(refreshDelayMs(jwt(1000), 0), 900_000, 'nine tenths of the remaining life');
  assert.equal(refreshDelayMs(jwt(1000), 900_000), 90_000);
  assert.equal(refreshDelayMs(jwt(1000), 2_000_000), 1000, 'already expired: at least 1 s');
  assert.equal(refreshDelayMs(jwt(1e12), 0), 2 ** 31 - 1, 'a JS timer\'s longest wait');
});

// ---------------------------------------------------------------------------- Bell with fakes

class FakeClock implements Clock {
  t = 1_000_000_000_000;
  private seq = 0;
  timers = new Map<number, { at: number; fn: () => void; ms: number }>();
  now(): number {
    return this.t;
  }
  setTimeout(fn: () => void, ms: number): unknown {
    this.timers.set(++this.seq, { at: this.t + ms, fn, ms });
    return this.seq;
  }
  clearTimeout(h: unknown): void {
    this.timers.delete(h as number);
  }
  /** the delays of the pending timers */
  pending(): number[] {
    return [...this.timers.values()].map((x) => x.ms);
  }
  /** moves the clock on by `ms`, firing the timers due */
  advance(ms: number): void {
    this.t += ms;
    for (const [k, x] of [...this.timers].sort((a, b) => a[1].at - b[1].at)) {
      if (x.at > this.t) continue;
      this.timers.delete(k);
      x.fn();
    }
  }
}

class FakeClient extends EventEmitter {
  connected = false;
  incomingStore = { in: true };
  outgoingStore = { out: true };
  reconnects: unknown[] = [];
  passwordsUsed: string[] = [];
  ended = false;
  constructor(readonly options: IClientOptions) {
    super();
    this.passwordsUsed.push(String(options.password));
  }
  reconnect(opts: unknown): this {
    this.reconnects.push(opts);
    this.passwordsUsed.push(String(this.options.password));
    return this;
  }
  publish(_t: string, _p: string, _o: unknown, cb?: (e?: Error) => void): this {
    cb?.();
    return this;
  }
  subscribe(_s: unknown, cb?: (e: Error | null, g: unknown[]) => void): this {
    cb?.(null, []);
    return this;
  }
  end(_force?: boolean, _opts?: unknown, cb?: () => void): this {
    this.ended = true;
    cb?.();
    return this;
  }
  /** the broker's CONNACK refusal, as mqtt.js reports it (an `error` with the return code, then `close`) */
  refuse(code: number): void {
    this.connected = false;
    this.emit('close');
    this.emit('error', Object.assign(new Error(`Connection refused: ${code === 5 ? 'Not authorized' : 'Bad username or password'}`), { code }));
  }
}

const json = (status: number, body: unknown): Response =>
  new Response(JSON.stringify(body), { status, headers: { 'content-type': 'application/json' } });

/** a fake `fetch` answering `GET /v1/devices/me/broker` with the next of `answers` */
function fakeServer(answers: (() => Response)[]): { http: Http; calls: string[] } {
  const calls: string[] = [];
  const f = (async (url: string) => {
    calls.push(url);
    return answers[Math.min(calls.length - 1, answers.length - 1)]!();
  }) as unknown as typeof fetch;
  const http = new Http('http://server', { fetch: f, backoffS: [0.01, 0.02] });
  http.token = 't';
  return { http, calls };
}

const settle = async (): Promise<void> => {
  for (let i = 0; i < 20; i++) await new Promise((r) => setImmediate(r));
};

function fakeBell(password: string, server: { http: Http }, clock: FakeClock): { bell: Bell; clients: FakeClient[]; logs: string[] } {
  const clients: FakeClient[] = [];
  const logs: string[] = [];
  const bell = new Bell({
    federation: 'fed', deviceId: 'dev-1', clientId: 'pfl-dev-1', brokerUrl: 'mqtt://broker:1883', username: 'dev-1', password,
    connect: (_url, opts) => {
      const c = new FakeClient({ ...opts });
      clients.push(c);
      return c as unknown as MqttClient;
    },
    onBell: () => undefined,
    isStale: () => false,
    brokerNow: async () => parseBrokerInfo(await server.http.getJson('/v1/devices/me/broker')),
    log: (_level, msg) => logs.push(msg),
    clock,
  });
  return { bell, clients, logs };
}

test('Bell: a token is refreshed at nine tenths of its life, for the next connect; the timer ends with close', async () => {
  const clock = new FakeClock();
  const now = clock.t / 1e3;
  const first = jwt(now + 3600, 1200);
  const second = jwt(now + 2 * 3600, 1200);
  const server = fakeServer([() => json(200, { broker_url: 'mqtt://broker:1883', mqtt_password: second })]);
  const { bell, clients } = fakeBell(first, server, clock);
  bell.start();
  assert.equal(clients.length, 1);
  assert.equal(clients[0]!.options.password, first);
  assert.deepEqual(clock.pending(), [3600 * 900], 'one timer, at 90% of the remaining hour');
  clock.advance(3600 * 900 - 1);
  await settle();
  assert.equal(server.calls.length, 0);
  clock.advance(1);
  await settle();
  assert.deepEqual(server.calls, ['http://server/v1/devices/me/broker']);
  assert.equal(bell.currentPassword, second);
  assert.equal(clients[0]!.options.password, second, 'mqtt.js reconnects with client.options.password');
  assert.equal(clients[0]!.reconnects.length, 0, 'a connected device is not disconnected for it');
  assert.deepEqual(clock.pending(), [Math.round((2 * 3600 - 3240) * 900)], 'the next one at 90% of the fresh token\'s life');
  await bell.close();
  assert.deepEqual(clock.pending(), [], 'close cancels the timer');
});

test('Bell: a refused token (CONNACK 5) fetches a fresh one at once and reconnects with it; again: after the back-off', async () => {
  const clock = new FakeClock();
  const now = clock.t / 1e3;
  const old = jwt(now - 10); // restarted with an expired token
  const fresh: string[] = []; // a new token at every ask, as the server makes them
  const server = fakeServer([() => {
    fresh.push(jwt(now + 3600 + fresh.length, 1300));
    return json(200, { broker_url: 'mqtt://broker:1883', mqtt_password: fresh.at(-1) });
  }]);
  const { bell, clients, logs } = fakeBell(old, server, clock);
  bell.start();
  assert.deepEqual(clock.pending(), [1000], 'an expired token: a refresh in 1 s');
  const c = clients[0]!;
  c.refuse(5);
  await settle();
  assert.equal(server.calls.length, 1, 'asked at once');
  assert.equal(bell.currentPassword, fresh[0]);
  assert.equal(c.options.password, fresh[0]);
  assert.deepEqual(clock.pending().sort((a, b) => a - b), [0, 3600 * 900], 'a reconnect now, and the refresh of the fresh token');
  clock.advance(0);
  assert.equal(c.reconnects.length, 1);
  assert.deepEqual(c.reconnects[0], { incomingStore: c.incomingStore, outgoingStore: c.outgoingStore }, 'the session\'s stores kept');
  assert.deepEqual(c.passwordsUsed, [old, fresh[0]]);
  assert.ok(logs.some((m) => /fresh MQTT token/.test(m)));

  c.refuse(4); // the broker refuses the fresh token too: ask again, but reconnect only after the back-off
  await settle();
  assert.equal(server.calls.length, 2);
  assert.equal(c.options.password, fresh[1]);
  const period = c.options.reconnectPeriod!;
  assert.ok(period >= 2000, String(period));
  assert.ok(clock.pending().includes(period));
  clock.advance(period);
  assert.equal(c.reconnects.length, 2);

  c.connected = true;
  c.emit('connect');
  c.connected = false;
  c.refuse(5); // later (a broker restart with the token expired): at once again
  await settle();
  assert.equal(server.calls.length, 3);
  assert.ok(clock.pending().includes(0));
  clock.advance(0);
  assert.deepEqual(c.passwordsUsed, [old, fresh[0], fresh[1], fresh[2]]);
  await bell.close();
  assert.deepEqual(clock.pending(), [], 'close cancels the refresh and the reconnect');
});

test('Bell: a refusal the server cannot help (401: revoked) retries after the back-off; a plain password changes nothing', async () => {
  const clock = new FakeClock();
  const token = jwt(clock.t / 1e3 - 1);
  const server = fakeServer([() => json(401, { detail: 'revoked' })]);
  const { bell, clients, logs } = fakeBell(token, server, clock);
  bell.start();
  clients[0]!.refuse(5);
  await settle();
  assert.equal(server.calls.length, 1);
  assert.equal(bell.currentPassword, token);
  assert.ok(logs.some((m) => /could not fetch a fresh MQTT token/.test(m)));
  assert.ok(clock.pending().includes(clients[0]!.options.reconnectPeriod!));
  await bell.close();
  assert.deepEqual(clock.pending(), []);

  const plainServer = fakeServer([() => json(200, { broker_url: 'mqtt://broker:1883' })]);
  const plain = fakeBell('plain-password', plainServer, clock);
  plain.bell.start();
  assert.deepEqual(clock.pending(), [], 'no refresh timer for a plain password');
  plain.clients[0]!.refuse(5);
  await settle();
  assert.equal(plainServer.calls.length, 0, 'no fetch');
  assert.equal(plain.clients[0]!.reconnects.length, 0);
  assert.equal(plain.clients[0]!.options.password, 'plain-password');
  await plain.bell.close();
});

test('Bell: a BrokerInfo without mqtt_password keeps the password; a moved broker is followed with the fresh token', async () => {
  const clock = new FakeClock();
  const now = clock.t / 1e3;
  const old = jwt(now - 10);
  const fresh = jwt(now + 600);
  const server = fakeServer([
    () => json(200, { broker_url: 'mqtt://broker:1883', mqtt_password: null }),
    () => json(200, { broker_url: 'mqtt://other:1883', mqtt_password: fresh }),
  ]);
  const { bell, clients } = fakeBell(old, server, clock);
  bell.start();
  clock.advance(1000); // the expired token's refresh: the answer has none
  await settle();
  assert.equal(server.calls.length, 1);
  assert.equal(bell.currentPassword, old);
  clients[0]!.refuse(5);
  await settle();
  assert.equal(clients.length, 2, 'a new client for the moved broker');
  assert.ok(clients[0]!.ended);
  assert.equal(clients[1]!.options.password, fresh);
  await bell.close();
});

// ------------------------------------------------------------------ the real mqtt.js against a tiny broker

/** A broker that accepts only `good` as the password (CONNACK 5 otherwise) and acknowledges what it is sent. */
async function tinyBroker(good: () => string): Promise<{ port: number; passwords: string[]; close: () => Promise<void> }> {
  const passwords: string[] = [];
  const sockets = new Set<Socket>();
  const server = createServer((sock) => {
    sockets.add(sock);
    sock.on('close', () => sockets.delete(sock));
    sock.on('error', () => undefined);
    const parser = mqttPacket.parser({ protocolVersion: 4 });
    const send = (p: object): void => {
      sock.write(mqttPacket.generate(p as mqttPacket.Packet));
    };
    parser.on('packet', (p: mqttPacket.Packet) => {
      if (p.cmd === 'connect') {
        const pw = p.password === undefined ? '' : p.password.toString();
        passwords.push(pw);
        const ok = pw === good();
        send({ cmd: 'connack', returnCode: ok ? 0 : 5, sessionPresent: false });
        if (!ok) sock.end();
      } else if (p.cmd === 'subscribe') {
        send({ cmd: 'suback', messageId: p.messageId, granted: p.subscriptions.map((s) => s.qos) });
      } else if (p.cmd === 'publish' && p.qos === 1) {
        send({ cmd: 'puback', messageId: p.messageId });
      } else if (p.cmd === 'pingreq') {
        send({ cmd: 'pingresp' });
      } else if (p.cmd === 'disconnect') {
        sock.end();
      }
    });
    sock.on('data', (d) => parser.parse(d));
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return {
    port: (server.address() as AddressInfo).port,
    passwords,
    close: () => new Promise<void>((r) => {
      for (const s of sockets) s.destroy();
      server.close(() => r());
    }),
  };
}

test('Bell with mqtt.js: refused with an expired token (CONNACK 5), it fetches a fresh one and connects with it', async () => {
  const now = Date.now() / 1e3;
  const old = jwt(now - 60, 1100);
  const fresh = jwt(now + 3600, 1300);
  const broker = await tinyBroker(() => fresh);
  const server = fakeServer([() => json(200, { broker_url: `mqtt://127.0.0.1:${broker.port}`, mqtt_password: fresh })]);
  let bells = 0;
  let connected!: () => void;
  const up = new Promise<void>((r) => { connected = r; });
  const bell = new Bell({
    federation: 'fed', deviceId: 'dev-1', clientId: 'pfl-dev-1', brokerUrl: `mqtt://127.0.0.1:${broker.port}`, username: 'dev-1', password: old,
    connect: (url, opts) => mqtt.connect(url, opts),
    onBell: () => { bells++; connected(); },
    isStale: () => false,
    brokerNow: async () => parseBrokerInfo(await server.http.getJson('/v1/devices/me/broker')),
  });
  try {
    bell.start();
    let timer: ReturnType<typeof setTimeout> | undefined;
    await Promise.race([up, new Promise((_, reject) => { timer = setTimeout(() => reject(new Error('not connected in 10 s')), 10_000); })]);
    clearTimeout(timer);
    assert.deepEqual(broker.passwords, [old, fresh], 'refused once, then connected with the fresh token');
    assert.equal(server.calls.length, 1);
    assert.equal(bells, 1);
    assert.equal(bell.currentPassword, fresh);
  } finally {
    await bell.close();
    await broker.close();
  }
});
